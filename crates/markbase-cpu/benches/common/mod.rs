//! Helpers shared by the benchmarks.

use std::sync::Arc;

use markbase_core::backend::{HostBytes, HostMatrix};
use markbase_core::quant::GgmlType;
use rand::rngs::StdRng;
use rand::Rng;

/// Random weight rows of `ty` with sane block scales (every f16 scale 2⁻⁴).
pub fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut StdRng) -> HostMatrix {
    let mut bytes = vec![0u8; rows * ty.bytes_for(cols).unwrap()];
    rng.fill(&mut bytes[..]);
    let scale_at: &[usize] = match ty {
        GgmlType::Q6_K => &[208],
        GgmlType::Q4_K => &[0, 2],
        _ => &[0],
    };
    for b in bytes.chunks_exact_mut(ty.type_size()) {
        for &at in scale_at {
            b[at..at + 2].copy_from_slice(&0x2C00u16.to_le_bytes());
        }
    }
    HostMatrix {
        name: format!("{ty}"),
        ty,
        rows,
        cols,
        bytes: HostBytes::Owned(Arc::from(bytes)),
    }
}
