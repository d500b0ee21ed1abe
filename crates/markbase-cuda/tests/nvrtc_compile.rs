//! CI compile-check, no GPU needed: NVRTC 13 (from the `nvidia-cuda-nvrtc` wheel, pip-installed
//! under target/ on first use, or the library named by `MARKBASE_NVRTC`) compiles every kernel
//! module to PTX for compute_90. A compile error fails this test; so does a missing NVRTC —
//! it is never skipped. With `MARKBASE_PTX_DIR` set, each module's PTX is written there.

use std::path::PathBuf;
use std::process::Command;

use markbase_cuda::nvrtc::{self, Target};
use markbase_cuda::sources::{self, Module};

/// The wheel pinned for the check.
const WHEEL: &str = "nvidia-cuda-nvrtc==13.0.88";

/// The NVRTC library to use: `MARKBASE_NVRTC`, or the wheel's, installed on first use.
fn nvrtc_library() -> PathBuf {
    if let Some(p) = std::env::var_os("MARKBASE_NVRTC").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nvrtc-13.0.88");
    let lib = dir.join("nvidia/cu13/lib/libnvrtc.so.13");
    if !lib.is_file() {
        let python = std::env::var("MARKBASE_PYTHON").unwrap_or_else(|_| "python3".into());
        let status = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(&dir)
            .arg(WHEEL)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {python} to install {WHEEL}: {e}"));
        assert!(
            status.success() && lib.is_file(),
            "`{python} -m pip install --target {} {WHEEL}` failed ({status}); NVRTC is needed \
             for the kernel compile check (or set MARKBASE_NVRTC to libnvrtc.so.13)",
            dir.display()
        );
    }
    lib
}

/// Kernel variants under evaluation (`MARKBASE_CUDA_DEFINES`), compiled beside the defaults,
/// with PTX their kernels must contain (proof that the defines took effect).
const VARIANTS: &[(Module, &str, &str)] =
    &[(Module::Gemv, "GEMV_PLAIN_MIN_BLOCKS=2", ".minnctapersm 2")];

#[test]
fn every_kernel_module_compiles_to_ptx_for_compute_90() {
    let lib = nvrtc_library();
    // The only test in this binary, so no other thread reads the environment meanwhile.
    std::env::set_var("MARKBASE_NVRTC", &lib);
    let (major, minor) = nvrtc::version().expect("NVRTC must load");
    assert_eq!(major, 13, "NVRTC {major}.{minor}");
    // Modules compile in parallel (NVRTC is thread-safe across programs).
    let results: Vec<_> = std::thread::scope(|s| {
        let jobs: Vec<_> = Module::ALL
            .iter()
            .map(|&m| (m, "", ""))
            .chain(VARIANTS.iter().copied())
            .map(|(m, defines, marker)| {
                s.spawn(move || {
                    let t = std::time::Instant::now();
                    let src = m.source(&sources::define_lines(defines).unwrap());
                    let r = nvrtc::compile(m.name(), &src, Target::Ptx(90));
                    (m, defines, marker, r, t.elapsed())
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (m, defines, marker, r, took) in results {
        let ptx = r.unwrap_or_else(|e| panic!("kernel module {} [{defines}]: {e}", m.name()));
        let text = String::from_utf8_lossy(&ptx);
        if let Some(dir) = std::env::var_os("MARKBASE_PTX_DIR") {
            // For a look at the code (e.g. `ptxas -arch=sm_90 -v` for registers and spills).
            let file = format!("{}{}.ptx", m.name(), defines.replace([' ', '='], "_"));
            std::fs::write(PathBuf::from(dir).join(file), text.trim_end_matches('\0')).unwrap();
        }
        let entries = text.matches(".entry").count();
        assert!(
            text.contains(marker),
            "{} [{defines}]: no {marker}",
            m.name()
        );
        eprintln!(
            "{} [{defines}]: {} bytes of PTX, {entries} kernels, {:.1} s",
            m.name(),
            ptx.len(),
            took.as_secs_f64()
        );
        assert!(
            text.contains(".target sm_90"),
            "{}: not sm_90 PTX",
            m.name()
        );
        assert!(entries > 0, "{}: no kernels", m.name());
        // Every kernel launches early on Hopper, so every kernel must wait for the one ahead
        // of it (`wait_prior_grid`) — a kernel without the wait would race its inputs.
        for body in text.split(".entry").skip(1) {
            let name = body.split('(').next().unwrap_or("").trim();
            assert!(
                body.contains("griddepcontrol.wait")
                    && body.contains("griddepcontrol.launch_dependents"),
                "{}: kernel {name} does not call wait_prior_grid",
                m.name()
            );
        }
    }
    // A broken source is reported with NVRTC's log, not a panic.
    let err = nvrtc::compile(
        "broken",
        "__global__ void k() { undefined_name; }",
        Target::Ptx(90),
    )
    .expect_err("a broken kernel must not compile");
    assert!(err.to_string().contains("undefined_name"), "{err}");
}
