//! Burn's remote backend, measured: the demo model's prefill and one decode step on the
//! local CPU backend against the same model driven through `burn::backend::RemoteBackend`
//! (every tensor operation sent over a WebSocket to a `burn::server` process that owns a
//! Flex CPU device), on loopback.
//!
//! ```sh
//! cargo run --release --features remote --example remote_backend
//! cargo run --release --features remote --example remote_backend -- --reps 15 --json
//! ```
//!
//! Three ways to run the same model:
//!
//! - `local`: Burn's Flex backend in this process, with this crate's CPU kernels
//!   (quantized weights stay in their blocks);
//! - `router`: `burn::backend::Router` over Flex in this process: the operations the
//!   remote backend sends, through the portable `LlamaBackend` defaults (f32 weights,
//!   Burn's operations), without a network. The control: `remote / router` is what the
//!   wire and the second process cost, `router / local` what the portable path costs;
//! - `remote`: `RemoteBackend` connected to a server process. The example starts that
//!   server by running itself again with `--serve PORT` (a separate process, as a GPU host
//!   would be); `--server ws://HOST:PORT` uses a server already running elsewhere instead.
//!
//! It checks that the greedy tokens of the prompt are the same on all three (exit status 1
//! if not), then times prefill and one decode step (1 row, and `--batch` rows in one
//! forward pass) with the backends taking turns in every repetition, and prints medians.
//! Each timing includes reading the logits back to the host, as sampling does. Last, an
//! untimed pass loads the model once more through a TCP relay that counts bytes and
//! WebSocket messages each way: messages to the server are operations (and uploads),
//! messages back are answers to reads, i.e. round trips.
//!
//! Everything the remote model does runs on one thread. Burn 0.21's remote client sends
//! each operation on the stream of the thread that issues it, and the server runs its
//! streams independently: a tensor made on one thread and used or read on another can
//! reach the server before the operation that makes it exists there, and the server
//! panics ("Should have handle for tensor", tracel-ai/burn#3178, #4950). A forward pass
//! runs on rayon's workers (for the CPU kernels) and the caller reads its logits, so the
//! example keeps the caller on a one-thread rayon pool, where the pass stays on the
//! caller's thread.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use burn::backend::remote::RemoteDevice;
use burn::backend::{Flex, RemoteBackend, Router};
use burn::tensor::Tensor;
use clap::Parser;
use llama_burn::LlamaError;
use llama_burn::backend::LlamaBackend;
use llama_burn::llama::Llama;
use llama_burn::model::Logits;
use llama_burn::sampling::Sampler;
use llama_burn::tokenizer::Tokenizer;
use serde_json::json;

type Error = Box<dyn std::error::Error + Send + Sync>;
type LocalRouter = Router<(Flex, Flex)>;

#[derive(Parser, Debug)]
#[command(about = "The demo model on Burn's remote backend against the local backend")]
struct Args {
    /// Serve Burn's remote backend (Flex, the CPU) on this port until stdin closes. The
    /// example runs itself with this to get its server process.
    #[arg(long, value_name = "PORT")]
    serve: Option<u16>,
    /// Use a server already running at this address (`ws://HOST:PORT`) instead of
    /// starting one.
    #[arg(long, value_name = "URL", conflicts_with = "port")]
    server: Option<String>,
    /// Port for the server this example starts (default: a free one).
    #[arg(long)]
    port: Option<u16>,
    /// The prompt.
    #[arg(long, default_value = "The capital of France is")]
    prompt: String,
    /// Greedy tokens compared across the backends.
    #[arg(long, default_value_t = 8)]
    tokens: usize,
    /// Rows of the batched decode step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Repetitions of every timing (the median is reported).
    #[arg(long, default_value_t = 9)]
    reps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(port) = args.serve {
        return serve(port);
    }
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("remote_backend: {e}");
            ExitCode::from(2)
        }
    }
}

/// The server process: Burn's remote server on the CPU backend. Burn's `WsServer` binds
/// 0.0.0.0 (its API takes only a port). Exits when the parent closes our stdin, so it
/// never outlives the measurement.
fn serve(port: u16) -> ExitCode {
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        std::process::exit(0);
    });
    burn::server::start_websocket::<Flex>(Default::default(), port);
    ExitCode::SUCCESS
}

/// The server this example started; killed and reaped when dropped.
struct ServerProcess(Child);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(port: Option<u16>) -> Result<(ServerProcess, String), Error> {
    let port = match port {
        Some(p) => p,
        None => TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(),
    };
    let child = Command::new(std::env::current_exe()?)
        .args(["--serve", &port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    let server = ServerProcess(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err(format!("the server on port {port} did not start within 30 s").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((server, format!("ws://127.0.0.1:{port}")))
}

/// Traffic through a [`relay`]: bytes and WebSocket messages each way.
#[derive(Default)]
struct Traffic {
    /// Client to server: bytes, messages (one per operation, upload or request).
    up: [AtomicU64; 2],
    /// Server to client: bytes, messages (one per answered request: a round trip).
    down: [AtomicU64; 2],
}

impl Traffic {
    /// `[bytes up, messages up, bytes down, messages down]` so far.
    fn snapshot(&self) -> [u64; 4] {
        let get = |a: &AtomicU64| a.load(Ordering::SeqCst);
        [
            get(&self.up[0]),
            get(&self.up[1]),
            get(&self.down[0]),
            get(&self.down[1]),
        ]
    }
}

/// Counts the WebSocket messages in one direction of a connection: skips the HTTP
/// upgrade, then reads frame headers (RFC 6455) and skips their payloads; a frame with
/// FIN set and a data opcode (or a continuation) ends a message.
#[derive(Default)]
struct FrameCounter {
    upgraded: bool,
    tail: Vec<u8>,
    header: Vec<u8>,
    skip: u64,
}

impl FrameCounter {
    /// Feeds bytes; returns how many messages ended in them.
    fn feed(&mut self, mut bytes: &[u8]) -> u64 {
        let mut messages = 0;
        if !self.upgraded {
            self.tail.extend_from_slice(bytes);
            let Some(end) = self.tail.windows(4).position(|w| w == b"\r\n\r\n") else {
                let keep = self.tail.len().saturating_sub(3);
                self.tail.drain(..keep);
                return 0;
            };
            self.upgraded = true;
            let rest = self.tail.split_off(end + 4);
            self.tail.clear();
            return self.feed(&rest);
        }
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = bytes
                    .len()
                    .min(usize::try_from(self.skip).unwrap_or(usize::MAX));
                self.skip -= n as u64;
                bytes = &bytes[n..];
                continue;
            }
            self.header.push(bytes[0]);
            bytes = &bytes[1..];
            let h = &self.header;
            if h.len() < 2 {
                continue;
            }
            let masked = h[1] & 0x80 != 0;
            let extra = match h[1] & 0x7f {
                126 => 2,
                127 => 8,
                _ => 0,
            };
            let needed = 2 + extra + if masked { 4 } else { 0 };
            if h.len() < needed {
                continue;
            }
            let len = match extra {
                0 => u64::from(h[1] & 0x7f),
                _ => h[2..2 + extra]
                    .iter()
                    .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)),
            };
            let (fin, opcode) = (h[0] & 0x80 != 0, h[0] & 0x0f);
            if fin && opcode < 8 {
                messages += 1;
            }
            self.header.clear();
            self.skip = len;
        }
        messages
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, counters: &[AtomicU64; 2]) {
    let mut frames = FrameCounter::default();
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
        counters[0].fetch_add(n as u64, Ordering::SeqCst);
        counters[1].fetch_add(frames.feed(&buf[..n]), Ordering::SeqCst);
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// A TCP relay on a free loopback port to `target` (`host:port`) that counts what
/// passes. Only for the traffic pass: the relay's copies are not in the timings.
fn relay(target: String) -> Result<(u16, Arc<Traffic>), Error> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let traffic = Arc::new(Traffic::default());
    let counts = traffic.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { break };
            let Ok(server) = TcpStream::connect(&target) else {
                break;
            };
            let _ = (client.set_nodelay(true), server.set_nodelay(true));
            let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
                break;
            };
            let (up, down) = (counts.clone(), counts.clone());
            std::thread::spawn(move || pump(client, server, &up.up));
            std::thread::spawn(move || pump(server2, client2, &down.down));
        }
    });
    Ok((port, traffic))
}

fn load<B: LlamaBackend>(device: &B::Device, max_seq_len: usize) -> Result<(Llama<B>, f64), Error> {
    let path = llama_burn::demo::demo_model_path()?;
    let start = Instant::now();
    // Exact: the remote backend computes in Burn's f32 operations, which the CPU
    // backend's exact precision matches (its fast precision quantizes activations).
    let llama = llama_burn::Loader::gguf(path)
        .max_seq_len(max_seq_len)
        .load::<B>(device)?
        .with_precision(llama_burn::Precision::Exact);
    Ok((llama, start.elapsed().as_secs_f64()))
}

fn read_logits<B: LlamaBackend>(logits: Tensor<B, 3>) -> Result<Vec<f32>, Error> {
    logits
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| LlamaError::Runtime(format!("reading logits: {e:?}")).into())
}

/// One timed sample: prefill of `rows` copies of `ids`, then one decode step of every row
/// (the prefill's greedy token), each including the read of the logits. Milliseconds, and
/// the traffic of each (when going through a [`relay`]).
fn sample<B: LlamaBackend>(
    llama: &Llama<B>,
    ids: &[u32],
    rows: usize,
    traffic: Option<&Traffic>,
) -> Result<([f64; 2], [[u64; 4]; 2]), Error> {
    let snapshot = || traffic.map_or([0; 4], Traffic::snapshot);
    let delta = |a: [u64; 4], b: [u64; 4]| std::array::from_fn(|i| b[i] - a[i]);
    let model = &llama.model;
    let tokens: Vec<u32> = ids.repeat(rows);
    let mut cache = model.new_cache(vec![0; rows], ids.len() + 1);
    let t0 = snapshot();
    let start = Instant::now();
    let logits = read_logits(model.forward(&tokens, &mut cache, Logits::Last)?)?;
    let prefill = start.elapsed().as_secs_f64() * 1e3;
    let t1 = snapshot();
    let vocab = logits.len() / rows;
    let next = argmax(&logits[..vocab]);
    let start = Instant::now();
    read_logits(model.forward(&vec![next; rows], &mut cache, Logits::Last)?)?;
    let step = start.elapsed().as_secs_f64() * 1e3;
    let t2 = snapshot();
    Ok(([prefill, step], [delta(t0, t1), delta(t1, t2)]))
}

fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// One round trip: a one-value tensor created on the device, one addition, read back.
fn round_trip<B: LlamaBackend>(device: &B::Device) -> Result<f64, Error> {
    let start = Instant::now();
    let t = Tensor::<B, 1>::from_floats([1.0], device).add_scalar(1.0);
    t.into_data()
        .to_vec::<f32>()
        .map_err(|e| LlamaError::Runtime(format!("{e:?}")))?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn greedy<B: LlamaBackend>(
    llama: &mut Llama<B>,
    prompt: &str,
    tokens: usize,
) -> Result<Vec<u32>, Error> {
    Ok(llama
        .generate(prompt, tokens, 0.0, &mut Sampler::Argmax)?
        .tokens)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Samples of one measurement, per backend: local, router, remote.
#[derive(Default)]
struct Samples([Vec<f64>; 3]);

impl Samples {
    fn medians(&mut self) -> [f64; 3] {
        let [a, b, c] = &mut self.0;
        [median(a), median(b), median(c)]
    }
}

const NAMES: [&str; 3] = ["local", "router", "remote"];

fn run(args: &Args) -> Result<bool, Error> {
    let reps = args.reps.max(1);
    let batch = args.batch.max(1);
    let rows = [1, batch];
    let (server, url) = match &args.server {
        Some(url) => (None, url.clone()),
        None => {
            let (server, url) = start_server(args.port)?;
            (Some(server), url)
        }
    };
    let max_seq_len = 256;

    let (mut local, local_load) = load::<Flex>(&Default::default(), max_seq_len)?;
    let (mut router, router_load) = load::<LocalRouter>(&Default::default(), max_seq_len)?;
    // Every use of a remote model runs on this one thread (see the module docs).
    let remote_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .thread_name(|_| "remote-client".into())
        .build()?;
    let remote_device = RemoteDevice::new(&url);
    let (mut remote, remote_load) =
        remote_thread.install(|| load::<RemoteBackend>(&remote_device, max_seq_len))?;

    // Same greedy tokens everywhere, and how far the logits are apart.
    let want = greedy(&mut local, &args.prompt, args.tokens)?;
    let got_router = greedy(&mut router, &args.prompt, args.tokens)?;
    let got_remote = remote_thread.install(|| greedy(&mut remote, &args.prompt, args.tokens))?;
    let same = want == got_router && want == got_remote;
    let ids = local.encode_prompt(&args.prompt)?;
    let logits_local = local.logits(&ids)?;
    let diff_router = max_diff(&logits_local, &router.logits(&ids)?);
    let logits_remote = remote_thread.install(|| remote.logits(&ids))?;
    let diff_remote = max_diff(&logits_local, &logits_remote);
    let text = local.tokenizer.decode(&want)?;

    // Timings, the backends taking turns (in a rotating order) in every repetition.
    let mut rtt = Samples::default();
    let mut prefill = [Samples::default(), Samples::default()];
    let mut step = [Samples::default(), Samples::default()];
    for _ in 0..2 {
        // Warm-up, untimed.
        sample(&local, &ids, batch, None)?;
        sample(&router, &ids, batch, None)?;
        remote_thread.install(|| sample(&remote, &ids, batch, None))?;
    }
    for rep in 0..reps {
        for turn in 0..3 {
            let which = (rep + turn) % 3;
            for (r, rows) in rows.into_iter().enumerate() {
                let ([p, s], _) = match which {
                    0 => sample(&local, &ids, rows, None)?,
                    1 => sample(&router, &ids, rows, None)?,
                    _ => remote_thread.install(|| sample(&remote, &ids, rows, None))?,
                };
                prefill[r].0[which].push(p);
                step[r].0[which].push(s);
            }
            rtt.0[which].push(match which {
                0 => round_trip::<Flex>(&Default::default())?,
                1 => round_trip::<LocalRouter>(&Default::default())?,
                _ => remote_thread.install(|| round_trip::<RemoteBackend>(&remote_device))?,
            });
        }
    }
    let rtt = rtt.medians();
    let prefill = prefill.each_mut().map(Samples::medians);
    let step = step.each_mut().map(Samples::medians);
    remote_thread.install(move || drop(remote));

    // Traffic, untimed: a second remote model whose connections pass through a
    // counting relay. [load, [rows][prefill, step]], each [bytes up, messages up, bytes
    // down, messages down].
    let target = url.trim_start_matches("ws://").to_string();
    let (relay_port, traffic) = relay(target)?;
    let counted_device = RemoteDevice::new(&format!("ws://127.0.0.1:{relay_port}"));
    let counted = remote_thread.install(|| load::<RemoteBackend>(&counted_device, max_seq_len))?;
    let load_traffic = traffic.snapshot();
    let mut phase_traffic = [[[0u64; 4]; 2]; 2];
    for (r, n) in rows.into_iter().enumerate() {
        let (_, t) = remote_thread.install(|| sample(&counted.0, &ids, n, Some(&traffic)))?;
        phase_traffic[r] = t;
    }
    remote_thread.install(move || drop(counted));
    let server_started_here = server.is_some();
    drop(server);

    let traffic_json = |t: [u64; 4]| {
        json!({"bytes_to_server": t[0], "messages_to_server": t[1],
               "bytes_from_server": t[2], "messages_from_server": t[3]})
    };
    if args.json {
        let table = |m: &[[f64; 3]; 2], what: &str| -> Vec<serde_json::Value> {
            (0..2)
                .map(|r| {
                    json!({
                        "what": what,
                        "rows": rows[r],
                        "local_ms": m[r][0],
                        "router_ms": m[r][1],
                        "remote_ms": m[r][2],
                        "remote_over_local": m[r][2] / m[r][0],
                        "remote_over_router": m[r][2] / m[r][1],
                    })
                })
                .collect()
        };
        let mut timings = table(&prefill, "prefill");
        timings.extend(table(&step, "decode_step"));
        let out = json!({
            "model": "SmolLM2-135M-Instruct (demo, Q4_1 GGUF)",
            "server": url,
            "server_started_here": server_started_here,
            "prompt": args.prompt,
            "prompt_tokens": ids.len(),
            "greedy_tokens": want,
            "greedy_text": text,
            "same_greedy_tokens": same,
            "max_logit_diff_router": diff_router,
            "max_logit_diff_remote": diff_remote,
            "reps": reps,
            "load_s": {"local": local_load, "router": router_load, "remote": remote_load},
            "round_trip_ms": {"local": rtt[0], "router": rtt[1], "remote": rtt[2]},
            "timings": timings,
            "remote_traffic": {
                "load": traffic_json(load_traffic),
                "phases": (0..2).map(|r| json!({
                    "rows": rows[r],
                    "prefill": traffic_json(phase_traffic[r][0]),
                    "decode_step": traffic_json(phase_traffic[r][1]),
                })).collect::<Vec<_>>(),
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("demo model (SmolLM2-135M-Instruct, Q4_1 GGUF); remote server {url}");
        println!(
            "prompt {:?} ({} tokens), greedy {:?} = {text:?}",
            args.prompt,
            ids.len(),
            want
        );
        println!(
            "greedy tokens the same on local, router and remote: {}",
            if same { "yes" } else { "NO" }
        );
        if !same {
            println!("  router {got_router:?}\n  remote {got_remote:?}");
        }
        println!(
            "max |logit diff| against local: router {diff_router:.2e}, remote {diff_remote:.2e}"
        );
        println!(
            "load: local {local_load:.1} s, router {router_load:.1} s, remote {remote_load:.1} s"
        );
        println!("\nmedians of {reps} repetitions, milliseconds (backends take turns):");
        println!(
            "{:<22} {:>9} {:>9} {:>9} {:>13} {:>14}",
            "", NAMES[0], NAMES[1], NAMES[2], "remote/local", "remote/router"
        );
        let line = |label: String, m: [f64; 3]| {
            println!(
                "{label:<22} {:>9.2} {:>9.2} {:>9.2} {:>12.2}x {:>13.2}x",
                m[0],
                m[1],
                m[2],
                m[2] / m[0],
                m[2] / m[1]
            );
        };
        for r in 0..2 {
            line(format!("prefill, {} row(s)", rows[r]), prefill[r]);
        }
        for r in 0..2 {
            line(format!("decode step, {} row(s)", rows[r]), step[r]);
        }
        line("one round trip".into(), rtt);
        println!("\nremote traffic (one run through a counting relay):");
        println!(
            "{:<22} {:>12} {:>12} {:>12} {:>12}",
            "", "MB to srv", "msgs to srv", "kB from srv", "msgs from"
        );
        let traffic_line = |label: String, t: [u64; 4]| {
            println!(
                "{label:<22} {:>12.3} {:>12} {:>12.1} {:>12}",
                t[0] as f64 / 1e6,
                t[1],
                t[2] as f64 / 1e3,
                t[3]
            );
        };
        traffic_line("load".into(), load_traffic);
        for r in 0..2 {
            traffic_line(format!("prefill, {} row(s)", rows[r]), phase_traffic[r][0]);
            traffic_line(
                format!("decode step, {} row(s)", rows[r]),
                phase_traffic[r][1],
            );
        }
    }
    if !same {
        eprintln!("remote_backend: the greedy tokens differ between the backends");
    }
    Ok(same)
}
