//! Run-time compilation of the kernel sources with NVRTC, and the on-disk cache of the results.
//!
//! NVRTC is opened dynamically. It is looked up by name (`libnvrtc.so.13` on the loader path),
//! then in the usual toolkit folders; `MARKBASE_NVRTC` may name the library file directly (as
//! the CI check does with the one from the `nvidia-cuda-nvrtc` wheel). A library opened by path
//! stays loaded, so the by-name lookup afterwards finds it under its soname.

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;
use markbase_core::{Error, Result};
use sha2::{Digest, Sha256};

/// Folders searched for CUDA libraries that are not on the loader path.
const TOOLKIT_DIRS: [&str; 3] = [
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/lib/x86_64-linux-gnu",
];

/// Opens `file` (and leaks the handle so it stays loaded). True on success.
fn preload(file: &Path) -> bool {
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions.
    match unsafe { libloading::Library::new(file) } {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

/// Makes sure the shared library `soname` (e.g. `libnvrtc.so.13`) can be opened by name:
/// if not, tries `env_var` (a file path), `$CUDA_PATH/lib64`, `$CUDA_HOME/lib64` and the
/// toolkit folders, loading `deps` from the same folder first.
pub(crate) fn ensure_library(soname: &str, deps: &[&str], env_var: Option<&str>) -> bool {
    // SAFETY: as in `preload`.
    if unsafe { libloading::Library::new(soname) }.is_ok() {
        return true;
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(path) = env_var
        .and_then(std::env::var_os)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
    {
        if let Some(dir) = path.parent() {
            for d in deps {
                preload(&dir.join(d));
            }
        }
        if preload(&path) {
            return true;
        }
    }
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(PathBuf::from(root).join("lib64"));
        }
    }
    dirs.extend(TOOLKIT_DIRS.iter().map(PathBuf::from));
    for dir in dirs {
        if dir.join(soname).is_file() {
            for d in deps {
                preload(&dir.join(d));
            }
            if preload(&dir.join(soname)) {
                return true;
            }
        }
    }
    false
}

/// The NVRTC library is loaded, or a clear error.
fn ensure_loaded() -> Result<()> {
    static OK: OnceLock<bool> = OnceLock::new();
    let ok = *OK.get_or_init(|| {
        ensure_library(
            "libnvrtc.so.13",
            &["libnvrtc-builtins.so.13.0"],
            Some("MARKBASE_NVRTC"),
        )
        // SAFETY: only probes for the library by name.
        && unsafe { sys::is_culib_present() }
    });
    if ok {
        Ok(())
    } else {
        Err(Error::Unsupported(
            "NVRTC 13 (libnvrtc.so.13) was not found: install the CUDA 13 toolkit or the \
             nvidia-cuda-nvrtc wheel, or set MARKBASE_NVRTC to the library file"
                .into(),
        ))
    }
}

/// NVRTC's version as (major, minor).
pub fn version() -> Result<(i32, i32)> {
    ensure_loaded()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: NVRTC is loaded; the out-pointers are valid.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion")?;
    Ok((major, minor))
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Unsupported(format!("NVRTC {what} failed: {r:?}")))
    }
}

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Machine code for `sm_XY` (what the backend loads).
    Cubin(u32),
    /// PTX for `compute_XY` (what the CI check asks for).
    Ptx(u32),
}

impl Target {
    fn option(self) -> String {
        match self {
            Target::Cubin(cc) => format!("--gpu-architecture=sm_{}", arch(cc)),
            Target::Ptx(cc) => format!("--gpu-architecture=compute_{}", arch(cc)),
        }
    }
}

/// The architecture compiled for compute capability `cc`: Hopper's (9.0) with its
/// architecture-specific features (`90a`: `wgmma`, defining `__CUDA_ARCH_FEAT_SM90_ALL`), whose
/// code runs on 9.0 devices only — the device it is compiled for; others as they are.
pub fn arch(cc: u32) -> String {
    if cc == 90 {
        "90a".into()
    } else {
        cc.to_string()
    }
}

/// Compiler options used for every kernel source (part of the cache key).
const OPTIONS: [&str; 2] = ["--std=c++17", "--fmad=true"];

/// Compiles `src` (named `name` in messages) for `target`; a compile error carries NVRTC's log.
pub fn compile(name: &str, src: &str, target: Target) -> Result<Vec<u8>> {
    compile_program(name, src, target, |prog| match target {
        // SAFETY: `prog` is live and compiled.
        Target::Ptx(_) => unsafe { get_ptx(prog, name) },
        // SAFETY: as above.
        Target::Cubin(_) => unsafe { get_cubin(prog, name) },
    })
}

/// Compiles `src` for `sm_{cc}` as [`compile`] does, returning its PTX (as for
/// `compute_{cc}`) beside the cubin the device would load: the check that every kernel
/// assembles, without a GPU.
pub fn compile_ptx_and_cubin(name: &str, src: &str, cc: u32) -> Result<(Vec<u8>, Vec<u8>)> {
    compile_program(name, src, Target::Cubin(cc), |prog| {
        // SAFETY: `prog` is live and compiled.
        unsafe { Ok((get_ptx(prog, name)?, get_cubin(prog, name)?)) }
    })
}

/// Compiles `src` for `target` and hands the compiled program to `fetch`.
fn compile_program<T>(
    name: &str,
    src: &str,
    target: Target,
    fetch: impl FnOnce(sys::nvrtcProgram) -> Result<T>,
) -> Result<T> {
    ensure_loaded()?;
    let c_src = CString::new(src).map_err(|_| Error::Invalid(format!("{name}: NUL in source")))?;
    let c_name = CString::new(name).map_err(|_| Error::Invalid(format!("bad name {name}")))?;
    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(target.option());
    let prog = cudarc::nvrtc::result::create_program(&c_src, Some(&c_name))
        .map_err(|e| Error::Unsupported(format!("NVRTC cannot create program {name}: {e:?}")))?;
    // SAFETY: `prog` is live until destroyed at the end; buffers are sized by NVRTC.
    let out = unsafe {
        let compiled = cudarc::nvrtc::result::compile_program(prog, &opts);
        let log = cudarc::nvrtc::result::get_program_log(prog)
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        let out = match compiled {
            Err(e) => Err(Error::Invalid(format!(
                "NVRTC failed to compile {name} ({e:?}):\n{log}"
            ))),
            Ok(()) => fetch(prog),
        };
        let _ = cudarc::nvrtc::result::destroy_program(prog);
        out
    };
    out
}

/// # Safety
/// `prog` must be a live, compiled program.
unsafe fn get_ptx(prog: sys::nvrtcProgram, name: &str) -> Result<Vec<u8>> {
    cudarc::nvrtc::result::get_ptx(prog)
        .map(|p| p.iter().map(|&c| c as u8).collect())
        .map_err(|e| Error::Unsupported(format!("NVRTC PTX of {name}: {e:?}")))
}

/// # Safety
/// `prog` must be a live, compiled program.
unsafe fn get_cubin(prog: sys::nvrtcProgram, name: &str) -> Result<Vec<u8>> {
    let mut size = 0usize;
    check(sys::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize")?;
    let mut buf = vec![0u8; size];
    check(
        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char),
        "nvrtcGetCUBIN",
    )
    .map_err(|e| Error::Unsupported(format!("{name}: {e}")))?;
    Ok(buf)
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The cache folder: `MARKBASE_CUDA_CACHE`, else `$XDG_CACHE_HOME/markbase/cuda`, else
/// `~/.cache/markbase/cuda`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MARKBASE_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("markbase/cuda"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/markbase/cuda"))
}

/// The cache key of a compilation: source hash, target, NVRTC version and options.
pub fn cache_key(src: &str, target: Target, nvrtc: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(src.as_bytes());
    h.update(
        format!(
            "{} nvrtc {}.{} {OPTIONS:?}",
            target.option(),
            nvrtc.0,
            nvrtc.1
        )
        .as_bytes(),
    );
    h.finalize()
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A temporary file beside the cache file `f`, unique to this process and call: two threads
/// of one process storing the same unit (two backends starting at once) each write their own
/// and rename it, so no reader sees a file another writer is still filling.
fn cache_tmp(f: &Path) -> PathBuf {
    static WRITES: AtomicUsize = AtomicUsize::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let name = f
        .file_name()
        .map_or_else(Default::default, |s| s.to_string_lossy());
    f.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

/// `compile`, through the disk cache: a hit skips NVRTC; a miss compiles and stores the result
/// (written to a temporary file of its own, then renamed, so concurrent processes and threads
/// never read a torn file). Cache failures only cost a recompile.
pub fn compile_cached(name: &str, src: &str, target: Target) -> Result<Vec<u8>> {
    let ver = version()?;
    let key = cache_key(src, target, ver);
    let file = cache_dir().map(|d| d.join(format!("{name}-{key}.bin")));
    if let Some(f) = &file {
        if let Ok(bytes) = std::fs::read(f) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let bytes = compile(name, src, target)?;
    if let Some(f) = &file {
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
            let tmp = cache_tmp(f);
            if std::fs::write(&tmp, &bytes)
                .and_then(|()| std::fs::rename(&tmp, f))
                .is_err()
            {
                let _ = std::fs::remove_file(&tmp);
            }
        }
    }
    Ok(bytes)
}

/// `f` over `items` on a pool of threads as wide as the machine, each taking the next item as
/// it finishes one (kernel units take from 0.1 to 4 s to compile); results in `items`' order.
pub fn on_every_core<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let workers = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(1, items.len().max(1));
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break mine };
                        mine.push((i, f(item)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("worker thread panicked"))
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_writes_each_take_a_temporary_file_of_their_own() {
        let f = Path::new("/cache/gemv-abc.bin");
        let (a, b) = (cache_tmp(f), cache_tmp(f));
        assert_ne!(a, b, "two writes of one unit share a temporary file");
        assert_eq!(a.parent(), f.parent());
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(".gemv-abc.bin.") && name.ends_with(".tmp"),
            "{name}"
        );
    }
}
