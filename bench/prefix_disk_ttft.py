#!/usr/bin/env python3
"""Time to first token after a restart, with and without the prefix cache on disk (issue 40).

Usage: prefix_disk_ttft.py [SERVER_BINARY] [--model FILE] [--prefix-tokens N]
                           [--rounds N] [--json] [-- EXTRA SERVER ARGS...]

SERVER_BINARY defaults to $HOME/.cache/llama-burn/target/release/llama-burn-server; the
model to the demo model. A shared prefix of about N tokens (1,500 by default: a long
system prompt or document) is followed by a question. Each round, alternated:

- **warm**: a server with `--prefix-cache-dir D` answers the prefix with one question and
  is stopped (SIGTERM: it finishes its files); a new server on the same directory starts,
  and the prefix with *another* question is timed: its prefix blocks come from disk.
- **cold**: the same two servers on an empty directory that the first one never wrote
  (the second server has nothing on disk): the second request computes the whole prompt.

Each timed request is streamed (`/v1/completions`, `max_tokens` 1, temperature 0); its
time to first token is from sending to the first text chunk. Also reported: the second
server's start time (model load plus reading the blocks), blocks loaded and disk hits
from `/metrics`. A last check damages one block file and adds a file of another model:
the server must start, refuse both with a log line, and answer.

Exits 1 if the warm run's second request hits no disk block, or the damaged-file check
fails.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from local_server import free_port, stop  # noqa: E402


def option(name, default):
    if name in sys.argv:
        return sys.argv[sys.argv.index(name) + 1]
    return default


ARGV = sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
EXTRA = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
POSITIONAL = [a for i, a in enumerate(ARGV)
              if not a.startswith("--") and (i == 0 or ARGV[i - 1] not in
                                             ("--model", "--prefix-tokens", "--rounds"))]
BINARY = POSITIONAL[0] if POSITIONAL else os.path.expanduser(
    "~/.cache/llama-burn/target/release/llama-burn-server")
MODEL = option("--model", None)
PREFIX_TOKENS = int(option("--prefix-tokens", "1500"))
ROUNDS = int(option("--rounds", "3"))
AS_JSON = "--json" in ARGV

COLORS = ["red", "amber", "green", "blue", "violet", "grey", "white"]
STATES = ["complete", "late", "under review", "approved", "withdrawn"]


def prefix(units):
    return "".join(
        f"Section {i}: the committee reviewed item {i * 7 % 113} and found the "
        f"{COLORS[i % 7]} report {STATES[i % 5]}. " for i in range(units))


class Server:
    def __init__(self, cache_dir):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        args = [BINARY, "--port", str(self.port), "--max-seq-len", "4096",
                "--prefix-cache-dir", cache_dir] + EXTRA
        if MODEL:
            args += ["--model", MODEL]
        started = time.perf_counter()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: {self.text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            time.sleep(0.05)
        self.start_s = time.perf_counter() - started

    def text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def complete(self, prompt):
        """(time to first text chunk in s, prompt tokens) of a streamed request."""
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        sent = time.perf_counter()
        first, tokens = None, None
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if first is None and event.get("choices") and event["choices"][0].get("text"):
                    first = time.perf_counter() - sent
                if event.get("usage"):
                    tokens = event["usage"]["prompt_tokens"]
        return first, tokens

    def metric(self, name):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(rf"^llama_burn:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self):
        stop(self.proc, 60)
        os.unlink(self.log.name)


def calibrate():
    """Units of `prefix` that make about PREFIX_TOKENS tokens."""
    d = tempfile.mkdtemp()
    s = Server(d)
    try:
        _, tokens = s.complete(prefix(40))
    finally:
        s.stop()
        shutil.rmtree(d)
    return max(1, round(40 * PREFIX_TOKENS / tokens))


def run(kind, shared):
    """One round of `kind`: (ttft s, second server's start s, prompt tokens, loaded, hits)."""
    written, timed = tempfile.mkdtemp(), None
    try:
        first = Server(written)
        first.complete(shared + "Question: which items were approved?")
        first.stop()
        timed = written if kind == "warm" else tempfile.mkdtemp()
        second = Server(timed)
        try:
            ttft, tokens = second.complete(shared + "Question: which reports were late?")
            loaded = second.metric("prefix_cache_disk_loaded_blocks")
            hits = second.metric("prefix_cache_disk_hits_total")
        finally:
            second.stop()
        return ttft, second.start_s, tokens, loaded, hits
    finally:
        shutil.rmtree(written, ignore_errors=True)
        if timed and timed != written:
            shutil.rmtree(timed, ignore_errors=True)


def damaged_check(shared):
    d = tempfile.mkdtemp()
    try:
        s = Server(d)
        s.complete(shared + "Question: which items were approved?")
        s.stop()
        files = sorted(f for f in os.listdir(d) if f.endswith(".kvb"))
        with open(os.path.join(d, files[0]), "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0x55]))
        with open(os.path.join(d, files[1]), "rb") as f:
            data = bytearray(f.read())
        data[8] ^= 1  # the model fingerprint's first byte: another model's block
        with open(os.path.join(d, "f" * 32 + ".kvb"), "wb") as f:
            f.write(data)
        s = Server(d)
        try:
            ttft, _ = s.complete(shared + "Question: which reports were late?")
            refused = s.metric("prefix_cache_disk_refused_files")
            log = s.text()
        finally:
            s.stop()
        ok = (refused == 2 and "damaged (checksum)" in log and "another model" in log
              and ttft is not None)
        return {"refused_files": refused, "served": ttft is not None, "ok": ok}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    units = calibrate()
    shared = prefix(units)
    results = {"warm": [], "cold": []}
    for r in range(ROUNDS):
        for kind in (("warm", "cold") if r % 2 == 0 else ("cold", "warm")):
            results[kind].append(run(kind, shared))
            if not AS_JSON:
                ttft, start_s, tokens, loaded, hits = results[kind][-1]
                print(f"round {r + 1} {kind}: ttft {ttft * 1000:.0f} ms, start {start_s:.2f} s, "
                      f"{tokens} prompt tokens, {loaded:.0f} blocks loaded, {hits:.0f} disk hits",
                      file=sys.stderr)
    check = damaged_check(shared)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    summary = {
        kind: {
            "ttft_ms": [round(x[0] * 1000, 1) for x in rows],
            "median_ttft_ms": round(median([x[0] for x in rows]) * 1000, 1),
            "median_start_s": round(median([x[1] for x in rows]), 2),
            "prompt_tokens": rows[0][2],
            "blocks_loaded": rows[0][3],
            "disk_hit_tokens": rows[0][4],
        } for kind, rows in results.items()
    }
    summary["cold_over_warm_ttft"] = round(
        summary["cold"]["median_ttft_ms"] / summary["warm"]["median_ttft_ms"], 2)
    summary["damaged_and_foreign_files"] = check
    if AS_JSON:
        print(json.dumps(summary, indent=2))
    else:
        print("| server | TTFT (median ms) | start (s) | prompt tokens | blocks loaded | disk hit tokens |")
        print("| --- | --- | --- | --- | --- | --- |")
        for kind in ("cold", "warm"):
            s = summary[kind]
            print(f"| {kind} | {s['median_ttft_ms']} | {s['median_start_s']} | {s['prompt_tokens']} "
                  f"| {s['blocks_loaded']:.0f} | {s['disk_hit_tokens']:.0f} |")
        print(f"cold / warm TTFT: {summary['cold_over_warm_ttft']}x; damaged and foreign files: {check}")
    bad = any(x[4] <= 0 for x in results["warm"]) or not check["ok"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
