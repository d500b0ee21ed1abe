//! A minimal GGUF v3 writer for crafting small (and deliberately broken) model files in tests.

use std::path::Path;

/// A metadata value of the kinds the tests need.
pub enum Value {
    /// uint32
    U32(u32),
    /// float32
    F32(f32),
    /// bool
    Bool(bool),
    /// string
    Str(String),
    /// array of strings
    StrArray(Vec<String>),
    /// array of float32
    F32Array(Vec<f32>),
    /// array of int32
    I32Array(Vec<i32>),
}

/// Tensor type ids of the GGUF format used here.
pub const TYPE_F32: u32 = 0;

struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes them as one GGUF file.
#[derive(Default)]
pub struct GgufWriter {
    kv: Vec<(String, Value)>,
    tensors: Vec<Tensor>,
}

const ALIGN: usize = 32;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl GgufWriter {
    /// Adds (or replaces) a metadata entry.
    pub fn kv(&mut self, key: &str, value: Value) -> &mut Self {
        self.kv.retain(|(k, _)| k != key);
        self.kv.push((key.to_string(), value));
        self
    }

    /// Adds an F32 tensor with ggml dims (contiguous dimension first).
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], data: &[f32]) -> &mut Self {
        assert_eq!(dims.iter().product::<u64>() as usize, data.len(), "{name}");
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor_raw(name, dims, TYPE_F32, bytes)
    }

    /// Adds a tensor of any type id with the given raw bytes.
    pub fn tensor_raw(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push(Tensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data,
        });
        self
    }

    /// Removes a tensor by name.
    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        self.tensors.retain(|t| t.name != name);
        self
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut out, k);
            let array = |ty: u32, n: usize, out: &mut Vec<u8>| {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&(n as u64).to_le_bytes());
            };
            match v {
                Value::U32(x) => {
                    out.extend_from_slice(&4u32.to_le_bytes());
                    out.extend_from_slice(&x.to_le_bytes());
                }
                Value::F32(x) => {
                    out.extend_from_slice(&6u32.to_le_bytes());
                    out.extend_from_slice(&x.to_le_bytes());
                }
                Value::Bool(b) => {
                    out.extend_from_slice(&7u32.to_le_bytes());
                    out.push(u8::from(*b));
                }
                Value::Str(s) => {
                    out.extend_from_slice(&8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Value::StrArray(items) => {
                    array(8, items.len(), &mut out);
                    for s in items {
                        put_str(&mut out, s);
                    }
                }
                Value::F32Array(items) => {
                    array(6, items.len(), &mut out);
                    items
                        .iter()
                        .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
                Value::I32Array(items) => {
                    array(5, items.len(), &mut out);
                    items
                        .iter()
                        .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
            }
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).div_ceil(ALIGN) * ALIGN;
        }
        out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
        let base = out.len();
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(base + off, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }

    /// Writes the file.
    pub fn write(&self, path: &Path) {
        std::fs::write(path, self.to_bytes()).expect("write test GGUF");
    }
}
