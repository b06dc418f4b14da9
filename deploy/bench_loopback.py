#!/usr/bin/env python3
"""Measures the loopback setup (deploy/loopback.sh) with the bench_server example:

1. Throughput and TTFT through the balancer (two replicas) against one replica directly,
   in alternating rounds in one run: the same load, one after the other, so that the
   machine's other work touches both alike. Medians of the rounds are printed.
2. Prefix-cache hit tokens of multi-turn conversations with session stickiness and
   without it (leastconn only), read from both replicas' /metrics.

    python3 deploy/bench_loopback.py [--rounds 2] [--json]

Needs the release server binary and the bench_server example:
    cargo build --release --features llama3,server --bin llama-burn-server --example bench_server
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "loopback.sh")
PORT = 18300


def target_dir():
    return os.environ.get("CARGO_TARGET_DIR") or os.path.join(HERE, "..", "target")


def bench(url, *args, metrics=()):
    command = [os.path.join(target_dir(), "release", "examples", "bench_server"),
               "--url", url, "--json", *args]
    for m in metrics:
        command += ["--metrics-url", m]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout)


def with_stack(sticky, body):
    env = dict(os.environ, LB_PORT=str(PORT), LB_STICKY=str(sticky),
               LB_DIR=tempfile.mkdtemp(prefix="llama-burn-bench-"))
    subprocess.run([SCRIPT, "up"], env=env, check=True, timeout=900)
    try:
        return body()
    finally:
        subprocess.run([SCRIPT, "down"], env=env, check=True, timeout=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-ms", type=float, default=500.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    balancer = f"http://127.0.0.1:{PORT}"
    replicas = [f"http://127.0.0.1:{PORT + 1}", f"http://127.0.0.1:{PORT + 2}"]
    load = ["--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]

    def throughput():
        runs = {"one replica": [], "balancer, 2 replicas": []}
        # Warm both replicas (first-call allocations, prefix cache of the prompts).
        bench(balancer, "--requests", "8", "--max-tokens", "8")
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            runs["one replica"].append(bench(replicas[0], *load))
            runs["balancer, 2 replicas"].append(bench(balancer, *load))
        return runs

    def conversations():
        return bench(balancer, "--conversations", str(args.conversations), "--turns",
                     str(args.turns), "--think-ms", str(args.think_ms), "--max-tokens", "32",
                     metrics=replicas)

    runs = with_stack(1, throughput)
    sticky = with_stack(1, conversations)
    spread = with_stack(0, conversations)

    def median(results, *path):
        values = []
        for result in results:
            value = result
            for key in path:
                value = value[key]
            values.append(value)
        return statistics.median(values)

    rows = []
    for name, results in runs.items():
        failed = sum(r["failed"] for r in results)
        rows.append({
            "setup": name,
            "requests_per_s": median(results, "request_throughput"),
            "output_tokens_per_s": median(results, "output_token_throughput"),
            "ttft_p50_ms": median(results, "ttft_ms", "p50"),
            "ttft_p95_ms": median(results, "ttft_ms", "p95"),
            "itl_p50_ms": median(results, "itl_ms", "p50"),
            "failed": failed,
        })
    cache = [
        {"routing": "sticky (X-Session-Id)", **sticky["prefix_cache"], "failed": sticky["failed"]},
        {"routing": "leastconn only", **spread["prefix_cache"], "failed": spread["failed"]},
    ]
    report = {"rounds": args.rounds, "requests": args.requests, "max_tokens": args.max_tokens,
              "conversations": args.conversations, "turns": args.turns,
              "think_ms": args.think_ms,
              "throughput": rows, "prefix_cache": cache,
              "balancer_to_one_replica_output_tokens": rows[1]["output_tokens_per_s"]
              / rows[0]["output_tokens_per_s"]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"\n{args.requests} streaming chat requests at once, at most {args.max_tokens} "
          f"tokens, medians of {args.rounds} alternating rounds")
    print("| setup | requests/s | output tokens/s | TTFT p50 / p95 ms | ITL p50 ms | failed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['setup']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
              f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} | {r['itl_p50_ms']:.0f} | "
              f"{r['failed']} |")
    print(f"balancer / one replica, output tokens/s: "
          f"{report['balancer_to_one_replica_output_tokens']:.2f}")
    print(f"\n{args.conversations} conversations x {args.turns} turns through the balancer, "
          f"{args.think_ms:.0f} ms mean pause between turns")
    print("| routing | prompt tokens | prefix-cache hit tokens | hit rate | failed |")
    print("| --- | --- | --- | --- | --- |")
    for c in cache:
        print(f"| {c['routing']} | {c['prompt_tokens']:.0f} | {c['hit_tokens']:.0f} | "
              f"{c['hit_rate'] * 100:.1f}% | {c['failed']} |")


if __name__ == "__main__":
    main()
