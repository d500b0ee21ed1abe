//! markbase-models
