//! markbase-engine
