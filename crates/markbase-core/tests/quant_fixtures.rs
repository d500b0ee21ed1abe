//! `dequantize_row` against gguf-py's dequantization of the same blocks
//! (tests/fixtures/quant, written by scripts/make_quant_fixtures.py).
//!
//! The reference code performs the same f32 operations in the same order as ggml/gguf-py
//! (no fused multiply-adds), so the comparison is bit-exact.

use std::path::PathBuf;

use markbase_core::quant::{dequantize_row, GgmlType};
use markbase_core::Error;

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/quant")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn load(ty: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let raw = fixture(&format!("{ty}.bin"));
    let expected = fixture(&format!("{ty}.f32"))
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (raw, expected)
}

#[test]
fn every_format_matches_gguf_py_bit_for_bit() {
    for ty in GgmlType::ALL {
        let (raw, expected) = load(ty);
        assert_eq!(
            raw.len(),
            ty.bytes_for(expected.len()).unwrap(),
            "{ty}: fixture sizes disagree"
        );
        let mut got = vec![0f32; expected.len()];
        dequantize_row(ty, &raw, &mut got).unwrap();
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(
                g.to_bits(),
                e.to_bits(),
                "{ty}: weight {i} (block {}): got {g}, gguf-py {e}",
                i / ty.block_size()
            );
        }
    }
}

#[test]
fn rows_may_start_at_any_block() {
    for ty in GgmlType::ALL {
        let (raw, expected) = load(ty);
        let (bs, ts) = (ty.block_size(), ty.type_size());
        let blocks = expected.len() / bs;
        // a row of the middle blocks only
        let (first, count) = (blocks / 3, blocks / 2);
        let mut got = vec![0f32; count * bs];
        dequantize_row(ty, &raw[first * ts..(first + count) * ts], &mut got).unwrap();
        assert_eq!(got, expected[first * bs..(first + count) * bs], "{ty}");
    }
}

#[test]
fn size_mismatches_are_format_errors_naming_the_sizes() {
    let mut dst = [0f32; 64];
    let err = dequantize_row(GgmlType::Q4_0, &[0u8; 35], &mut dst).unwrap_err();
    assert!(matches!(err, Error::Format(_)));
    let msg = err.to_string();
    assert!(
        msg.contains("Q4_0") && msg.contains("64") && msg.contains("36") && msg.contains("35"),
        "{msg}"
    );

    let mut dst = [0f32; 100];
    let err = dequantize_row(GgmlType::Q6_K, &[0u8; 210], &mut dst).unwrap_err();
    assert!(matches!(err, Error::Format(_)));
    assert!(err.to_string().contains("100"), "{err}");
}

fn floats(raw: &[u8]) -> Vec<f32> {
    raw.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn quantizers_match_gguf_py_byte_for_byte() {
    use markbase_core::quant::{quantize_row, QUANTIZABLE};
    let input = floats(&fixture("quantize_input.f32"));
    for ty in QUANTIZABLE {
        let expected = fixture(&format!("quantize_{ty}.bin"));
        let mut got = vec![0u8; ty.bytes_for(input.len()).unwrap()];
        quantize_row(ty, &input, &mut got).unwrap();
        for (b, (g, e)) in got
            .chunks_exact(ty.type_size())
            .zip(expected.chunks_exact(ty.type_size()))
            .enumerate()
        {
            assert_eq!(g, e, "{ty}: block {b} differs from gguf-py's");
        }
    }
}

#[test]
fn quantizer_rejects_bad_sizes_and_formats() {
    use markbase_core::quant::quantize_row;
    let x = [0.5f32; 64];
    let mut short = vec![0u8; 10];
    assert!(matches!(
        quantize_row(GgmlType::Q4_0, &x, &mut short),
        Err(Error::Format(_))
    ));
    let mut out = vec![0u8; 1024];
    assert!(matches!(
        quantize_row(GgmlType::Q4_K, &x[..32], &mut out),
        Err(Error::Unsupported(_)) | Err(Error::Format(_))
    ));
}
