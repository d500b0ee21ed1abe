//! Hugging Face weight directories: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, memory-mapped, tensors borrowed in place.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::backend::HostBytes;
use crate::quant::GgmlType;
use crate::{Error, Result};

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct StTensor {
    /// Element type (F32, F16 or BF16).
    pub dtype: GgmlType,
    /// PyTorch shape.
    pub shape: Vec<usize>,
    file: usize,
    start: usize,
    end: usize,
}

/// The safetensors weights of a model directory.
pub struct SafetensorsDir {
    dir: PathBuf,
    maps: Vec<Arc<Mmap>>,
    files: Vec<PathBuf>,
    tensors: HashMap<String, StTensor>,
}

impl SafetensorsDir {
    /// Opens `dir/model.safetensors.index.json` and its shards, else `dir/model.safetensors`,
    /// else the directory's single `*.safetensors` file.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.is_file() {
            shard_names(&index)?
                .into_iter()
                .map(|n| dir.join(n))
                .collect()
        } else if dir.join("model.safetensors").is_file() {
            vec![dir.join("model.safetensors")]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| Error::io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.len() != 1 {
                return Err(Error::Format(format!(
                    "{}: expected model.safetensors, an index file, or one *.safetensors file; found {}",
                    dir.display(),
                    found.len()
                )));
            }
            found
        };
        let mut out = SafetensorsDir {
            dir: dir.to_path_buf(),
            maps: Vec::new(),
            files: Vec::new(),
            tensors: HashMap::new(),
        };
        for path in files {
            out.add_file(&path)?;
        }
        Ok(out)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is mapped read-only; like every mmap reader we rely on it not being
        // truncated while mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let st = SafeTensors::deserialize(&map)
            .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
        let base = map.as_ptr() as usize;
        let idx = self.maps.len();
        for (name, view) in st.iter() {
            let dtype = match view.dtype() {
                Dtype::F32 => GgmlType::F32,
                Dtype::F16 => GgmlType::F16,
                Dtype::BF16 => GgmlType::BF16,
                other => {
                    return Err(Error::Unsupported(format!(
                        "{}: tensor '{name}' has dtype {other:?} (F32, F16, BF16 supported)",
                        path.display()
                    )))
                }
            };
            let start = view.data().as_ptr() as usize - base;
            let t = StTensor {
                dtype,
                shape: view.shape().to_vec(),
                file: idx,
                start,
                end: start + view.data().len(),
            };
            if self.tensors.insert(name.to_string(), t).is_some() {
                return Err(Error::Format(format!(
                    "{}: tensor '{name}' appears in more than one shard",
                    path.display()
                )));
            }
        }
        drop(st);
        self.maps.push(Arc::new(map));
        self.files.push(path.to_path_buf());
        Ok(())
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The weight files, in load order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// A tensor's description.
    pub fn get(&self, name: &str) -> Option<&StTensor> {
        self.tensors.get(name)
    }

    /// All tensor names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor's bytes, zero-copy.
    pub fn bytes(&self, t: &StTensor) -> HostBytes {
        HostBytes::Mapped {
            map: self.maps[t.file].clone(),
            range: t.start..t.end,
        }
    }

    /// A tensor's values converted to f32.
    pub fn to_f32(&self, t: &StTensor) -> Vec<f32> {
        let b = &self.maps[t.file][t.start..t.end];
        match t.dtype {
            GgmlType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            GgmlType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }
    }
}

/// Distinct shard file names of an index, in first-seen order.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Format(format!("{}: invalid JSON: {e}", index.display())))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Format(format!("{}: no weight_map object", index.display())))?;
    let mut names: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            Error::Format(format!(
                "{}: weight_map entry '{tensor}' is not a file name",
                index.display()
            ))
        })?;
        if file.contains('/') || file.contains('\\') || file.contains("..") {
            return Err(Error::Format(format!(
                "{}: shard name '{file}' is not a plain file name",
                index.display()
            )));
        }
        if !names.iter().any(|n| n == file) {
            names.push(file.to_string());
        }
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("markbase-st-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn sharded_dir_with_index() {
        let d = tmpdir("shards");
        let a: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = [half::bf16::from_f32(3.0), half::bf16::from_f32(-0.5)]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        write(
            &d.join("model-00001-of-00002.safetensors"),
            &[("x", Dtype::F32, vec![2], a)],
        );
        write(
            &d.join("model-00002-of-00002.safetensors"),
            &[("y", Dtype::BF16, vec![1, 2], b)],
        );
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {"x": "model-00001-of-00002.safetensors",
                "y": "model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let st = SafetensorsDir::open(&d).unwrap();
        assert_eq!(st.files().len(), 2);
        let x = st.get("x").unwrap();
        assert_eq!(st.to_f32(x), vec![1.5, -2.0]);
        let y = st.get("y").unwrap();
        assert_eq!(y.dtype, GgmlType::BF16);
        assert_eq!(y.shape, vec![1, 2]);
        assert_eq!(st.to_f32(y), vec![3.0, -0.5]);
        assert_eq!(st.bytes(y).as_slice().len(), 4);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unsupported_dtype_and_missing_files_are_errors() {
        let d = tmpdir("bad");
        write(
            &d.join("model.safetensors"),
            &[("i", Dtype::I32, vec![1], vec![0, 0, 0, 0])],
        );
        let e = SafetensorsDir::open(&d).err().unwrap();
        assert!(e.to_string().contains("'i'"), "{e}");
        std::fs::remove_file(d.join("model.safetensors")).unwrap();
        let e = SafetensorsDir::open(&d).err().unwrap();
        assert!(e.to_string().contains("found 0"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
