//! Runs MarkBase's CUDA kernel units on the CPU, so that kernels can be checked against their
//! references on a machine without a GPU (CI's, or a session without the device).
//!
//! A unit's source (`markbase_cuda::sources`) is compiled by the system's C++ compiler after
//! `cpp/emu.hpp`, which spells out the CUDA C++ the kernels use: a launch runs the blocks one
//! at a time ([`EmuModule::launch`]) or all at once ([`EmuModule::launch_resident`], for
//! blocks that wait for each other through global memory), each thread a fiber on the calling
//! thread, and block barriers, warp collectives (shuffles, votes, `mma.sync`, `ldmatrix`) and
//! spin-wait loops (`mb_emu::spin()`) switch fibers until every thread they wait for has
//! arrived. The kernels' inline PTX has twins there, chosen by `#ifdef MB_EMU`.
//! Compiled units are cached on disk as shared libraries (key: the source and the compiler
//! command), as NVRTC's PTX is.
//!
//! What the emulator shows: that a kernel computes what its reference does, lane by lane and
//! with the rounding of its f16 steps. What it cannot show: speed, races between blocks (they
//! run one after another, or interleaved only where a thread waits or spins), and memory-model
//! effects (one thread runs at a time).

use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

/// The CUDA C++ runtime of the emulator, prepended to every unit.
const EMU_HPP: &str = include_str!("../cpp/emu.hpp");

/// The environment variable naming the C++ compiler (default `c++`).
pub const COMPILER_VAR: &str = "CXX";
/// The environment variable that (set to `descending`) runs every launch's blocks and threads
/// from the last instead of the first ([`Order`]).
pub const ORDER_VAR: &str = "MARKBASE_EMU_ORDER";
/// The environment variable naming the cache directory of compiled units (default: the
/// system's temporary directory, `markbase-emu`).
pub const CACHE_VAR: &str = "MARKBASE_EMU_CACHE";

/// The compiler's flags: optimized enough that emulated kernels run fast, without warnings
/// about code written for NVRTC.
const FLAGS: [&str; 7] = [
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-w",
    "-pthread",
];

/// What can go wrong compiling or running a unit.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// No C++ compiler could be run.
    #[error("no C++ compiler: `{compiler} --version` failed ({reason}); set {COMPILER_VAR}")]
    NoCompiler {
        /// The command tried.
        compiler: String,
        /// Why it failed.
        reason: String,
    },
    /// The unit did not compile.
    #[error("unit {unit} did not compile:\n{log}")]
    Compile {
        /// The unit's name.
        unit: String,
        /// The compiler's messages (the first 60 lines).
        log: String,
    },
    /// Reading or writing the cache failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The compiled library could not be loaded, or lacks a symbol.
    #[error("unit {unit}: {reason}")]
    Load {
        /// The unit's name.
        unit: String,
        /// The loader's message.
        reason: String,
    },
    /// A launch's shape is invalid, or a thread hung at a barrier or broke a collective, or
    /// every live thread spins.
    #[error("launch of unit {unit}: {message}")]
    Launch {
        /// The unit's name.
        unit: String,
        /// The emulator's message.
        message: String,
    },
}

/// The C++ compiler command: `CXX`, or `c++`.
pub fn compiler() -> String {
    std::env::var(COMPILER_VAR).unwrap_or_else(|_| "c++".to_string())
}

/// Whether a C++ compiler runs here: `Err` says why not (tests print it and skip).
pub fn compiler_available() -> Result<(), EmuError> {
    let cxx = compiler();
    match Command::new(&cxx).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(EmuError::NoCompiler {
            compiler: cxx,
            reason: format!("exit status {}", out.status),
        }),
        Err(e) => Err(EmuError::NoCompiler {
            compiler: cxx,
            reason: e.to_string(),
        }),
    }
}

/// `source` with each `extern __shared__ [__align__(N)] T name[];` (dynamic shared memory)
/// turned into a pointer to the launch's arena: C++ has no such declaration.
pub fn dynamic_shared_as_arena(source: &str) -> String {
    const KEY: &str = "extern __shared__";
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find(KEY) {
        out.push_str(&rest[..at]);
        let decl_end = rest[at..].find(';').map_or(rest.len(), |e| at + e);
        let decl = &rest[at + KEY.len()..decl_end];
        let words: Vec<&str> = decl
            .split_whitespace()
            .filter(|w| !w.starts_with("__align__"))
            .collect();
        match words.split_last() {
            Some((name, ty)) if name.ends_with("[]") && !ty.is_empty() => {
                let ty = ty.join(" ");
                let name = name.trim_end_matches("[]");
                out.push_str(&format!("{ty}* {name} = ({ty}*)mb_emu::dynamic_shared()"));
            }
            _ => out.push_str(&rest[at..decl_end]),
        }
        rest = &rest[decl_end..];
    }
    out.push_str(rest);
    out
}

/// The full C++ translation unit of a kernel unit's source.
fn translation_unit(source: &str) -> String {
    format!(
        "{EMU_HPP}\n#line 1 \"unit\"\n{}",
        dynamic_shared_as_arena(source)
    )
}

fn cache_dir() -> PathBuf {
    std::env::var_os(CACHE_VAR)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("markbase-emu"))
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> EmuError + '_ {
    move |source| EmuError::Io {
        path: path.to_path_buf(),
        source,
    }
}

type LaunchFn = unsafe extern "C" fn(
    grid: *const u32,
    block: *const u32,
    shared_bytes: usize,
    flags: u32,
    body: extern "C" fn(*mut c_void),
    ctx: *mut c_void,
    error: *mut c_char,
    error_len: usize,
) -> i32;

/// `mb_emu_launch`'s flag: blocks and threads from the last.
const DESCENDING: u32 = 1;
/// `mb_emu_launch`'s flag: every block of the grid live at once.
const RESIDENT: u32 = 2;
/// `mb_emu_launch`'s flag: each turn to the first ready thread of the order.
const AHEAD: u32 = 4;

/// The order in which a launch runs its blocks, and a block its ready threads in turn: a kernel
/// that is right only in one order (a missing barrier, a fix-up that assumes which block ends
/// last) fails in the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// From the first block and thread.
    Ascending,
    /// From the last block and thread.
    Descending,
    /// Each turn to the first ready thread from the first block's first (after a spin, to the
    /// next): in a resident launch the first blocks run ahead of the others as far as they can,
    /// so a block that waits on a count raised too early reads outputs not yet written.
    FirstAhead,
    /// As `FirstAhead`, from the last block's last thread.
    LastAhead,
}

impl Order {
    /// `ORDER_VAR`'s order: descending when it says so, else ascending.
    pub fn from_env() -> Order {
        match std::env::var(ORDER_VAR).as_deref() {
            Ok("descending") => Order::Descending,
            _ => Order::Ascending,
        }
    }
}

/// A kernel unit compiled for the CPU and loaded.
pub struct EmuModule {
    name: String,
    library: libloading::Library,
    launch: LaunchFn,
}

/// Calls the launch body a fiber was started with.
extern "C" fn run_body(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `&&dyn Fn()` that `EmuModule::run` passed, alive for the launch.
    let body = unsafe { &*(ctx as *const &dyn Fn()) };
    body();
}

impl EmuModule {
    /// Compiles (or finds in the cache) the kernel unit `source`, named `name` in messages and
    /// file names, and loads it.
    pub fn compile(name: &str, source: &str) -> Result<EmuModule, EmuError> {
        compiler_available()?;
        let cxx = compiler();
        let unit = translation_unit(source);
        let mut hash = Sha256::new();
        hash.update(unit.as_bytes());
        hash.update(cxx.as_bytes());
        for flag in FLAGS {
            hash.update(flag.as_bytes());
        }
        let key: String = hash.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let dir = cache_dir();
        std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
        let library = dir.join(format!("{name}-{key}.so"));
        if !library.exists() {
            // A name of this compilation's own: tests compile the same unit at once.
            static COMPILATIONS: AtomicU64 = AtomicU64::new(0);
            let nth = COMPILATIONS.fetch_add(1, Ordering::Relaxed);
            let stem = format!("{name}-{key}-{}-{nth}", std::process::id());
            let src = dir.join(format!("{stem}.cpp"));
            let tmp = dir.join(format!("{stem}.so"));
            std::fs::write(&src, &unit).map_err(io_error(&src))?;
            let out = Command::new(&cxx)
                .args(FLAGS)
                .arg(&src)
                .arg("-o")
                .arg(&tmp)
                .output()
                .map_err(io_error(&src))?;
            if !out.status.success() {
                let log = String::from_utf8_lossy(&out.stderr);
                return Err(EmuError::Compile {
                    unit: name.to_string(),
                    log: log.lines().take(60).collect::<Vec<_>>().join("\n"),
                });
            }
            let _ = std::fs::remove_file(&src);
            std::fs::rename(&tmp, &library).map_err(io_error(&library))?;
        }
        let load_error = |e: libloading::Error| EmuError::Load {
            unit: name.to_string(),
            reason: e.to_string(),
        };
        // SAFETY: the library is ours, compiled from the emulator's header and a kernel unit;
        // loading it runs no initializers beyond the C++ runtime's.
        let library = unsafe { libloading::Library::new(&library) }.map_err(load_error)?;
        // SAFETY: `mb_emu_launch` has this signature in emu.hpp.
        let launch = unsafe {
            *library
                .get::<LaunchFn>(b"mb_emu_launch\0")
                .map_err(load_error)?
        };
        Ok(EmuModule {
            name: name.to_string(),
            library,
            launch,
        })
    }

    /// The kernel `name` as a function pointer of type `F`.
    ///
    /// # Safety
    /// `F` must be an `unsafe extern "C" fn` with the kernel's parameter types (each C type
    /// as its Rust twin, structs `#[repr(C)]`), and it may be called only inside the body of
    /// one of this module's launches ([`EmuModule::launch`] and its kin).
    pub unsafe fn kernel<F: Copy>(&self, name: &str) -> Result<F, EmuError> {
        let symbol = format!("{name}\0");
        // SAFETY: the caller vouches for F; the pointer lives as long as `self.library`.
        unsafe { self.library.get::<F>(symbol.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| EmuError::Load {
                unit: self.name.clone(),
                reason: e.to_string(),
            })
    }

    /// Runs a launch of `grid` blocks of `block` threads with `shared_bytes` of dynamic shared
    /// memory, each thread calling `body` (which calls one kernel of this unit with the
    /// launch's arguments), in `ORDER_VAR`'s order: the blocks one after another, so a block
    /// that spins waiting for a later one fails the launch ([`EmuModule::launch_resident`]
    /// runs them all at once).
    pub fn launch(
        &self,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        body: &dyn Fn(),
    ) -> Result<(), EmuError> {
        self.launch_in(Order::from_env(), grid, block, shared_bytes, body)
    }

    /// [`EmuModule::launch`] in the given order.
    pub fn launch_in(
        &self,
        order: Order,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        body: &dyn Fn(),
    ) -> Result<(), EmuError> {
        self.run(order, false, grid, block, shared_bytes, body)
    }

    /// A launch whose blocks are all live at once, as on a GPU that holds the whole grid, in
    /// `ORDER_VAR`'s order: the threads of every block take turns in one round robin (block
    /// 0's threads, then block 1's, ...), so a block may spin (`mb_emu::spin()`) on global
    /// memory that another block writes. Each block has its own dynamic shared memory; a unit
    /// with static `__shared__` arrays (one copy for all blocks) cannot launch more than one
    /// block this way, nor may a launch have more than 65 536 threads (each a fiber with a
    /// stack of its own) or 256 MB of dynamic shared memory in all (each block's rounded up
    /// to 4 KB). A launch in which every live thread keeps spinning with nothing left to
    /// change what they wait for fails ([`EmuError::Launch`]) instead of hanging.
    pub fn launch_resident(
        &self,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        body: &dyn Fn(),
    ) -> Result<(), EmuError> {
        self.launch_resident_in(Order::from_env(), grid, block, shared_bytes, body)
    }

    /// [`EmuModule::launch_resident`] in the given order (descending: from the last thread of
    /// the last block).
    pub fn launch_resident_in(
        &self,
        order: Order,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        body: &dyn Fn(),
    ) -> Result<(), EmuError> {
        self.run(order, true, grid, block, shared_bytes, body)
    }

    /// Runs a launch in `order`, its blocks all at once when `resident`, else one at a time.
    fn run(
        &self,
        order: Order,
        resident: bool,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: usize,
        body: &dyn Fn(),
    ) -> Result<(), EmuError> {
        let mut flags = match order {
            Order::Ascending => 0,
            Order::Descending => DESCENDING,
            Order::FirstAhead => AHEAD,
            Order::LastAhead => AHEAD | DESCENDING,
        };
        if resident {
            flags |= RESIDENT;
        }
        let mut message = vec![0 as c_char; 1024];
        let mut ctx: &dyn Fn() = body;
        // One launch at a time in the process: a unit's static shared arrays are statics of
        // its library, which every EmuModule of the same unit shares (dlopen hands out one
        // copy), and each block poisons them as it starts.
        static LAUNCHES: Mutex<()> = Mutex::new(());
        let _one = LAUNCHES.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: `mb_emu_launch` runs `run_body(ctx)` in every fiber and returns before `ctx`
        // and `message` go out of scope.
        let rc = unsafe {
            (self.launch)(
                grid.as_ptr(),
                block.as_ptr(),
                shared_bytes,
                flags,
                run_body,
                &mut ctx as *mut &dyn Fn() as *mut c_void,
                message.as_mut_ptr(),
                message.len(),
            )
        };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: the emulator wrote a NUL-terminated message (snprintf) into the buffer.
        let text = unsafe { CStr::from_ptr(message.as_ptr()) };
        Err(EmuError::Launch {
            unit: self.name.clone(),
            message: text.to_string_lossy().into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_shared_declarations_become_arena_pointers() {
        let src =
            "a; extern __shared__ __align__(16) u16 fa_smem[]; extern __shared__ uint4 s[]; b";
        assert_eq!(
            dynamic_shared_as_arena(src),
            "a; u16* fa_smem = (u16*)mb_emu::dynamic_shared(); \
             uint4* s = (uint4*)mb_emu::dynamic_shared(); b"
        );
    }
}
