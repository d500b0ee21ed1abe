//! Kernel modules compiled for the device (through the NVRTC disk cache), loaded once, and
//! kernel launches with plain-value arguments.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr};
use cudarc::nvrtc::Ptx;
use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};

use crate::backend::format_suffix;

use crate::device::driver_err;
use crate::device_wide::device_wide;
use crate::nvrtc::{self, Target};
use crate::sources::{Module, Unit};

/// Every kernel module, loaded into one context (one loaded module a compilation unit).
pub(crate) struct Kernels {
    units: HashMap<Unit, Arc<CudaModule>>,
    funcs: Mutex<HashMap<&'static str, CudaFunction>>,
    /// Per-format kernels by (name prefix, format, variant).
    format_funcs: Mutex<HashMap<(&'static str, GgmlType, u32), CudaFunction>>,
    /// Kernels (by function handle) whose dynamic shared memory limit has been raised, and to
    /// how many bytes.
    shared_raised: Mutex<HashMap<usize, u32>>,
}

impl Drop for Kernels {
    /// Unloads the modules (the kernels hold them too) under `device_wide`.
    fn drop(&mut self) {
        let _held = device_wide();
        self.funcs
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.format_funcs
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.units.clear();
    }
}

/// Kernel `name` of `module`, looked up under `device_wide`: a first lookup may load the
/// kernel's code (lazy loading), which synchronizes the context.
fn load_function(module: &Arc<CudaModule>, name: &str) -> Result<CudaFunction> {
    let _held = device_wide();
    module
        .load_function(name)
        .map_err(|e| driver_err(&format!("kernel {name}"), e))
}

/// Every kernel unit (with `MARKBASE_CUDA_DEFINES`' defines) compiled for compute capability
/// `cc` (e.g. 90) as a cubin, through the disk cache (`nvrtc::compile_cached`); the units
/// compile in parallel (the GEMV module whole took ≈ 40 s on one core). Needs NVRTC, not a
/// GPU.
pub fn unit_images(cc: u32) -> Result<Vec<(Unit, Result<Vec<u8>>)>> {
    let defines = crate::sources::defines_from_env()?;
    let all = Unit::all();
    let images = nvrtc::on_every_core(&all, |u| {
        nvrtc::compile_cached(&u.name(), &u.source(&defines), Target::Cubin(cc))
    });
    Ok(all.into_iter().zip(images).collect())
}

/// Dynamic shared memory a block may have without raising the kernel's limit.
const DEFAULT_SHARED: u32 = 48 << 10;

impl Kernels {
    /// Compiles (or takes from the cache) and loads every kernel unit for compute capability
    /// `cc` (e.g. 90); units compile in parallel.
    pub(crate) fn load(ctx: &Arc<CudaContext>, cc: u32) -> Result<Kernels> {
        let mut units = HashMap::new();
        let images = unit_images(cc)?;
        let _held = device_wide();
        for (unit, image) in images {
            let module = ctx
                .load_module(Ptx::from_binary(image?))
                .map_err(|e| driver_err(&format!("loading kernel unit {}", unit.name()), e))?;
            units.insert(unit, module);
        }
        Ok(Kernels {
            units,
            funcs: Mutex::new(HashMap::new()),
            format_funcs: Mutex::new(HashMap::new()),
            shared_raised: Mutex::new(HashMap::new()),
        })
    }

    /// The loaded unit `u`.
    fn unit(&self, u: Unit) -> Result<&Arc<CudaModule>> {
        self.units
            .get(&u)
            .ok_or_else(|| Error::Invalid(format!("no kernel unit {}", u.name())))
    }

    /// The format-independent kernel `name` of module `m`.
    pub(crate) fn func(&self, m: Module, name: &'static str) -> Result<CudaFunction> {
        let mut funcs = self
            .funcs
            .lock()
            .map_err(|_| Error::Invalid("CUDA kernel table poisoned".into()))?;
        if let Some(f) = funcs.get(name) {
            return Ok(f.clone());
        }
        let f = load_function(self.unit(Unit::holding(m, None))?, name)?;
        funcs.insert(name, f.clone());
        Ok(f)
    }
}

impl Kernels {
    /// [`Kernels::func`], allowed `shared` bytes of dynamic shared memory a block.
    pub(crate) fn func_with_shared(
        &self,
        m: Module,
        name: &'static str,
        shared: u32,
    ) -> Result<CudaFunction> {
        let f = self.func(m, name)?;
        self.allow_shared(&f, shared, || name.to_string())?;
        Ok(f)
    }

    /// [`Kernels::func_for`], allowed `shared` bytes of dynamic shared memory a block.
    pub(crate) fn func_for_with_shared(
        &self,
        m: Module,
        prefix: &'static str,
        ty: GgmlType,
        variant: u32,
        shared: u32,
    ) -> Result<CudaFunction> {
        let f = self.func_for(m, prefix, ty, variant)?;
        self.allow_shared(&f, shared, || format!("{prefix} {ty} {variant}"))?;
        Ok(f)
    }

    /// Raises kernel `f`'s dynamic shared memory limit to `shared` bytes where that is past the
    /// default 48 KiB and past what it was raised to before; `name` names it in an error.
    fn allow_shared(
        &self,
        f: &CudaFunction,
        shared: u32,
        name: impl FnOnce() -> String,
    ) -> Result<()> {
        if shared <= DEFAULT_SHARED {
            return Ok(());
        }
        let mut raised = self
            .shared_raised
            .lock()
            .map_err(|_| Error::Invalid("CUDA kernel table poisoned".into()))?;
        let key = f.cu_function() as usize;
        if raised.get(&key).is_some_and(|&r| r >= shared) {
            return Ok(());
        }
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .map_err(|e| driver_err(&format!("shared memory of kernel {}", name()), e))?;
        raised.insert(key, shared);
        Ok(())
    }
}

impl Kernels {
    /// The kernel `{prefix}_{format}` (or `{prefix}_{format}_{variant}` for a variant > 0) of
    /// module `m`, e.g. `gemv_q4_k_8`.
    pub(crate) fn func_for(
        &self,
        m: Module,
        prefix: &'static str,
        ty: GgmlType,
        variant: u32,
    ) -> Result<CudaFunction> {
        let key = (prefix, ty, variant);
        let mut funcs = self
            .format_funcs
            .lock()
            .map_err(|_| Error::Invalid("CUDA kernel table poisoned".into()))?;
        if let Some(f) = funcs.get(&key) {
            return Ok(f.clone());
        }
        let suffix = format_suffix(ty)?;
        let name = if variant > 0 {
            format!("{prefix}_{suffix}_{variant}")
        } else {
            format!("{prefix}_{suffix}")
        };
        let f = load_function(self.unit(Unit::holding(m, Some(suffix)))?, &name)?;
        funcs.insert(key, f.clone());
        Ok(f)
    }
}

/// Arguments of `attn_partial_*` (layout matches `AttnArgs` in attention.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnArgs {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub positions: u64,
    pub seq_start: u64,
    pub block_tables: u64,
    pub out: u64,
    pub part: u64,
    pub n_tokens: i32,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
    pub window: i32,
    pub softcap: f32,
    pub n_seqs: i32,
    pub table_width: i32,
    pub block_size: i32,
    pub chunk: i32,
    pub splits: i32,
    /// The output's rounded copy (0 with `round_kind` 0, `RoundTarget`).
    pub rounded: u64,
    pub round_kind: i32,
}

// SAFETY: plain-old-data with the C layout the kernel expects.
unsafe impl DeviceRepr for AttnArgs {}

/// Most products one `gemv_many` launch takes (`Products` in gemv.cu).
pub(crate) const MAX_PRODUCTS: usize = 4;

/// The `Products` argument of the `gemv_many` kernels (same layout as the C struct): weight
/// and output addresses and row counts of up to [`MAX_PRODUCTS`] matrices.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ProductArgs {
    pub w: [u64; MAX_PRODUCTS],
    pub out: [u64; MAX_PRODUCTS],
    pub rows: [i32; MAX_PRODUCTS],
    pub count: i32,
}

// SAFETY: plain data with the C layout of gemv.cu's `Products`.
unsafe impl DeviceRepr for ProductArgs {}

/// One kernel argument, passed by value.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device pointer (0 = null) or a 64-bit count.
    U64(u64),
    /// A C `int`.
    I32(i32),
    /// A C `float`.
    F32(f32),
    /// The attention argument block.
    Attn(AttnArgs),
    /// The matrices of a `gemv_many` launch.
    Products(ProductArgs),
}

/// Launch geometry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grid {
    pub blocks: (u32, u32, u32),
    pub threads: u32,
    pub shared: u32,
}

impl Grid {
    /// `blocks` × `threads`, no dynamic shared memory.
    pub fn new(blocks: (u32, u32), threads: u32) -> Grid {
        Grid {
            blocks: (blocks.0.max(1), blocks.1.max(1), 1),
            threads,
            shared: 0,
        }
    }
}

/// A kernel launch: the function, its geometry and its arguments by value.
pub(crate) struct Launch {
    /// The kernel (its module stays loaded for the backend's life).
    pub(crate) func: sys::CUfunction,
    pub(crate) grid: Grid,
    pub(crate) args: Vec<Arg>,
    /// Programmatic dependent launch (Hopper and newer): the kernel may start while the one
    /// ahead of it in the stream is still running, and waits for it inside
    /// (`wait_prior_grid` in common.cuh, which every kernel calls before it reads anything an
    /// earlier operation wrote).
    pub(crate) early: bool,
}

impl Arg {
    /// Appends the argument's value as words (floats by their bits).
    fn key(&self, out: &mut Vec<u64>) {
        match *self {
            Arg::U64(v) => out.extend([1, v]),
            Arg::I32(v) => out.extend([2, v as u32 as u64]),
            Arg::F32(v) => out.extend([3, v.to_bits() as u64]),
            Arg::Attn(a) => out.extend([
                4,
                a.q,
                a.k_cache,
                a.v_cache,
                a.positions,
                a.seq_start,
                a.block_tables,
                a.out,
                a.part,
                pair(a.n_tokens, a.n_heads),
                pair(a.n_kv_heads, a.head_dim),
                pair(a.scale.to_bits() as i32, a.window),
                pair(a.softcap.to_bits() as i32, a.n_seqs),
                pair(a.table_width, a.block_size),
                pair(a.chunk, a.splits),
            ]),
            Arg::Products(p) => {
                out.push(5);
                out.extend(p.w);
                out.extend(p.out);
                out.extend([
                    pair(p.rows[0], p.rows[1]),
                    pair(p.rows[2], p.rows[3]),
                    p.count as u32 as u64,
                ]);
            }
        }
    }
}

/// Two 32-bit values in one word.
fn pair(a: i32, b: i32) -> u64 {
    (a as u32 as u64) << 32 | b as u32 as u64
}

impl Launch {
    /// Kernel `f` over `grid` with `args`.
    pub(crate) fn new(f: &CudaFunction, grid: Grid, args: &[Arg], early: bool) -> Launch {
        Launch {
            func: f.cu_function(),
            grid,
            args: args.to_vec(),
            early,
        }
    }

    /// Appends the words that identify the launch: kernel, geometry and every argument.
    pub(crate) fn key(&self, out: &mut Vec<u64>) {
        let g = &self.grid;
        out.extend([
            self.func as u64,
            pair(g.blocks.0 as i32, g.blocks.1 as i32),
            pair(g.blocks.2 as i32, g.threads as i32),
            pair(g.shared as i32, self.early as i32),
            self.args.len() as u64,
        ]);
        for a in &self.args {
            a.key(out);
        }
    }

    /// Queues the launch on `stream`.
    pub(crate) fn issue(&self, stream: &CudaStream) -> Result<()> {
        let mut store: Vec<Arg> = self.args.clone();
        let mut params: Vec<*mut c_void> = store
            .iter_mut()
            .map(|a| match a {
                Arg::U64(v) => v as *mut u64 as *mut c_void,
                Arg::I32(v) => v as *mut i32 as *mut c_void,
                Arg::F32(v) => v as *mut f32 as *mut c_void,
                Arg::Attn(v) => v as *mut AttnArgs as *mut c_void,
                Arg::Products(v) => v as *mut ProductArgs as *mut c_void,
            })
            .collect();
        let grid = self.grid;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid.blocks.0,
            gridDimY: grid.blocks.1,
            gridDimZ: grid.blocks.2,
            blockDimX: grid.threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: grid.shared,
            hStream: stream.cu_stream(),
            attrs: if self.early {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(self.early),
        };
        // SAFETY: the parameter pointers point into `store` and the attribute into `attr`,
        // both alive for the call; the kernel's signature matches the argument list at every
        // call site (checked by the GPU tests).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| driver_err("kernel launch", e))
    }
}
