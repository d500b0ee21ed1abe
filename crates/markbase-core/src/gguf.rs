//! GGUF v2/v3 reader: header, metadata of every value type, tensor infos, and tensor data
//! memory-mapped in place (never copied).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::quant::GgmlType;
use crate::{Error, Result};

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// uint8
    U8(u8),
    /// int8
    I8(i8),
    /// uint16
    U16(u16),
    /// int16
    I16(i16),
    /// uint32
    U32(u32),
    /// int32
    I32(i32),
    /// float32
    F32(f32),
    /// bool
    Bool(bool),
    /// UTF-8 string
    String(String),
    /// array of values of one type
    Array(Vec<MetaValue>),
    /// uint64
    U64(u64),
    /// int64
    I64(i64),
    /// float64
    F64(f64),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The name of the value's GGUF type, for messages and `inspect`.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
        }
    }
}

/// Where one tensor lives in the file and what it holds.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// ggml dimensions, contiguous one first (`{ne0, ne1, …}`).
    pub dims: Vec<u64>,
    /// Storage type.
    pub dtype: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An open GGUF file: parsed header and metadata plus the mapped file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Arc<Mmap>,
    /// Format version (2 or 3).
    pub version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Alignment of tensor data (`general.alignment`, default 32).
    pub alignment: u64,
    /// Absolute offset where the tensor data section starts.
    pub data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Cursor over the mapped header bytes, with errors that say what was being read.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(Error::Format(format!(
                "truncated GGUF: {what} at byte {} needs {n} bytes, file has {}",
                self.pos,
                self.buf.len()
            ))),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.buf.len() - self.pos)
            .ok_or_else(|| {
                Error::Format(format!(
                    "truncated GGUF: {what} at byte {} claims {len} bytes, file has {}",
                    self.pos,
                    self.buf.len()
                ))
            })?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| Error::Format(format!("GGUF {what} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(what)?[0]),
            1 => MetaValue::I8(self.array::<1>(what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(Error::Format(format!("GGUF {what}: bool byte {b}"))),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth > 0 {
                    return Err(Error::Format(format!("GGUF {what}: nested arrays")));
                }
                let item_ty = self.u32(what)?;
                let count = self.u64(what)?;
                // Every item takes at least one byte: a larger count is a corrupt file.
                if count > (self.buf.len() - self.pos) as u64 {
                    return Err(Error::Format(format!(
                        "truncated GGUF: {what} claims {count} array items at byte {}, file has {} bytes",
                        self.pos,
                        self.buf.len()
                    )));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(item_ty, what, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => {
                return Err(Error::Format(format!(
                    "GGUF {what}: unknown value type {other}"
                )))
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses `path`; tensor data stays mapped, not read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; MarkBase never writes model files while they are open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path, Arc::new(mmap)).map_err(|e| match e {
            Error::Format(m) => Error::Format(format!("{}: {m}", path.display())),
            Error::Unsupported(m) => Error::Unsupported(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    fn parse(path: &Path, mmap: Arc<Mmap>) -> Result<Self> {
        let buf: &[u8] = &mmap;
        let mut r = Reader { buf, pos: 0 };
        let magic = r.take(4, "magic").map_err(|_| {
            Error::Format(format!(
                "not a GGUF file: {} bytes, too short for the header",
                buf.len()
            ))
        })?;
        if magic != GGUF_MAGIC {
            return Err(Error::Format(format!(
                "not a GGUF file: magic {:?}, expected \"GGUF\"",
                String::from_utf8_lossy(magic)
            )));
        }
        let version = r.u32("version")?;
        match version {
            2 | 3 => {}
            1 => return Err(Error::Unsupported("GGUF version 1 (only v2 and v3)".into())),
            v if v.swap_bytes() <= 3 => {
                return Err(Error::Unsupported("big-endian GGUF".into()));
            }
            v => return Err(Error::Unsupported(format!("GGUF version {v}"))),
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        if n_tensors > buf.len() as u64 || n_kv > buf.len() as u64 {
            return Err(Error::Format(format!(
                "corrupt GGUF header: {n_tensors} tensors, {n_kv} metadata entries in a {}-byte file",
                buf.len()
            )));
        }

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("type of metadata '{key}'"))?;
            let value = r.value(ty, &format!("metadata '{key}'"), 0)?;
            meta_index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment") {
            Some(&i) => {
                let a = metadata[i].1.as_u64().unwrap_or(0);
                if a == 0 || !a.is_power_of_two() {
                    return Err(Error::Format(format!(
                        "general.alignment {:?} is not a power of two",
                        metadata[i].1
                    )));
                }
                a
            }
            None => DEFAULT_ALIGNMENT,
        };

        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("name of tensor #{i}"))?;
            let n_dims = r.u32(&format!("dimension count of tensor '{name}'"))?;
            if n_dims == 0 || n_dims > 4 {
                return Err(Error::Format(format!(
                    "tensor '{name}' has {n_dims} dimensions (1 to 4 allowed)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("dimensions of tensor '{name}'"))?);
            }
            let ty = r.u32(&format!("type of tensor '{name}'"))?;
            let offset = r.u64(&format!("offset of tensor '{name}'"))?;
            raw.push((name, dims, ty, offset));
        }
        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = buf.len() as u64;

        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::new();
        for (name, dims, ty, rel) in raw {
            let dtype = GgmlType::from_id(ty).map_err(|e| match e {
                Error::Unsupported(m) => Error::Unsupported(format!("tensor '{name}': {m}")),
                other => other,
            })?;
            let n_el = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| Error::Format(format!("tensor '{name}': dimensions overflow")))?;
            if dims[0] % dtype.block_size() as u64 != 0 {
                return Err(Error::Format(format!(
                    "tensor '{name}': row of {} elements is not a whole number of {dtype} blocks",
                    dims[0]
                )));
            }
            let n_bytes = n_el / dtype.block_size() as u64 * dtype.type_size() as u64;
            if rel % alignment != 0 {
                return Err(Error::Format(format!(
                    "tensor '{name}': offset {rel} is not aligned to {alignment}"
                )));
            }
            let offset = data_offset + rel;
            if offset.checked_add(n_bytes).is_none_or(|end| end > file_len) {
                return Err(Error::Format(format!(
                    "truncated GGUF: tensor '{name}' needs bytes {offset}..{} but the file has {file_len}",
                    offset.saturating_add(n_bytes)
                )));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(Error::Format(format!("tensor '{name}' appears twice")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                dtype,
                offset,
                n_bytes,
            });
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole mapped file (shared, so weights can borrow it past the reader's life).
    pub fn mmap(&self) -> &Arc<Mmap> {
        &self.mmap
    }

    /// Metadata entries in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// One metadata value by key.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A string value, or an error if present with another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.type_error(key, "a string", v))
            })
            .transpose()
    }

    /// An unsigned integer value, or an error if present with another type.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.type_error(key, "an unsigned integer", v))
            })
            .transpose()
    }

    /// A numeric value as f64, or an error if present with another type.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.type_error(key, "a number", v))
            })
            .transpose()
    }

    /// A bool value, or an error if present with another type.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.type_error(key, "a bool", v)))
            .transpose()
    }

    /// An array value, or an error if present with another type.
    pub fn get_array(&self, key: &str) -> Result<Option<&[MetaValue]>> {
        self.get(key)
            .map(|v| {
                v.as_array()
                    .ok_or_else(|| self.type_error(key, "an array", v))
            })
            .transpose()
    }

    /// A required unsigned integer.
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.get_u64(key)?.ok_or_else(|| {
            Error::Format(format!(
                "{}: metadata key '{key}' is missing",
                self.path.display()
            ))
        })
    }

    fn type_error(&self, key: &str, wanted: &str, got: &MetaValue) -> Error {
        Error::Format(format!(
            "{}: metadata '{key}' should be {wanted}, is {}",
            self.path.display(),
            got.type_name()
        ))
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor's info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The mapped bytes of a tensor (bounds were checked when the file was opened).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.offset as usize..(info.offset + info.n_bytes) as usize]
    }

    /// The architecture named by `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")?.ok_or_else(|| {
            Error::Format(format!(
                "{}: metadata key 'general.architecture' is missing",
                self.path.display()
            ))
        })
    }
}
