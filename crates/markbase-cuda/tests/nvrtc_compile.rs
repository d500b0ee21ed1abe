//! CI compile-check, no GPU needed: NVRTC 13 (from the `nvidia-cuda-nvrtc` wheel, pip-installed
//! under target/ on first use, or the library named by `MARKBASE_NVRTC`) compiles every kernel
//! module to PTX for compute_90a (Hopper with its architecture-specific features, as the
//! backend compiles for it), whole and in the units the backend compiles (each of a module's
//! kernels in exactly one unit; a per-format unit only its format's), and assembles each unit
//! and each variant for sm_90a as the backend does (a cubin naming every kernel). A compile or
//! assembly error fails this test; so does a missing NVRTC — it is never skipped. With
//! `MARKBASE_PTX_DIR` set (not empty), each module's PTX is written there.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::Command;

use markbase_cuda::nvrtc::{self, Target};
use markbase_cuda::sources::{self, Module, Part, Unit};

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

/// Kernel variants under evaluation (`MARKBASE_CUDA_DEFINES`), compiled beside the defaults:
/// a unit they change (its PTX must differ from the default's), and PTX its kernels must
/// contain (empty for a variant that only reorders work).
const VARIANTS: &[(Unit, &str, &str)] = &[
    (
        Unit {
            module: Module::Moe,
            part: Part::Format("q4_k"),
        },
        "MOE_MMA_MIN_BLOCKS=4",
        ".minnctapersm 4",
    ),
    (
        Unit {
            module: Module::Moe,
            part: Part::Format("q5_0"),
        },
        "MOE_STORED_WORDS=0",
        "",
    ),
    (
        Unit {
            module: Module::Moe,
            part: Part::Format("q4_k"),
        },
        // The kernels of tiles of 16 pairs bounded to 3 blocks a multiprocessor.
        "MOE_WIDE_MIN_BLOCKS=3",
        ".minnctapersm 3",
    ),
    (
        Unit {
            module: Module::Moe,
            part: Part::Format("q5_k"),
        },
        // Q5_K in tiles of 16 pairs a super-block a unit.
        "MOE_WIDE_K_ROWS=MoeKRows",
        "",
    ),
    (
        Unit {
            module: Module::Gemv,
            part: Part::Format("bf16"),
        },
        "GEMV_PLAIN_MIN_BLOCKS=2",
        ".minnctapersm 2",
    ),
    (
        Unit {
            module: Module::Gemv,
            part: Part::Format("q4_k"),
        },
        // mmq_q4_k_8's `.minnctapersm 1` becomes 2.
        "MMQ_WIDE_BLOCKS=2",
        ".minnctapersm 2",
    ),
    (
        Unit {
            module: Module::Gemv,
            part: Part::Format("q4_k"),
        },
        // mmq_q4_k_8's blocks of 8 warps become 16.
        "MMQ_WIDE_WARPS=16",
        ".maxntid 512, 1, 1",
    ),
    (
        Unit {
            module: Module::Chain,
            part: Part::Whole,
        },
        "CHAIN_STAGES=4 CHAIN_Q4K_STAGES=6",
        "",
    ),
    (
        Unit {
            module: Module::Chain,
            part: Part::Whole,
        },
        // chain_bf16 in blocks of 20 warps, items of 2 048 values.
        "CHAIN_WARPS=20 CHAIN_K=2048 CHAIN_STAGES=2",
        ".maxntid 640, 1, 1",
    ),
    (
        Unit {
            module: Module::Chain,
            part: Part::Whole,
        },
        // chain_bf16 with its phases stamped by the multiprocessor's cycle count.
        "CHAIN_STAMPS=1",
        "%clock64",
    ),
    (
        Unit {
            module: Module::Chain,
            part: Part::Whole,
        },
        // chain_bf16's items copied by each lane's cp.async (the default: bulk copies).
        "CHAIN_BULK=0",
        "cp.async.cg.shared.global",
    ),
    (
        Unit {
            module: Module::Chain,
            part: Part::Whole,
        },
        // chain_bf16 pipelined: 16 warps and a service warp, polls of relaxed loads.
        "CHAIN_PIPE=1",
        "ld.relaxed.gpu.global.u32",
    ),
];

/// One compilation of the check: a whole module (every kernel, for comparison), one of the
/// units the backend compiles, or a variant of one (its defines, and the PTX it must hold).
#[derive(Clone, Copy)]
enum Job {
    Module(Module),
    Unit(Unit),
    Variant(Unit, &'static str, &'static str),
}

impl Job {
    fn name(&self) -> String {
        match self {
            Job::Module(m) => m.name().to_string(),
            Job::Unit(u) => format!("unit {}", u.name()),
            Job::Variant(u, defines, _) => format!("unit {} [{defines}]", u.name()),
        }
    }

    /// The job's PTX for compute_90a, and (a unit or a variant, as the backend compiles it)
    /// its sm_90a cubin.
    fn compile(&self) -> Result<(Vec<u8>, Option<Vec<u8>>), String> {
        let src = match self {
            Job::Module(m) => m.source(""),
            Job::Unit(u) => u.source(""),
            Job::Variant(u, defines, _) => u.source(&sources::define_lines(defines).unwrap()),
        };
        let r = match self {
            Job::Unit(_) | Job::Variant(..) => {
                nvrtc::compile_ptx_and_cubin("check", &src, 90).map(|(p, c)| (p, Some(c)))
            }
            _ => nvrtc::compile("check", &src, Target::Ptx(90)).map(|p| (p, None)),
        };
        r.map_err(|e| e.to_string())
    }
}

/// The kernels (`.entry`) of a PTX text: each one's name and the text from it on.
fn kernels_of(ptx: &str) -> impl Iterator<Item = (&str, &str)> {
    ptx.split(".entry")
        .skip(1)
        .map(|body| (body.split('(').next().unwrap_or("").trim(), body))
}

#[test]
fn every_kernel_module_compiles_to_ptx_and_every_unit_assembles_for_sm_90() {
    let lib = nvrtc_library();
    // The only test in this binary, so no other thread reads the environment meanwhile.
    std::env::set_var("MARKBASE_NVRTC", &lib);
    let (major, minor) = nvrtc::version().expect("NVRTC must load");
    assert_eq!(major, 13, "NVRTC {major}.{minor}");
    let jobs: Vec<Job> = Module::ALL
        .iter()
        .map(|&m| Job::Module(m))
        .chain(
            VARIANTS
                .iter()
                .map(|&(u, d, marker)| Job::Variant(u, d, marker)),
        )
        .chain(Unit::all().into_iter().map(Job::Unit))
        .collect();
    // Compiled on every core (NVRTC is thread-safe across programs).
    let results = nvrtc::on_every_core(&jobs, |job| {
        let t = std::time::Instant::now();
        (job.compile(), t.elapsed().as_secs_f64())
    });
    // The kernel names of each whole module, and of each unit.
    let mut module_kernels: HashMap<Module, BTreeSet<String>> = HashMap::new();
    let mut unit_kernels: HashMap<Unit, BTreeSet<String>> = HashMap::new();
    // Each unit's PTX, and each variant's beside the PTX of the unit it varies.
    let mut unit_ptx: HashMap<Unit, String> = HashMap::new();
    let mut variant_ptx = Vec::new();
    for (&job, (r, took)) in jobs.iter().zip(results) {
        let (ptx, cubin) = r.unwrap_or_else(|e| panic!("{}: {e}", job.name()));
        let text = String::from_utf8_lossy(&ptx);
        // An empty value counts as unset (it would write into the working directory).
        if let Some(dir) = std::env::var_os("MARKBASE_PTX_DIR").filter(|d| !d.is_empty()) {
            // For a look at the code (e.g. `ptxas -arch=sm_90 -v` for registers and spills).
            let file = format!("{}.ptx", job.name().replace([' ', '=', '[', ']'], "_"));
            std::fs::write(PathBuf::from(dir).join(file), text.trim_end_matches('\0')).unwrap();
        }
        let names: BTreeSet<String> = kernels_of(&text).map(|(n, _)| n.to_string()).collect();
        eprintln!(
            "{}: {} bytes of PTX, {} kernels, {took:.1} s",
            job.name(),
            ptx.len(),
            names.len()
        );
        if let Job::Variant(_, _, marker) = job {
            assert!(text.contains(marker), "{}: no {marker}", job.name());
        }
        assert!(
            text.contains(".target sm_90"),
            "{}: not sm_90 PTX",
            job.name()
        );
        assert!(!names.is_empty(), "{}: no kernels", job.name());
        // A unit also assembles for sm_90 (ptxas inside NVRTC): an ELF image naming each of
        // its kernels, as the backend loads it.
        if let Some(cubin) = &cubin {
            assert!(
                cubin.starts_with(b"\x7fELF"),
                "{}: no sm_90 cubin",
                job.name()
            );
            for n in &names {
                let named = cubin
                    .windows(n.len() + 1)
                    .any(|w| &w[..n.len()] == n.as_bytes() && w[n.len()] == 0);
                assert!(named, "{}: kernel {n} missing from the cubin", job.name());
            }
        }
        // Every kernel launches early on Hopper, so every kernel must wait for the one ahead
        // of it (`wait_prior_grid`) — a kernel without the wait would race its inputs.
        for (name, body) in kernels_of(&text) {
            assert!(
                body.contains("griddepcontrol.wait")
                    && body.contains("griddepcontrol.launch_dependents"),
                "{}: kernel {name} does not call wait_prior_grid",
                job.name()
            );
        }
        match job {
            Job::Module(m) => {
                module_kernels.insert(m, names);
            }
            Job::Variant(u, ..) => variant_ptx.push((job.name(), u, text.to_string())),
            Job::Unit(u) => {
                if let Part::Format(f) = u.part {
                    for n in &names {
                        let own = n.ends_with(&format!("_{f}"))
                            || n.rsplit_once('_').is_some_and(|(head, v)| {
                                head.ends_with(&format!("_{f}")) && v.parse::<u32>().is_ok()
                            });
                        assert!(own, "unit {}: kernel {n} is not of format {f}", u.name());
                    }
                }
                unit_kernels.insert(u, names);
                unit_ptx.insert(u, text.to_string());
            }
        }
    }
    for (variant, unit, text) in &variant_ptx {
        assert_ne!(
            text, &unit_ptx[unit],
            "{variant}: the defines change nothing"
        );
    }
    // A module's units hold each of its kernels exactly once.
    for m in Module::ALL {
        let mut seen = BTreeSet::new();
        for part in m.parts() {
            let u = Unit { module: m, part };
            for n in &unit_kernels[&u] {
                assert!(
                    seen.insert(n.clone()),
                    "kernel {n} is in two units of {}",
                    m.name()
                );
            }
        }
        assert_eq!(
            seen,
            module_kernels[&m],
            "the units of {} miss kernels",
            m.name()
        );
    }
    // A broken source is reported with NVRTC's log, not a panic.
    let err = nvrtc::compile(
        "broken",
        "__global__ void k() { undefined_name; }",
        Target::Ptx(90),
    )
    .expect_err("a broken kernel must not compile");
    assert!(err.to_string().contains("undefined_name"), "{err}");
    // The disk cache, stored by four threads at once (two backends starting together): each
    // gets the compiled code, and one whole file stays, with no temporary file left.
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nvrtc-cache-check");
    let _ = std::fs::remove_dir_all(&cache);
    std::env::set_var("MARKBASE_CUDA_CACHE", &cache);
    let src = "extern \"C\" __global__ void k(float* x) { x[threadIdx.x] += 1.f; }";
    let want = nvrtc::compile("cache-check", src, Target::Ptx(90)).unwrap();
    let got = nvrtc::on_every_core(&[0, 1, 2, 3], |_| {
        nvrtc::compile_cached("cache-check", src, Target::Ptx(90)).unwrap()
    });
    assert!(got.iter().all(|g| g == &want), "a cached compile differs");
    let files: Vec<String> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files.len(), 1, "cache files: {files:?}");
    assert!(files[0].ends_with(".bin"), "cache files: {files:?}");
    assert_eq!(
        std::fs::read(cache.join(&files[0])).unwrap(),
        want,
        "the cached file is not the compiled code"
    );
    let again = nvrtc::compile_cached("cache-check", src, Target::Ptx(90)).unwrap();
    assert_eq!(again, want, "a cache hit differs");
}
