//! Named weights from a GGUF file or a Hugging Face safetensors directory, checked for shape.

use std::sync::Arc;

use markbase_core::backend::{HostBytes, HostMatrix};
use markbase_core::gguf::GgufFile;
use markbase_core::quant::dequantize_row;
use markbase_core::safetensors::SafetensorsDir;
use markbase_core::{Error, Result};

use crate::synthetic::SyntheticWeights;

/// Where weights come from; names are the source's own (GGUF or HF).
pub enum WeightStore {
    /// A GGUF file (norms already hold `1 + w` for Gemma 3).
    Gguf(Arc<GgufFile>),
    /// A safetensors directory; `prefix` is prepended to text-model names
    /// (`model.`, `language_model.model.` or `model.language_model.`).
    Hf {
        /// The mapped weights.
        st: SafetensorsDir,
        /// Prefix of the text model's tensors.
        prefix: String,
    },
    /// Random weights generated on request (HF names without a prefix).
    Synthetic(Arc<SyntheticWeights>),
}

/// The HF LM head lives outside the text-model prefix.
const HF_LM_HEADS: [&str; 2] = ["lm_head.weight", "language_model.lm_head.weight"];

impl WeightStore {
    /// The full HF name of a text-model tensor.
    fn hf_name(st: &SafetensorsDir, prefix: &str, name: &str) -> String {
        if name == HF_LM_HEADS[0] {
            if let Some(n) = HF_LM_HEADS.iter().find(|n| st.get(n).is_some()) {
                return n.to_string();
            }
            return name.to_string();
        }
        format!("{prefix}{name}")
    }

    /// Whether a tensor exists (name without the HF prefix).
    pub fn has(&self, name: &str) -> bool {
        match self {
            WeightStore::Gguf(f) => f.tensor(name).is_some(),
            WeightStore::Hf { st, prefix } => st.get(&Self::hf_name(st, prefix, name)).is_some(),
            WeightStore::Synthetic(w) => w.has(name),
        }
    }

    /// Stored bytes of a tensor (0 if absent).
    pub fn n_bytes(&self, name: &str) -> u64 {
        match self {
            WeightStore::Gguf(f) => f.tensor(name).map_or(0, |t| t.n_bytes),
            WeightStore::Hf { st, prefix } => st
                .get(&Self::hf_name(st, prefix, name))
                .map_or(0, |t| st.bytes(t).as_slice().len() as u64),
            WeightStore::Synthetic(w) => w.n_bytes(name),
        }
    }

    /// A `[rows, cols]` matrix as stored.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix> {
        let (full, ty, shape, bytes) = match self {
            WeightStore::Synthetic(w) => {
                let t = w
                    .tensors()
                    .get(name)
                    .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
                if t.shape != [rows, cols] {
                    return Err(Error::BadTensor {
                        name: name.to_string(),
                        problem: format!("shape {:?}, expected [{rows}, {cols}]", t.shape),
                    });
                }
                return w.matrix(name, rows, cols);
            }
            WeightStore::Gguf(f) => {
                let t = f
                    .tensor(name)
                    .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
                let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
                let start = t.offset as usize;
                let bytes = HostBytes::Mapped {
                    map: f.mmap().clone(),
                    range: start..start + t.n_bytes as usize,
                };
                (name.to_string(), t.dtype, shape, bytes)
            }
            WeightStore::Hf { st, prefix } => {
                let full = Self::hf_name(st, prefix, name);
                let t = st
                    .get(&full)
                    .ok_or_else(|| Error::MissingTensor(full.clone()))?;
                (full, t.dtype, t.shape.clone(), st.bytes(t))
            }
        };
        if shape != [rows, cols] {
            return Err(Error::BadTensor {
                name: full,
                problem: format!("shape {shape:?}, expected [{rows}, {cols}]"),
            });
        }
        let m = HostMatrix {
            name: full,
            ty,
            rows,
            cols,
            bytes,
        };
        m.check()?;
        Ok(m)
    }

    /// A norm weight of `len` values as f32; `plus_one` adds 1 (HF Gemma 3 stores `w` for
    /// `(1 + w)`, GGUF already stores `1 + w`).
    pub fn norm(&self, name: &str, len: usize, plus_one: bool) -> Result<Vec<f32>> {
        let (full, ty, shape, bytes) = match self {
            WeightStore::Synthetic(w) => {
                let mut v = w.vector(name, len)?;
                if plus_one {
                    v.iter_mut().for_each(|x| *x += 1.0);
                }
                return Ok(v);
            }
            WeightStore::Gguf(f) => {
                let t = f
                    .tensor(name)
                    .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
                let shape: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
                (name.to_string(), t.dtype, shape, f.tensor_data(t).to_vec())
            }
            WeightStore::Hf { st, prefix } => {
                let full = Self::hf_name(st, prefix, name);
                let t = st
                    .get(&full)
                    .ok_or_else(|| Error::MissingTensor(full.clone()))?;
                let b = st.bytes(t).as_slice().to_vec();
                (full, t.dtype, t.shape.clone(), b)
            }
        };
        if shape != [len] {
            return Err(Error::BadTensor {
                name: full,
                problem: format!("shape {shape:?}, expected [{len}]"),
            });
        }
        let mut out = vec![0f32; len];
        dequantize_row(ty, &bytes, &mut out).map_err(|e| Error::BadTensor {
            name: full,
            problem: e.to_string(),
        })?;
        if plus_one {
            out.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(out)
    }
}
