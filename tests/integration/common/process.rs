//! The real `llama-burn-server` binary as a child process, for tests that start it.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The server process, killed when dropped.
pub struct ServerProcess {
    /// The process.
    pub child: Child,
    /// `http://host:port` where it listens.
    pub base: String,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ServerProcess {
    /// Starts the binary with `args` (plus `--port 0`) and waits until it says where
    /// it listens. `LLAMA_BURN_API_KEY` is removed from its environment.
    pub fn start<I, S>(bin: &str, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut child = Command::new(bin)
            .args(["--port", "0"])
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("LLAMA_BURN_API_KEY")
            // The log goes to stdout.
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the server binary starts");
        let log = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        // Drains the log for the whole run (a full pipe would block the server).
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(log).lines().map_while(Result::ok) {
                if let Some(at) = line.find("listening on http://") {
                    let addr = line[at + "listening on http://".len()..]
                        .split_whitespace()
                        .next()
                        .unwrap_or("")
                        .to_string();
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr);
                    }
                }
            }
        });
        let mut server = Self {
            child,
            base: String::new(),
        };
        // `server` kills the process if this fails.
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the server says where it listens");
        server.base = format!("http://{addr}");
        server
    }

    /// Waits (at most `limit`) until `/health` answers 200: the model is loaded.
    pub async fn ready(&self, http: &reqwest::Client, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            let health = http.get(format!("{}/health", self.base)).send().await;
            if health.is_ok_and(|r| r.status().is_success()) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its resident memory.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }
}
