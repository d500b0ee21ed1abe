//! `markbase serve` on the real default model, checked with the official `openai` Python client
//! (installed with pip into a virtual environment under the target directory, once).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const KEY: &str = "test-key-123";

/// One server at a time: the checks time things on a small machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn model() -> String {
    let p: PathBuf = markbase_engine::pull::default_model_path().expect("default model");
    p.to_string_lossy().into_owned()
}

/// Runs `cmd` with a deadline; kills it when the deadline passes.
fn run_with_timeout(mut cmd: Command, limit: Duration, what: &str) -> std::process::Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let o = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut v).ok();
        v
    });
    let e = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut v).ok();
        v
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            panic!(
                "{what} did not finish within {limit:?}; stderr: {}",
                String::from_utf8_lossy(&e.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::process::Output {
        status,
        stdout: o.join().unwrap(),
        stderr: e.join().unwrap(),
    }
}

/// The Python of a virtual environment with `openai` installed (made once, then reused).
fn venv_python() -> &'static Path {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
        let py = venv.join("bin").join("python");
        let ready = venv.join("markbase-ready");
        if ready.is_file() {
            return py;
        }
        let base = std::env::var("MARKBASE_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut mk = Command::new(&base);
        mk.args(["-m", "venv", "--clear"]).arg(&venv);
        let out = run_with_timeout(mk, Duration::from_secs(120), "python -m venv");
        assert!(
            out.status.success(),
            "cannot create a virtual environment at {} with {base}: {}",
            venv.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pip = Command::new(&py);
        pip.args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
            "openai",
        ]);
        let out = run_with_timeout(pip, Duration::from_secs(600), "pip install openai");
        assert!(
            out.status.success(),
            "this test needs the openai Python client, and pip could not install it into {}: {}",
            venv.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::write(&ready, b"openai installed\n").unwrap();
        py
    })
}

/// A running `markbase serve`, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// Starts the server on a free port with `extra` options; waits for its address.
fn start(extra: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_markbase"))
        .args(["-m", &model(), "serve", "--port", "0", "--api-key", KEY])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start markbase serve");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(at) = line.find("http://") {
                let url = line[at..]
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .to_string();
                tx.send(Ok(url)).ok();
            } else {
                tx.send(Err(line)).ok();
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut log = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Ok(url)) => return Server { child, url },
            Ok(Err(line)) => log.push(line),
            Err(_) => {
                child.kill().ok();
                panic!("the server did not start within 120 s: {}", log.join("\n"));
            }
        }
    }
}

/// Runs one scenario of serve_client.py against `server`.
fn check(server: &Server, scenario: &str) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/serve_client.py");
    let mut cmd = Command::new(venv_python());
    cmd.arg(&script).args([scenario, &server.url, KEY]);
    let t0 = Instant::now();
    let out = run_with_timeout(cmd, Duration::from_secs(300), scenario);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "scenario {scenario} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&format!("ok {scenario}")), "{stdout}");
    eprintln!("{stdout}({scenario}: {:.1} s)", t0.elapsed().as_secs_f64());
}

#[test]
fn openai_client_against_the_server() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    venv_python();
    // A body limit of 64 KiB: the `errors` scenario's body past it (100 KB) fits the
    // loopback socket's buffers, so the client has sent it all when the server answers 413.
    let server = start(&[
        "--max-seqs",
        "32",
        "--ctx",
        "2048",
        "--max-body-bytes",
        "65536",
    ]);
    for scenario in ["basic", "errors", "concurrency", "disconnect"] {
        check(&server, scenario);
    }
}

#[test]
fn overload_is_refused_and_the_server_recovers() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    venv_python();
    let server = start(&["--max-seqs", "1", "--max-queue", "1", "--ctx", "512"]);
    check(&server, "overload");
}
