#!/usr/bin/env python3
"""Collects the files of a GPU run (`bash bench/gpu_suite.sh run`) into one results file
and prints them as a Markdown table.

    python3 bench/gpu_results.py DIR                 # writes bench/results/gpu-DATE.json
    python3 bench/gpu_results.py DIR --no-write      # the table only

DIR holds what the run wrote: suite.json (GPU, driver, date), bench.json (gpu_bench's JSON
per dtype, {"f32": ..., "bf16": ..., "launches": ...}, the last a short --count-launches
run; bench_f32.json / bench_bf16.json, each one gpu_bench report, are read too),
torch.json (bench/torch_bench.py) and first.json (the first request of
concurrent_server). A missing file or figure is null; launches_per_layer comes from
gpu_bench's "launches": {"per_layer"} or --launches-per-layer.

The results file:

    {"gpu", "driver", "date",
     "llama_burn": {"1b_q4_k_m_f32":  {"decode": {"1", "8", "32", "128"}, "prefill_512"},
                    "1b_q4_k_m_bf16": {...}},
     "torch": {"1b_bf16": {"decode": {...}, "prefill_512"}},
     "first_request_s", "launches_per_layer"}

in tokens/s and seconds; "torch" also gets "1b_bf16_compiled" (static KV cache and
torch.compile) when torch_bench measured it. The table's last column is one row's decode
speed as a share of the memory bandwidth limit: bytes of weights read per token (all of
them, gpu_bench's `weight_bytes`; PyTorch: its parameters in bf16) times tokens/s over
--bandwidth (4.8e12 B/s, an H200's HBM3e).
"""

import argparse
import datetime
import json
import os
import sys

ROWS = ["1", "8", "32", "128"]
PREFILL = 512
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(folder, name):
    path = os.path.join(folder, name)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        print(f"warning: {path} is not JSON ({e})", file=sys.stderr)
        return None


def rounded(value, digits=1):
    return None if value is None else round(float(value), digits)


def bench_model(report):
    """The measured model of a gpu_bench report: the one that is not the demo model."""
    models = (report or {}).get("models") or []
    others = [m for m in models if not str(m.get("model", "")).startswith("SmolLM2")]
    return (others or models or [None])[0]


# gpu_bench reports in bench.json: `fast` in f32 and bf16, `exact` in bf16, `fast` in bf16
# with int8 tensor cores.
VARIANTS = ("f32", "bf16", "bf16_exact", "bf16_tensor_cores")


def ours(report, want_dtype):
    """(figures, weight bytes, launches per layer) of one gpu_bench report."""
    figures = {"decode": {r: None for r in ROWS}, "prefill_512": None}
    model = bench_model(report)
    if model is None:
        return figures, None, None
    if report.get("dtype") not in (None, want_dtype):
        print(f"warning: the {want_dtype} report says dtype {report.get('dtype')}", file=sys.stderr)
    for d in model.get("decode") or []:
        if str(d.get("rows")) in figures["decode"]:
            figures["decode"][str(d["rows"])] = rounded(d.get("tokens_per_s"))
    prefill = model.get("prefill") or {}
    if prefill.get("tokens") == PREFILL:
        figures["prefill_512"] = rounded(prefill.get("tokens_per_s"))
    elif prefill:
        print(f"warning: {want_dtype} prefill is of {prefill.get('tokens')} tokens, not {PREFILL}", file=sys.stderr)
    return figures, model.get("weight_bytes"), launches_per_layer(report)


def launches_per_layer(report):
    """gpu_bench --count-launches's kernel launches per layer of a one-row step, if any."""
    model = bench_model(report)
    if model is None:
        return None
    launches = model.get("launches")
    if isinstance(launches, dict) and launches.get("per_layer") is not None:
        return rounded(launches["per_layer"], 2)
    return model.get("launches_per_layer")


def torch_figures(entry, settings):
    figures = {"decode": {r: None for r in ROWS}, "prefill_512": None}
    for r in ROWS:
        figures["decode"][r] = rounded((entry.get("decode") or {}).get(r))
    # Files written before torch_bench recorded its settings used its default, 512.
    if (settings or {}).get("prefill", PREFILL) == PREFILL:
        figures["prefill_512"] = rounded(entry.get("prefill"))
    return figures


def collect(folder, launches_override):
    suite = load(folder, "suite.json") or {}
    bench = load(folder, "bench.json") or {}
    for dtype in ("f32", "bf16"):
        if bench.get(dtype) is None:
            bench[dtype] = load(folder, f"bench_{dtype}.json")
    torch = load(folder, "torch.json") or {}
    first = load(folder, "first.json") or {}

    result = {
        "gpu": suite.get("gpu") or torch.get("device"),
        "driver": suite.get("driver"),
        "date": suite.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "llama_burn": {},
        "torch": {},
        "first_request_s": None,
        "launches_per_layer": None,
    }
    extra = {"weight_bytes": {}, "torch_params": {}, "first_from": None}
    # The short counting run first, then a full run made with --count-launches.
    launches = launches_per_layer(bench.get("launches"))
    # `fast` (the integer product, the CPU's bits) in f32 and bf16; `exact` in bf16.
    for key in VARIANTS:
        dtype = key.split("_")[0]
        if key not in bench:
            continue
        figures, weight_bytes, found = ours(bench.get(key), dtype)
        result["llama_burn"][f"1b_q4_k_m_{key}"] = figures
        dtype = key
        extra["weight_bytes"][dtype] = weight_bytes
        if launches is None:
            launches = found

    torch_dtype = torch.get("dtype", "bf16")
    entry = next((m for m in torch.get("models") or [] if m.get("model") == "1b"), None)
    result["torch"][f"1b_{torch_dtype}"] = torch_figures(entry or {}, torch.get("settings"))
    extra["torch_params"] = (entry or {}).get("params")
    extra["torch_dtype"] = torch_dtype
    compiled = (entry or {}).get("compiled")
    if compiled:
        result["torch"][f"1b_{torch_dtype}_compiled"] = torch_figures(compiled, torch.get("settings"))
        extra["compiled_error"] = compiled.get("error")

    if first.get("first_token_s") is not None:
        result["first_request_s"] = rounded(first["first_token_s"], 2)
        extra["first_from"] = "the first token of the first request, after the model loaded"
    elif first.get("first_request_s") is not None:
        result["first_request_s"] = rounded(first["first_request_s"], 2)
        extra["first_from"] = (
            f"the whole first request ({first.get('max_tokens', '?')} tokens) after the model "
            "loaded: the example prints no first-token time"
        )
    result["launches_per_layer"] = launches_override if launches_override is not None else launches
    extra["stages"] = suite.get("stages")
    return result, extra


def tokens(value):
    if value is None:
        return "–"
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def share(weight_bytes, tps, bandwidth):
    if not weight_bytes or not tps:
        return "–"
    pct = 100 * weight_bytes * tps / bandwidth
    return f"{pct:.2f}% ({weight_bytes / 1e6:,.0f} MB/token)" if pct < 1 else f"{pct:.1f}% ({weight_bytes / 1e6:,.0f} MB/token)"


def table(result, extra, bandwidth):
    bytes_per = {"bf16": 2, "f16": 2, "f32": 4}
    rows = []
    for key in VARIANTS:
        f = result["llama_burn"].get(f"1b_q4_k_m_{key}")
        if f is None:
            continue
        dtype, _, precision = key.partition("_")
        label = {"tensor_cores": "fast on int8 tensor cores"}.get(precision, precision or "fast")
        name = f"llama-burn {dtype} {label}, 1B Q4_K_M"
        rows.append((name, f, extra["weight_bytes"].get(key)))
    torch_dtype = extra.get("torch_dtype", "bf16")
    params = extra.get("torch_params")
    torch_bytes = params * bytes_per.get(torch_dtype, 2) if params else None
    rows.append((f"PyTorch {torch_dtype}, eager", result["torch"][f"1b_{torch_dtype}"], torch_bytes))
    compiled = result["torch"].get(f"1b_{torch_dtype}_compiled")
    if compiled:
        rows.append((f"PyTorch {torch_dtype}, static cache + torch.compile", compiled, torch_bytes))
    lines = [
        f"| 1B shape, tokens/s | 1 row | 8 rows | 32 rows | 128 rows | prefill {PREFILL} | "
        f"1 row: share of {bandwidth / 1e12:g} TB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, f, weight_bytes in rows:
        cells = [tokens(f["decode"].get(r)) for r in ROWS] + [tokens(f["prefill_512"])]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {share(weight_bytes, f['decode'].get('1'), bandwidth)} |")
    return "\n".join(lines)


def number(text):
    value = float(text)
    return int(value) if value.is_integer() else value


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("folder", help="the files the run wrote")
    p.add_argument("--out", help="results file (default: bench/results/gpu-DATE.json)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bandwidth, bytes/s")
    p.add_argument("--launches-per-layer", type=number, help="when gpu_bench does not report it")
    a = p.parse_args()
    if not os.path.isdir(a.folder):
        sys.exit(f"{a.folder}: not a folder")
    result, extra = collect(a.folder, a.launches_per_layer)

    print(f"GPU: {result['gpu'] or '?'}, driver {result['driver'] or '?'}, {result['date']}\n")
    print(table(result, extra, a.bandwidth))
    print()
    first = result["first_request_s"]
    print(f"first request: {'–' if first is None else f'{first} s'}" + (f" ({extra['first_from']})" if extra["first_from"] else ""))
    print(f"launches per layer: {'–' if result['launches_per_layer'] is None else result['launches_per_layer']}")
    if extra.get("compiled_error"):
        print(f"torch.compile: {extra['compiled_error']}")
    if extra.get("stages"):
        print("stages: " + ", ".join(f"{k} {v.get('status')} ({v.get('seconds')} s)" for k, v in extra["stages"].items()))

    if not a.no_write:
        out = a.out or os.path.join(ROOT, "bench", "results", f"gpu-{result['date']}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        shown = os.path.relpath(out)
        print(f"wrote {out if shown.startswith('..') else shown}")


if __name__ == "__main__":
    main()
