//! Fills the kernel cache with every kernel unit compiled for one GPU architecture, on a
//! machine without a GPU (NVRTC only): a GPU machine given the same cache folder
//! (`MARKBASE_CUDA_CACHE`), NVRTC major.minor version and `MARKBASE_CUDA_DEFINES` loads the
//! cubins instead of compiling them (a fresh H200 spent 2–3 minutes of a session's device
//! time on that, docs/perf.md session 42). `scripts/stage_for_device.sh` runs it.
//!
//! ```sh
//! MARKBASE_NVRTC=target/tmp/nvrtc-13.0.88/nvidia/cu13/lib/libnvrtc.so.13 \
//!     MARKBASE_CUDA_CACHE=/tmp/kc cargo run --release -p markbase-cuda --example cuda_precompile -- 90
//! ```

use std::process::ExitCode;
use std::time::Instant;

use markbase_cuda::{nvrtc, unit_images};

fn main() -> ExitCode {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "90".into());
    let Ok(cc) = arg.parse::<u32>() else {
        eprintln!("cuda_precompile: '{arg}' is not a compute capability such as 90 (sm_90)");
        return ExitCode::FAILURE;
    };
    let Some(dir) = nvrtc::cache_dir() else {
        eprintln!("cuda_precompile: no cache folder (set MARKBASE_CUDA_CACHE)");
        return ExitCode::FAILURE;
    };
    let version = match nvrtc::version() {
        Ok((major, minor)) => format!("{major}.{minor}"),
        Err(e) => {
            eprintln!("cuda_precompile: {e}");
            return ExitCode::FAILURE;
        }
    };
    let t = Instant::now();
    let images = match unit_images(cc) {
        Ok(images) => images,
        Err(e) => {
            eprintln!("cuda_precompile: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = 0;
    for (unit, image) in &images {
        if let Err(e) = image {
            eprintln!("cuda_precompile: unit {}: {e}", unit.name());
            failed += 1;
        }
    }
    println!(
        "{} units for sm_{} in {} (NVRTC {version}), {:.1} s, {failed} failed",
        images.len(),
        nvrtc::arch(cc),
        dir.display(),
        t.elapsed().as_secs_f64()
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
