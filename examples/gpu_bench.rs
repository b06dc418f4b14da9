//! The GPU benchmark: decode tokens/s at several batch sizes and prefill tokens/s on the
//! engine's path (the paged KV cache, `Transformer::forward_paged`, greedy tokens), on
//! the demo model and on `--model PATH` (e.g. a 1B-shaped GGUF), with the memory used.
//! One command on a machine with an NVIDIA GPU:
//!
//! ```sh
//! cargo run --release --features llama3,cuda --example gpu_bench -- --model 1b.Q4_K_M.gguf --json
//! # activations, dense weights and KV cache in bf16 (`Cuda<bf16>`; also f16, f32 the default)
//! cargo run --release --features llama3,cuda --example gpu_bench -- --model 1b.Q4_K_M.gguf --dtype bf16 --json
//! ```
//!
//! Any backend runs it (the one the cargo features choose): `--features wgpu` on Mesa's
//! software Vulkan driver, in CI with tiny settings (`--rows 1,3 --context 5 --steps 2
//! --prefill 24 --reps 1`), and the CPU backend without GPU features.
//!
//! Decode at `R` rows: `R` sequences of the same `--context` prompt tokens (each in its
//! own blocks) are prefilled, then `--warmup` untimed steps and `--steps` timed steps of
//! one token per row run, each step's greedy tokens read back to the host as the
//! continuous engine's step does (on the CubeCL backends the argmax runs on the device
//! and only the ids are read back). tokens/s = `R * steps / time`. Every row must produce
//! the same tokens at every batch size (a row's result never depends on the batch); the
//! run fails if one does not. Prefill: one sequence of `--prefill` tokens in chunks of
//! at most 512 (the engine's largest), tokens/s = `prefill / time`. The best of `--reps`
//! repetitions is reported.
//!
//! Memory: on CUDA, the device memory this process holds as `nvidia-smi` reports it
//! (else the whole GPU's used memory, said as such); on other backends the process's
//! peak resident memory (on a software driver the device memory is host memory).

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
#[cfg(not(feature = "cuda"))]
use common::B;
use common::{ModelOptions, exit_on_error, load_model_as, model_name, peak_rss_bytes};
use llama_burn::backend::{BACKEND_NAME, LlamaBackend, default_device, float_type};
use llama_burn::cache::{BlockId, PagedKvCache};
use llama_burn::llama::Llama;
use llama_burn::model::PagedRow;
use llama_burn::{FloatType, LlamaError, Result};
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(about = "Decode and prefill tokens/s on the chosen backend (a GPU's, usually)")]
struct Args {
    /// A second model to measure after the demo model (a .gguf file or a Hugging Face
    /// directory), e.g. a 1B-shaped GGUF from `examples/random_gguf.rs`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Skip the demo model (measure `--model` only).
    #[arg(long)]
    no_demo: bool,
    /// Batch sizes (rows decoding together), comma-separated.
    #[arg(long, default_value = "1,8,32,128", value_delimiter = ',')]
    rows: Vec<usize>,
    /// Prompt tokens of each decoding row.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Timed decode steps.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Untimed decode steps before them (kernel compilation, autotuning).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Tokens of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    /// Repetitions of each measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Positions per KV block (the engine's default).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[command(flatten)]
    options: ModelOptions,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Count the kernel launches of a one-row decode step (CubeCL backends: every launch
    /// logged by CubeCL's execution-only profiling, no timing), reported per step and
    /// per layer; the decode figures of such a run include the logging's cost.
    #[arg(long)]
    count_launches: bool,
    /// With `--count-launches`: fail if a decode step launches more than this many
    /// kernels per layer (the whole step, output head included, over the layers).
    #[arg(long)]
    max_launches_per_layer: Option<f64>,
    /// On CUDA: Burn's CubeCL backend without its fusion stream (every operation
    /// launched as it comes), to compare with the default `Cuda` (fusion on).
    #[arg(long)]
    no_fusion: bool,
}

/// The largest prompt chunk the engine runs in one step.
const CHUNK: usize = 512;

fn main() {
    let args = Args::parse();
    exit_on_error(run(&args));
}

/// `--dtype` picks the float element: on CUDA as the backend's type (`Cuda<bf16>`,
/// `Cuda<f16>` or `Cuda`), elsewhere as the device's float type (`set_float_type`), which
/// Burn's backends compute in alike.
fn run(args: &Args) -> Result<()> {
    if args.count_launches {
        #[cfg(any(feature = "cuda", feature = "wgpu", feature = "vulkan"))]
        llama_burn::gpu::log_kernel_launches(&launch_log())?;
        #[cfg(not(any(feature = "cuda", feature = "wgpu", feature = "vulkan")))]
        return Err(LlamaError::invalid(
            "--count-launches",
            "true",
            "counts CubeCL kernel launches: build with a GPU feature (cuda, wgpu, vulkan)",
        ));
    }
    #[cfg(feature = "cuda")]
    {
        use burn::backend::Cuda;
        use burn::tensor::{bf16, f16};
        use llama_burn::gpu::Unfused;
        match (args.options.dtype, args.no_fusion) {
            (FloatType::F32, false) => run_on::<Cuda>(args, &default_device()),
            (FloatType::F16, false) => run_on::<Cuda<f16>>(args, &default_device()),
            (FloatType::Bf16, false) => run_on::<Cuda<bf16>>(args, &default_device()),
            (FloatType::F32, true) => run_on::<Unfused<Cuda>>(args, &default_device()),
            (FloatType::F16, true) => run_on::<Unfused<Cuda<f16>>>(args, &default_device()),
            (FloatType::Bf16, true) => run_on::<Unfused<Cuda<bf16>>>(args, &default_device()),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        if args.no_fusion {
            return Err(LlamaError::invalid(
                "--no-fusion",
                "true",
                "compares Burn's CUDA backend with and without fusion: build with --features cuda",
            ));
        }
        run_on::<B>(args, &default_device())
    }
}

fn run_on<C: LlamaBackend>(args: &Args, device: &C::Device) -> Result<()> {
    if args.rows.is_empty() || args.rows.contains(&0) || args.steps == 0 || args.reps == 0 {
        return Err(LlamaError::invalid(
            "--rows/--steps/--reps",
            format!("{:?}/{}/{}", args.rows, args.steps, args.reps),
            "need at least one row, step and repetition",
        ));
    }
    if args.context == 0 || args.prefill == 0 || args.block_size == 0 {
        return Err(LlamaError::invalid(
            "--context/--prefill/--block-size",
            format!("{}/{}/{}", args.context, args.prefill, args.block_size),
            "must be at least 1",
        ));
    }
    let mut models: Vec<Option<&Path>> = Vec::new();
    if !args.no_demo {
        models.push(None);
    }
    if let Some(path) = &args.model {
        models.push(Some(path));
    }
    let mut reports = Vec::new();
    for model in models {
        reports.push(bench_model::<C>(args, model, device)?);
    }
    let dtype = float_type::<C>(device).map_or("other", FloatType::name);
    // Whether the `fast` products of 16 rows or more took int8 tensor cores.
    let tensor_cores = tensor_cores_used::<C>(device);
    if !args.json {
        println!("int8 tensor cores: {tensor_cores}");
    }
    let report = json!({
        "backend": BACKEND_NAME,
        "dtype": dtype,
        "tensor_cores": tensor_cores,
        "settings": {
            "context": args.context,
            "steps": args.steps,
            "warmup": args.warmup,
            "prefill": args.prefill,
            "reps": args.reps,
            "block_size": args.block_size,
        },
        "models": reports,
    });
    if args.json {
        println!("{report:#}");
    }
    Ok(())
}

/// "on" where the device has int8 fragments and the process asks for them
/// (`LLAMA_BURN_TENSOR_CORES=auto`), else why not.
fn tensor_cores_used<C: LlamaBackend>(device: &C::Device) -> &'static str {
    #[cfg(any(feature = "cuda", feature = "wgpu", feature = "vulkan"))]
    {
        use llama_burn::gpu::{TensorCores, tensor_cores_mode};
        match (C::int8_tensor_cores(device), tensor_cores_mode()) {
            (true, TensorCores::Auto) => "on",
            (true, _) => "available, off (LLAMA_BURN_TENSOR_CORES=auto turns them on)",
            (false, _) => "none on this device",
        }
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu", feature = "vulkan")))]
    {
        let _ = device;
        "none on this backend"
    }
}

fn bench_model<C: LlamaBackend>(
    args: &Args,
    model: Option<&Path>,
    device: &C::Device,
) -> Result<Value> {
    let name = model_name(model);
    // `--count-launches` runs 6 steps after the context.
    let steps = (args.warmup + args.steps).max(if args.count_launches { 6 } else { 0 });
    let longest = (args.context + steps).max(args.prefill);
    let llama = load_model_as::<C>(model, longest, &args.options, device)?;
    let dtype = float_type::<C>(device).map_or("other", FloatType::name);
    let c = llama.config().clone();
    let text = "The quick brown fox jumps over the lazy dog, and then it runs far away. ";
    let seed = llama.encode_prompt(text)?;
    let tokens = |n: usize| -> Vec<u32> { seed.iter().copied().cycle().take(n).collect() };

    // Prefill: one sequence in chunks.
    let prompt = tokens(args.prefill);
    let blocks_per_seq = |len: usize| len.div_ceil(args.block_size);
    let mut prefill_best = f64::INFINITY;
    for _ in 0..args.reps {
        let n_blocks = blocks_per_seq(prompt.len());
        let mut cache = PagedKvCache::<C>::new(
            c.n_layers,
            n_blocks,
            args.block_size,
            c.n_kv_heads,
            c.head_dim,
            device,
        )?;
        let table: Vec<BlockId> = (0..n_blocks as BlockId).collect();
        let start = Instant::now();
        let mut last = 0;
        for (i, chunk) in prompt.chunks(CHUNK).enumerate() {
            let row = PagedRow {
                tokens: chunk,
                start: i * CHUNK,
                blocks: &table,
                logits: true,
                all_logits: false,
                adapter: None,
            };
            last = greedy(&llama, &[row], &mut cache)?[0];
        }
        prefill_best = prefill_best.min(start.elapsed().as_secs_f64());
        std::hint::black_box(last);
    }
    let prefill_tps = args.prefill as f64 / prefill_best;
    if !args.json {
        println!(
            "{name} on {BACKEND_NAME} ({dtype}, {}): prefill {prefill_tps:.1} tokens/s",
            c.precision
        );
    }

    // Decode at each batch size.
    let context = tokens(args.context);
    let mut decode = Vec::new();
    let mut reference: Option<Vec<u32>> = None;
    for &rows in &args.rows {
        let per_seq = blocks_per_seq(args.context + args.warmup + args.steps);
        let mut best = f64::INFINITY;
        let mut kv_bytes = 0;
        for _ in 0..args.reps {
            let mut cache = PagedKvCache::<C>::new(
                c.n_layers,
                rows * per_seq,
                args.block_size,
                c.n_kv_heads,
                c.head_dim,
                device,
            )?;
            kv_bytes = cache.allocated_bytes();
            let tables: Vec<Vec<BlockId>> = (0..rows)
                .map(|r| ((r * per_seq) as BlockId..((r + 1) * per_seq) as BlockId).collect())
                .collect();
            // Prefill the rows, a few at a time (at most one chunk's tokens per step).
            let per_step = (CHUNK / args.context).max(1);
            let mut next = Vec::with_capacity(rows);
            for group in tables.chunks(per_step) {
                let step: Vec<PagedRow> = group
                    .iter()
                    .map(|table| PagedRow {
                        tokens: &context,
                        start: 0,
                        blocks: table,
                        logits: true,
                        all_logits: false,
                        adapter: None,
                    })
                    .collect();
                next.extend(greedy(&llama, &step, &mut cache)?);
            }
            let mut generated: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
            let mut start = Instant::now();
            for step in 0..args.warmup + args.steps {
                if step == args.warmup {
                    start = Instant::now();
                }
                let inputs: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                let step_rows: Vec<PagedRow> = inputs
                    .iter()
                    .zip(&tables)
                    .map(|(token, table)| PagedRow {
                        tokens: token,
                        start: args.context + step,
                        blocks: table,
                        logits: true,
                        all_logits: false,
                        adapter: None,
                    })
                    .collect();
                next = greedy(&llama, &step_rows, &mut cache)?;
                for (g, &t) in generated.iter_mut().zip(&next) {
                    g.push(t);
                }
            }
            best = best.min(start.elapsed().as_secs_f64());
            // Every row, at every batch size, decodes the same tokens.
            for row in &generated {
                match &reference {
                    None => reference = Some(row.clone()),
                    Some(want) if want == row => {}
                    Some(want) => {
                        return Err(LlamaError::Runtime(format!(
                            "{name}: a row of a {rows}-row batch decoded {row:?}, the first \
                             row measured {want:?}"
                        )));
                    }
                }
            }
        }
        let tps = (rows * args.steps) as f64 / best;
        if !args.json {
            println!(
                "{name} on {BACKEND_NAME} ({dtype}): decode at {rows} rows {tps:.1} tokens/s \
                 ({:.2} ms a step)",
                best * 1e3 / args.steps as f64
            );
        }
        decode.push(json!({
            "rows": rows,
            "tokens_per_s": tps,
            "ms_per_step": best * 1e3 / args.steps as f64,
            "kv_pool_bytes": kv_bytes,
        }));
    }
    let launches = if args.count_launches {
        let (per_step, kernels) = count_launches(args, &llama, &tokens(args.context), device)?;
        let per_layer = per_step / c.n_layers as f64;
        if !args.json {
            println!(
                "{name}: {per_step:.1} kernel launches a one-row decode step, {per_layer:.2} \
                 a layer"
            );
            for (kernel, n) in &kernels {
                println!("  {n:>6.1}  {kernel}");
            }
        }
        if let Some(max) = args.max_launches_per_layer
            && per_layer > max
        {
            return Err(LlamaError::Runtime(format!(
                "{name}: {per_layer:.2} kernel launches per layer, more than {max}"
            )));
        }
        json!({
            "per_step": per_step,
            "per_layer": per_layer,
            "kernels": kernels.iter().map(|(k, n)| json!({"kernel": k, "per_step": n})).collect::<Vec<_>>(),
        })
    } else {
        Value::Null
    };
    C::sync(device).map_err(|e| LlamaError::Runtime(format!("sync: {e:?}")))?;
    let (memory_bytes, memory_source) = memory_used();
    if !args.json {
        match memory_bytes {
            Some(bytes) => println!("{name}: memory {:.1} MiB ({memory_source})", mib(bytes)),
            None => println!("{name}: memory not available"),
        }
    }
    Ok(json!({
        "model": name,
        "dtype": dtype,
        "precision": c.precision.name(),
        "layers": c.n_layers,
        "d_model": c.d_model,
        "vocab": c.vocab_size,
        "weight_bytes": llama.model.weight_bytes(),
        "prefill": { "tokens": args.prefill, "tokens_per_s": prefill_tps },
        "decode": decode,
        "memory_bytes": memory_bytes,
        "memory_source": memory_source,
        "launches": launches,
    }))
}

/// Where `--count-launches` has CubeCL log the launches.
fn launch_log() -> PathBuf {
    std::env::temp_dir().join(format!("llama-burn-launches-{}.log", std::process::id()))
}

/// The lines of the launch log so far, after the device has finished its work and
/// CubeCL's logging task has caught up.
fn logged_launches<C: LlamaBackend>(device: &C::Device) -> Result<Vec<String>> {
    C::sync(device).map_err(|e| LlamaError::Runtime(format!("sync: {e:?}")))?;
    // CubeCL writes the log from a background task: let it drain.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let text = std::fs::read_to_string(launch_log()).unwrap_or_default();
    Ok(text
        .lines()
        .filter_map(|l| l.strip_prefix("Executing "))
        .map(str::to_string)
        .collect())
}

/// Kernel launches of one-row decode steps: the average per step, and per kernel name
/// (most first).
fn count_launches<C: LlamaBackend>(
    args: &Args,
    llama: &Llama<C>,
    context: &[u32],
    device: &C::Device,
) -> Result<(f64, Vec<(String, f64)>)> {
    const STEPS: usize = 4;
    let c = llama.config();
    let blocks = (context.len() + 2 + STEPS).div_ceil(args.block_size);
    let mut cache = PagedKvCache::<C>::new(
        c.n_layers,
        blocks,
        args.block_size,
        c.n_kv_heads,
        c.head_dim,
        device,
    )?;
    let table: Vec<BlockId> = (0..blocks as BlockId).collect();
    let prompt = [PagedRow {
        tokens: context,
        start: 0,
        blocks: &table,
        logits: true,
        all_logits: false,
        adapter: None,
    }];
    let mut next = greedy(llama, &prompt, &mut cache)?[0];
    let mut position = context.len();
    // Two untimed steps compile whatever a decode step needs.
    let mut step = |next: &mut u32, position: &mut usize| -> Result<()> {
        let token = [*next];
        let rows = [PagedRow {
            tokens: &token,
            start: *position,
            blocks: &table,
            logits: true,
            all_logits: false,
            adapter: None,
        }];
        *next = greedy(llama, &rows, &mut cache)?[0];
        *position += 1;
        Ok(())
    };
    for _ in 0..2 {
        step(&mut next, &mut position)?;
    }
    let before = logged_launches::<C>(device)?.len();
    for _ in 0..STEPS {
        step(&mut next, &mut position)?;
    }
    let lines = logged_launches::<C>(device)?;
    let counted = &lines[before.min(lines.len())..];
    let mut kernels: std::collections::BTreeMap<&str, usize> = Default::default();
    for k in counted {
        *kernels.entry(k.as_str()).or_default() += 1;
    }
    let mut kernels: Vec<(String, f64)> = kernels
        .into_iter()
        .map(|(k, n)| (k.to_string(), n as f64 / STEPS as f64))
        .collect();
    kernels.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok((counted.len() as f64 / STEPS as f64, kernels))
}

/// One step of `rows` on the engine's path: the greedy token of each row, read back (as
/// ids where the backend computes the argmax on the device, as the engine does).
fn greedy<C: LlamaBackend>(
    llama: &Llama<C>,
    rows: &[PagedRow<'_>],
    cache: &mut PagedKvCache<C>,
) -> Result<Vec<u32>> {
    let logits = llama.model.forward_paged(rows, cache)?;
    if let Some(ids) = C::greedy_tokens(&logits)?
        && let Some(ids) = ids.into_iter().collect::<Option<Vec<u32>>>()
    {
        return Ok(ids);
    }
    let [n, vocab] = logits.dims();
    let values = logits
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| LlamaError::Runtime(format!("reading logits: {e:?}")))?;
    Ok((0..n)
        .map(|r| llama_burn::sampling::argmax(&values[r * vocab..(r + 1) * vocab]))
        .collect())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The memory this run holds, and where the figure comes from.
fn memory_used() -> (Option<u64>, &'static str) {
    if BACKEND_NAME == "cuda" {
        if let Some(bytes) = nvidia_smi_process_bytes() {
            return (Some(bytes), "device memory of this process (nvidia-smi)");
        }
        if let Some(bytes) = nvidia_smi_gpu_bytes() {
            return (
                Some(bytes),
                "device memory used on the whole GPU (nvidia-smi; this process not listed)",
            );
        }
    }
    (
        peak_rss_bytes(),
        "peak resident memory of the process (no device memory figure on this backend)",
    )
}

fn nvidia_smi(args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// This process's line of `nvidia-smi --query-compute-apps`, in bytes.
fn nvidia_smi_process_bytes() -> Option<u64> {
    let pid = std::process::id().to_string();
    let text = nvidia_smi(&[
        "--query-compute-apps=pid,used_memory",
        "--format=csv,noheader,nounits",
    ])?;
    text.lines().find_map(|line| {
        let (p, mib) = line.split_once(',')?;
        (p.trim() == pid).then(|| mib.trim().parse::<u64>().ok().map(|m| m << 20))?
    })
}

/// The first GPU's used memory, in bytes.
fn nvidia_smi_gpu_bytes() -> Option<u64> {
    let text = nvidia_smi(&["--query-gpu=memory.used", "--format=csv,noheader,nounits"])?;
    let mib: u64 = text.lines().next()?.trim().parse().ok()?;
    Some(mib << 20)
}
