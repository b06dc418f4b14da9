#!/usr/bin/env python3
"""PyTorch's figures beside `examples/gpu_bench.rs`: Hugging Face `transformers`'
LlamaForCausalLM on the GPU, bf16, measured the way gpu_bench measures.

Decode at R rows: R sequences of --context prompt tokens are prefilled, then --warmup
untimed and --steps timed greedy steps of one token per row (the KV cache is
transformers' own, the argmax on the device, each step's ids read back to the host as
gpu_bench does). tokens/s = R * steps / time. Prefill: one sequence of --prefill tokens
in one forward pass. The best of --reps repetitions is reported, with the peak device
memory PyTorch allocated.

--compile also measures transformers' static KV cache (`cache_implementation="static"`)
with the model's forward compiled by `torch.compile(mode="reduce-overhead")` (CUDA
graphs), through `generate()`: a step is timed from one generated token's arrival on the
host to the next (a streamer records the times), prefill from the call to the first
token. Each shape compiles on its first call (untimed; tens of seconds each). A failure
there is recorded in the JSON and leaves the eager figures as they are.

The weights are random (the model is built from its config): tokens/s depend on the
shape, not on the values. The shapes are those of gpu_bench's models: `demo`
(SmolLM2-135M) and `1b` (Llama 3.2 1B with the demo tokenizer's 49152-token vocabulary,
as examples/random_gguf.rs writes it).

    python3 bench/torch_bench.py --shape demo,1b --json           # JSON alone on stdout
    python3 bench/torch_bench.py --shape 1b --json out.json --compile

--json PATH writes the JSON to PATH after every measurement (a run stopped half way
keeps what it measured) and prints the text lines; --json alone prints only the JSON;
without --json both are printed, the JSON last.
"""

import argparse
import json
import os
import time
import traceback

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "demo": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
}

VOCAB = 49152


def build(shape, dtype):
    config = LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype)
    model.eval()
    return model


@torch.inference_mode()
def decode(model, rows, context, warmup, steps):
    ids = torch.randint(0, VOCAB, (rows, context), device="cuda")
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    token.cpu()
    for _ in range(warmup):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        token.cpu()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        token.cpu()
    torch.cuda.synchronize()
    return rows * steps / (time.perf_counter() - start)


@torch.inference_mode()
def prefill(model, tokens):
    ids = torch.randint(0, VOCAB, (1, tokens), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    out.logits[:, -1].argmax(-1).cpu()
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


# ---- static KV cache + torch.compile, through generate() ----

COMPILE_HOW = (
    'generate() with cache_implementation="static", '
    'model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)'
)


def compile_model(model):
    """Static cache and a compiled forward, the same way on every transformers version."""
    import torch._dynamo

    # One graph per input shape (each row count's prefill and step, the long prefill):
    # more than the default recompile limit, past which dynamo falls back to eager.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
    gc = model.generation_config
    gc.cache_implementation = "static"
    # Recent versions compile on their own when the cache is static: off, we compile here.
    if hasattr(gc, "disable_compile"):
        gc.disable_compile = True
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)


class StepClock:
    """A generate() streamer that records when each put() (prompt, then each token) lands."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def generate_times(model, rows, context, new_tokens):
    """One generate() call: (prompt sent or call start, host arrival time of each new token).
    generate() runs without gradients on its own (no inference mode: the compiled graphs
    update the static cache in place)."""
    ids = torch.randint(0, VOCAB, (rows, context), device="cuda")
    clock = StepClock()
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        streamer=clock,
    )
    torch.cuda.synchronize()
    if len(clock.times) < new_tokens:
        raise RuntimeError(f"the streamer saw {len(clock.times)} puts for {new_tokens} tokens")
    # The first put is the prompt (when generate() sends it), then one per token.
    tokens = clock.times[-new_tokens:]
    first = clock.times[0] if len(clock.times) == new_tokens + 1 else start
    return first, tokens


def compiled_decode(model, rows, context, warmup, steps, reps):
    n = 1 + warmup + steps
    generate_times(model, rows, context, n)  # compiles this shape: untimed
    best = 0.0
    for _ in range(reps):
        _, tokens = generate_times(model, rows, context, n)
        best = max(best, rows * steps / (tokens[warmup + steps] - tokens[warmup]))
    return best


def compiled_prefill(model, tokens, reps):
    generate_times(model, 1, tokens, 1)  # compiles this shape: untimed
    best = 0.0
    for _ in range(reps):
        start, times = generate_times(model, 1, tokens, 1)
        best = max(best, tokens / (times[0] - start))
    return best


# ---- driver ----


def write_json(path, result):
    """Writes `result` to `path` whole (a temporary file renamed over it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--shape", default="demo,1b")
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="alone: print only the JSON; with PATH: write it there after every measurement",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also measure a static KV cache with torch.compile (after the eager figures)",
    )
    p.add_argument(
        "--compile-rows",
        help="row counts of the compiled decode (default: --rows; each compiles its own graphs)",
    )
    a = p.parse_args()
    quiet = a.json == "-"
    path = a.json if a.json not in (None, "-") else None

    def say(line):
        if not quiet:
            print(line, flush=True)

    def save():
        if path:
            write_json(path, result)

    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    rows_list = [int(r) for r in a.rows.split(",")]
    compile_rows = [int(r) for r in (a.compile_rows or a.rows).split(",")]
    result = {
        "engine": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}",
        "device": torch.cuda.get_device_name(0),
        "dtype": a.dtype,
        "settings": {
            "context": a.context,
            "steps": a.steps,
            "warmup": a.warmup,
            "prefill": a.prefill,
            "reps": a.reps,
        },
        "models": [],
    }
    save()
    models = []
    for shape in a.shape.split(","):
        model = build(shape, dtype)
        torch.cuda.reset_peak_memory_stats()
        entry = {"model": shape, "decode": {}, "params": sum(t.numel() for t in model.parameters())}
        result["models"].append(entry)
        for rows in rows_list:
            best = max(decode(model, rows, a.context, a.warmup, a.steps) for _ in range(a.reps))
            entry["decode"][str(rows)] = round(best, 1)
            say(f"{shape}: {rows} rows: {best:.1f} tokens/s")
            save()
        best = max(prefill(model, a.prefill) for _ in range(a.reps))
        entry["prefill"] = round(best, 1)
        entry["peak_memory_mb"] = round(torch.cuda.max_memory_allocated() / 1e6)
        say(f"{shape}: prefill {a.prefill}: {best:.1f} tokens/s, peak {entry['peak_memory_mb']} MB")
        save()
        if a.compile:
            models.append((shape, model, entry))
        else:
            del model
            torch.cuda.empty_cache()

    # The compiled figures last: the eager ones of every shape are already saved.
    for shape, model, entry in models:
        compiled = {"how": COMPILE_HOW, "decode": {}, "prefill": None}
        entry["compiled"] = compiled
        try:
            compile_model(model)
            for rows in compile_rows:
                start = time.perf_counter()
                best = compiled_decode(model, rows, a.context, a.warmup, a.steps, a.reps)
                compiled["decode"][str(rows)] = round(best, 1)
                say(
                    f"{shape} compiled: {rows} rows: {best:.1f} tokens/s "
                    f"({time.perf_counter() - start:.0f} s with compilation)"
                )
                save()
            best = compiled_prefill(model, a.prefill, a.reps)
            compiled["prefill"] = round(best, 1)
            say(f"{shape} compiled: prefill {a.prefill}: {best:.1f} tokens/s")
        except Exception as e:  # noqa: BLE001 - recorded, the eager figures stay
            compiled["error"] = f"{type(e).__name__}: {e}"[:2000]
            say(f"{shape} compiled: failed: {compiled['error']}")
            if not quiet:
                traceback.print_exc()
        save()
        del model
        torch.cuda.empty_cache()

    if path:
        say(f"wrote {path}")
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
