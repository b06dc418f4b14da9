#!/usr/bin/env python3
"""PyTorch's figures beside `examples/gpu_bench.rs`: Hugging Face `transformers`'
LlamaForCausalLM on the GPU, bf16, measured the way gpu_bench measures.

Decode at R rows: R sequences of --context prompt tokens are prefilled, then --warmup
untimed and --steps timed greedy steps of one token per row (the KV cache is
transformers' own, the argmax on the device, each step's ids read back to the host as
gpu_bench does). tokens/s = R * steps / time. Prefill: one sequence of --prefill tokens
in one forward pass. The best of --reps repetitions is reported, with the peak device
memory PyTorch allocated.

The weights are random (the model is built from its config): tokens/s depend on the
shape, not on the values. The shapes are those of gpu_bench's models: `demo`
(SmolLM2-135M) and `1b` (Llama 3.2 1B with the demo tokenizer's 49152-token vocabulary,
as examples/random_gguf.rs writes it).

    python3 bench/torch_bench.py --shape demo,1b --json
"""

import argparse
import json
import time

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


def build(shape, dtype):
    config = LlamaConfig(
        vocab_size=49152,
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
    ids = torch.randint(0, 49152, (rows, context), device="cuda")
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
    ids = torch.randint(0, 49152, (1, tokens), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    out.logits[:, -1].argmax(-1).cpu()
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="demo,1b")
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    result = {
        "engine": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}",
        "device": torch.cuda.get_device_name(0),
        "dtype": a.dtype,
        "models": [],
    }
    for shape in a.shape.split(","):
        model = build(shape, dtype)
        torch.cuda.reset_peak_memory_stats()
        entry = {"model": shape, "decode": {}, "params": sum(t.numel() for t in model.parameters())}
        for rows in [int(r) for r in a.rows.split(",")]:
            best = max(decode(model, rows, a.context, a.warmup, a.steps) for _ in range(a.reps))
            entry["decode"][str(rows)] = round(best, 1)
            if not a.json:
                print(f"{shape}: {rows} rows: {best:.1f} tokens/s", flush=True)
        best = max(prefill(model, a.prefill) for _ in range(a.reps))
        entry["prefill"] = round(best, 1)
        entry["peak_memory_mb"] = round(torch.cuda.max_memory_allocated() / 1e6)
        if not a.json:
            print(f"{shape}: prefill {a.prefill}: {best:.1f} tokens/s, peak {entry['peak_memory_mb']} MB", flush=True)
        result["models"].append(entry)
        del model
        torch.cuda.empty_cache()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
