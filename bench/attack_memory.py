#!/usr/bin/env python3
"""Peak resident memory of the server under each class of hostile request (issue 39).

Usage: attack_memory.py [SERVER_BINARY] [--json]

SERVER_BINARY defaults to $HOME/.cache/llama-burn/target/release/llama-burn-server. For
each case below a fresh server process (demo model, loopback, an API key, the soak's small
context: --max-seq-len 512, --kv-budget-tokens 8192; the body, depth, count and constraint
limits at their defaults, passed explicitly) gets one small good request as warm-up; its
peak resident memory (VmHWM) is then reset to its current resident memory (`5` written to
/proc/PID/clear_refs, so that the model's load-time peak does not hide the attack) and read
as the baseline. The case's worst body is sent 8 times at once and then once more alone,
VmHWM read again, and a good request must still get 200. Class 9 (one client flooding)
starts the server without an API key and sends 200 requests at once from one address.

Prints a table (class, case, statuses seen, baseline, peak and peak minus baseline in MiB,
resident memory once the attack is over, seconds); with --json the same as JSON. Exits 1
if a case gets a status it does not expect (any 5xx among them), a refusal that does not
name the expected limit, a dead process, or a good request afterwards that is not served.
"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from local_server import free_port, peak_rss_mib, resident_mib, stop  # noqa: E402

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
BINARY = ARGS[0] if ARGS else os.path.expanduser(
    "~/.cache/llama-burn/target/release/llama-burn-server")
AS_JSON = "--json" in sys.argv
KEY = "attack-memory-key"
MAX_BODY = 2 * 1024 * 1024  # --max-body-bytes (its default)
MAX_CONSTRAINT = 65536  # --max-constraint-bytes (its default)
MAX_SEQ_LEN = 512
MAX_TOKEN_BYTES = 256  # src/llama.rs: a longer prompt is refused without tokenizing
CONCURRENCY = 8
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SERVER_ARGS = [
    "--max-seq-len", str(MAX_SEQ_LEN), "--kv-budget-tokens", "8192",
    "--max-body-bytes", str(MAX_BODY), "--max-constraint-bytes", str(MAX_CONSTRAINT),
    "--max-json-depth", "32", "--max-n", "16", "--max-prompts", "64", "--max-choices", "64",
    "--max-stop-strings", "4", "--max-messages", "512",
    "--header-timeout", "5", "--body-timeout", "10", "--write-timeout", "10",
]
GOOD = (CHAT, json.dumps({"messages": [{"role": "user", "content": "Say hi."}],
                          "max_tokens": 4, "temperature": 0}).encode())


def compact(value):
    return json.dumps(value, separators=(",", ":")).encode()


def fill(prefix, unit, suffix, size):
    """prefix + unit * k + suffix, with k as large as keeps it at most `size` bytes."""
    k = (size - len(prefix) - len(suffix)) // len(unit)
    return prefix + unit * k + suffix


def keys_object(size, repeat_first=False, prefix=b"k"):
    """`{"k0":0,"k1":0,...}` of about `size` bytes, all keys distinct (the first again at
    the end with repeat_first); `prefix` instead of `k`."""
    parts, total, i = [], 2, 0
    tail = b'"%s0":1' % prefix if repeat_first else b""
    while True:
        item = b'"%s%d":0' % (prefix, i)
        if total + len(item) + 1 + len(tail) + 1 > size:
            break
        parts.append(item)
        total += len(item) + 1
        i += 1
    if tail:
        parts.append(tail)
    return b"{" + b",".join(parts) + b"}"


def largest(limit, make):
    """The largest k for which make(k) (growing with k) is at most `limit` bytes."""
    lo, hi = 1, 2
    while len(make(hi)) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(make(mid)) <= limit else (lo, mid)
    return lo


def schema_body(schema, max_tokens=8):
    return compact({"prompt": "Answer in JSON:", "max_tokens": max_tokens,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": schema}}})


def props_schema(k):
    props = {f"p{i}": {"type": "integer"} for i in range(k)}
    return {"type": "object", "properties": props, "required": list(props)}


def enum_schema(k):
    return {"enum": [f"v{i:05d}" for i in range(k)]}


def tools_list(k, pad):
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "d" * pad,
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
        for i in range(k)]


def tools_under_limit():
    """128 tools (the most allowed) whose JSON together is just under the limit."""
    base = sum(len(compact(t)) for t in tools_list(128, 0))
    return tools_list(128, (MAX_CONSTRAINT - base) // 128)


def chat(extra):
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **extra}


def cases():
    """(class, case, path, body, expected statuses, text every refusal must contain,
    server flags without the API key (None: with it), concurrency, statuses that must all
    be seen)."""
    lorem = b"Lorem ipsum dolor sit amet, consectetur adipiscing elit 0123456789. "
    at_tokenize_bound = MAX_SEQ_LEN * MAX_TOKEN_BYTES
    zeros = lambda prefix, suffix: fill(prefix, b"0,", b"0" + suffix, MAX_BODY)  # noqa: E731
    rows = [
        ("1 size", "prompt string, body 1 B under --max-body-bytes", COMPLETIONS,
         fill(b'{"max_tokens":1,"prompt":"', b"a", b'"}', MAX_BODY - 1),
         {400}, "any tokenization"),
        ("1 size", f"prompt of {at_tokenize_bound} B (most that is tokenized)", COMPLETIONS,
         b'{"max_tokens":1,"prompt":"' + (lorem * (at_tokenize_bound // len(lorem) + 1))
         [:at_tokenize_bound] + b'"}',
         {400}, "context_length_exceeded"),
        ("1 size", "body 1 B over --max-body-bytes", COMPLETIONS,
         fill(b'{"max_tokens":1,"prompt":"', b"a", b'"}', MAX_BODY + 1),
         {413, "closed"}, ""),
        ("2 structure", "nested ~1M deep, body at the size limit", COMPLETIONS,
         fill(b'{"prompt":"a","x":', b"[", b"", MAX_BODY // 2) + b"]" * (MAX_BODY // 2 - 18)
         + b"}", {400}, "--max-json-depth"),
        ("2 structure", "`stop`: ~700k empty strings", COMPLETIONS,
         fill(b'{"prompt":"a","max_tokens":1,"stop":[', b'"",', b'""]}', MAX_BODY),
         {400}, "--max-stop-strings"),
        ("2 structure", "`messages`: ~700k empty objects", CHAT,
         fill(b'{"max_tokens":1,"messages":[', b"{},", b"{}]}", MAX_BODY),
         {400}, "--max-messages"),
        ("2 structure", "`prompt`: ~500k one-token prompts", COMPLETIONS,
         fill(b'{"max_tokens":1,"prompt":[', b"[1],", b"[1]]}", MAX_BODY),
         {400}, "--max-prompts"),
        ("2 structure", "unknown field: ~200k distinct keys", COMPLETIONS,
         b'{"prompt":"a","max_tokens":1,"x":' + keys_object(MAX_BODY - 40) + b"}",
         {200, 400}, ""),
        ("3 repeated key", "`prompt` twice, ~1 MiB each", COMPLETIONS,
         b'{"prompt":"' + b"a" * (MAX_BODY // 2 - 20) + b'","prompt":"'
         + b"a" * (MAX_BODY // 2 - 20) + b'"}', {400}, "more than once"),
        ("3 repeated key", "`response_format` twice, first ~1M-element array", COMPLETIONS,
         fill(b'{"prompt":"a","response_format":{"type":"text","junk":[', b"0,",
              b'0]},"response_format":{"type":"text"}}', MAX_BODY),
         {400}, "more than once"),
        ("3 repeated key", "~200k distinct keys, then the first again", COMPLETIONS,
         b'{"prompt":"a","max_tokens":1,"x":' + keys_object(MAX_BODY - 40, True) + b"}",
         {400}, "more than once"),
        ("4 ignored payload", "`response_format` text + 2 MiB string field", COMPLETIONS,
         fill(b'{"prompt":"a","max_tokens":2,"response_format":{"type":"text","junk":"',
              b"a", b'"}}', MAX_BODY), {200, 400}, ""),
        ("4 ignored payload", "`response_format` text + ~1M-element array", COMPLETIONS,
         zeros(b'{"prompt":"a","max_tokens":2,"response_format":{"type":"text","junk":[',
               b"]}}"), {200, 400}, ""),
        ("5 echo x n", f"n 16, echo, logprobs 5, {MAX_SEQ_LEN - 1}-token prompt", COMPLETIONS,
         compact({"prompt": "hi " * (MAX_SEQ_LEN - 2), "max_tokens": 1, "n": 16,
                  "echo": True, "logprobs": 5}), {200, 400}, ""),
        ("6 json_schema", "~1900 required properties, under the limit", COMPLETIONS,
         schema_body(props_schema(largest(MAX_CONSTRAINT, lambda k: compact(props_schema(k))))),
         {200, 400}, ""),
        ("6 json_schema", "enum of ~7000 strings, under the limit", COMPLETIONS,
         schema_body(enum_schema(largest(MAX_CONSTRAINT, lambda k: compact(enum_schema(k))))),
         {200, 400}, ""),
        ("6 json_schema", "schema of ~1M elements, body at the size limit", COMPLETIONS,
         zeros(b'{"prompt":"a","max_tokens":8,"response_format":{"type":"json_schema",'
               b'"json_schema":{"name":"x","schema":{"type":"object","x":[', b"]}}}}"),
         {400}, "--max-constraint-bytes"),
        ("7 tools", "128 tools, just under the 64 KiB limit", CHAT,
         compact(chat({"tools": tools_under_limit()})), {200, 400}, ""),
        ("7 tools", "129 tools", CHAT,
         compact(chat({"tools": tools_list(129, 1)})), {400}, "at most 128"),
        ("7 tools", "one tool of ~1M elements, body at the size limit", CHAT,
         zeros(b'{"messages":[{"role":"user","content":"Hello"}],"max_tokens":4,"tools":'
               b'[{"type":"function","function":{"name":"f","parameters":{"type":"object",'
               b'"x":[', b"]}}}]}"), {400}, "--max-constraint-bytes"),
        ("8 values", 'logit_bias keys "1", "01", "+1"', COMPLETIONS,
         b'{"prompt":"a","max_tokens":2,"logit_bias":{"1":1,"01":1,"+1":1}}',
         {400}, "not a token id"),
        ("8 values", "temperature 1e-300", COMPLETIONS,
         b'{"prompt":"a","max_tokens":2,"temperature":1e-300}', {200}, ""),
        ("8 values", "max_tokens 10^15", COMPLETIONS,
         b'{"prompt":"a","max_tokens":1000000000000000}', {400}, "context window"),
        ("8 values", "logit_bias: ~200k keys, body at the size limit", COMPLETIONS,
         b'{"prompt":"a","max_tokens":2,"logit_bias":'
         + keys_object(MAX_BODY - 60, prefix=b"") + b"}", {400}, "at most 1024"),
    ]
    out = [(*row, [], CONCURRENCY, set()) for row in rows]
    out.append(("9 flood", "200 at once, one address, no API key", COMPLETIONS,
                compact({"prompt": "Count to ten:", "max_tokens": 16}), {200, 429}, "",
                None, 200, {200, 429}))
    return out


def post(port, path, body, key, timeout=180):
    """One request on its own connection; (status, the start of the answer's body), where
    status is "closed" when the server hung up without an answer."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n").encode()
    chunks = []
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            try:
                s.sendall(head + body)
            except OSError:
                pass  # answered (413) and closed before reading it all: read the answer
            while True:
                try:
                    chunk = s.recv(1 << 16)
                except socket.timeout:
                    return "timeout", ""
                except OSError:
                    break
                if not chunk:
                    break
                chunks.append(chunk)
    except OSError as e:
        return "connect-failed", str(e)
    data = b"".join(chunks)
    m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    if not m:
        return "closed", ""
    return int(m.group(1)), data.partition(b"\r\n\r\n")[2][:400].decode(errors="replace")


def at_once(port, path, body, key, n):
    """n copies of the request at the same moment; their results."""
    results = [None] * n
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        results[i] = post(port, path, body, key)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def start(flags):
    port = free_port()
    log = tempfile.TemporaryFile()
    # Keys come only from the flags (class 9 runs without any).
    env = {k: v for k, v in os.environ.items()
           if k not in ("LLAMA_BURN_API_KEY", "LLAMA_BURN_METRICS_KEY")}
    proc = subprocess.Popen([BINARY, "--port", str(port), *flags, *SERVER_ARGS],
                            stdout=subprocess.DEVNULL, stderr=log, env=env)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc, port, log
        except OSError:
            pass
        time.sleep(0.3)
    log.seek(0)
    raise SystemExit(f"the server did not start: {log.read()[-2000:].decode(errors='replace')}")


def run_case(klass, name, path, body, expected, text, flags, concurrency, required):
    key = KEY if flags is not None else None
    proc, port, log = start(["--api-key", KEY, *flags] if flags is not None else [])
    problems = []
    try:
        warm = post(port, *GOOD, key)
        if warm[0] != 200:
            problems.append(f"warm-up got {warm[0]}")
        loaded_hwm = peak_rss_mib(proc.pid)
        try:
            with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS now
        except OSError as e:
            problems.append(f"could not reset VmHWM ({e}); the baseline is the load peak")
        baseline = peak_rss_mib(proc.pid)
        started = time.time()
        results = at_once(port, path, body, key, concurrency)
        if concurrency != 200:
            results.append(post(port, path, body, key))
        seconds = time.time() - started
        alive = proc.poll() is None
        peak = peak_rss_mib(proc.pid) if alive else None
        after = post(port, *GOOD, key) if alive else ("dead", "")
        rss_after = resident_mib(proc.pid) if proc.poll() is None else None
        statuses = Counter(str(s) for s, _ in results)
        samples = {}
        for status, answer in results:
            samples.setdefault(str(status), answer[:200])
            bad_status = status not in expected or (isinstance(status, int) and status >= 500)
            if bad_status:
                problems.append(f"got {status}: {answer[:160]!r}")
            elif text and status != 200 and status != "closed" and text not in answer:
                problems.append(f"{status} does not name {text!r}: {answer[:160]!r}")
        for status in required:
            if str(status) not in statuses:
                problems.append(f"no {status} among {dict(statuses)}")
        if not alive:
            log.seek(0)
            problems.append("the process died: "
                            + log.read()[-600:].decode(errors="replace"))
        elif after[0] != 200:
            problems.append(f"a good request afterwards got {after[0]}")
    finally:
        stop(proc, 30)
        log.close()
    return {
        "class": klass, "case": name, "path": path, "body_bytes": len(body),
        "requests": len(results), "statuses": dict(sorted(statuses.items())),
        "loaded_peak_mib": round(loaded_hwm, 1), "baseline_mib": round(baseline, 1),
        "peak_mib": round(peak, 1) if peak is not None else None,
        "growth_mib": round(peak - baseline, 1) if peak is not None else None,
        "rss_after_mib": round(rss_after, 1) if rss_after is not None else None,
        "seconds": round(seconds, 1), "after_status": after[0],
        "answers": samples, "problems": problems[:6],
    }


def table(rows):
    header = ("class", "case", "statuses", "base", "peak", "+MiB", "after", "s")
    lines = [header]
    for r in rows:
        statuses = " ".join(f"{k}x{v}" for k, v in r["statuses"].items())
        lines.append((r["class"], r["case"] + ("" if not r["problems"] else "  <-- FAILED"),
                      statuses, f'{r["baseline_mib"]:.0f}',
                      "-" if r["peak_mib"] is None else f'{r["peak_mib"]:.0f}',
                      "-" if r["growth_mib"] is None else f'{r["growth_mib"]:+.0f}',
                      "-" if r["rss_after_mib"] is None else f'{r["rss_after_mib"]:.0f}',
                      f'{r["seconds"]:.1f}'))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = []
    for j, line in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))))
        if j == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def main():
    if not os.access(BINARY, os.X_OK):
        raise SystemExit(f"no server binary at {BINARY}")
    started = time.time()
    rows = [run_case(*case) for case in cases()]
    failed = [r for r in rows if r["problems"]]
    if AS_JSON:
        print(json.dumps({"binary": BINARY, "seconds": round(time.time() - started, 1),
                          "cases": rows, "failed": len(failed)}, indent=1))
    else:
        print(f"{len(rows)} cases, {CONCURRENCY} at once + 1 alone each (class 9: 200 at "
              f"once); MiB: base = VmRSS after warm-up (VmHWM reset), peak = VmHWM after, "
              f"after = VmRSS after the attack and one good request")
        print(table(rows))
        print(f"total {time.time() - started:.0f} s")
        for r in failed:
            for p in r["problems"]:
                print(f"FAILED {r['class']} / {r['case']}: {p}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
