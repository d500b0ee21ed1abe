//! markbase-cpu
