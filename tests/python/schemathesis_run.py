#!/usr/bin/env python3
"""Schemathesis against the live server: every route of /openapi.json, generated inputs.

Usage: schemathesis_run.py SERVER_BINARY [MAX_EXAMPLES] [SEED]

Starts the server (demo model, an API key, small limits so that a generated request that
passes validation costs at most a short generation) on a free port of 127.0.0.1, runs
Schemathesis's `st run` with a fixed seed and a bounded number of examples per operation,
then validates streamed answers of the three generation routes against the description
(generated requests rarely stream valid requests, so that stage makes sure every run
checks them), and checks that the process is still alive and that its peak resident
memory stayed under a bound. Fails (exit 1) on any check's failure:

- not_a_server_error: no 5xx, except the documented 503 (the server never answers 500
  to a request; 503 only while loading or stopping, which this run never sees).
- status_code_conformance, content_type_conformance, response_headers_conformance,
  response_schema_conformance: every answer is one the description lists, in its
  content type, matching its schema.
- negative_data_rejection: a body that breaks the schema gets a 4xx.

A streamed answer's description is the schema of each server-sent event, as OpenAPI 3.1
says and Schemathesis reads it: `data` holds JSON of the chunk's schema (or `[DONE]`).

`positive_data_acceptance` is left out: the schema describes types, and a well-typed
request may still be refused with a 400 (a temperature over 2, a model that is not the
served one, a prompt over the context).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from local_server import free_port, peak_rss_mib, stop

BINARY = sys.argv[1]
MAX_EXAMPLES = sys.argv[2] if len(sys.argv) > 2 else "25"
SEED = sys.argv[3] if len(sys.argv) > 3 else "20261128"
KEY = "schemathesis-key"
# The server's peak resident memory after the run must stay under this (the demo model
# is about 100 MB on disk; the engine's KV pool here is small).
MAX_RSS_MIB = 1536
CHECKS = ",".join([
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
])


# Streamed requests every run sends, each answered 200 with a `text/event-stream` body.
STREAMS = [
    ("/v1/completions", {"prompt": "Hello", "stream": True, "max_tokens": 5}),
    ("/v1/completions", {"prompt": [[6207]], "stream": True, "max_tokens": 5,
                         "logprobs": 2, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "stream": True, "max_tokens": 5, "logprobs": True,
                              "top_logprobs": 2, "n": 2,
                              "stream_options": {"include_usage": True}}),
    ("/v1/responses", {"input": "Hi", "stream": True, "max_output_tokens": 5}),
]


def check_streams(base):
    """Sends STREAMS and validates each answer, event by event, against the served
    description with Schemathesis's own response checks. Returns what failed."""
    import schemathesis

    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    failures = []
    for path, body in STREAMS:
        case = schema[path]["POST"].Case(
            body=body, headers={"Authorization": f"Bearer {KEY}"})
        response = case.call(base_url=base, timeout=60)
        # Schemathesis's response keeps each header's values as a list.
        kind = "".join(
            next((v for k, v in response.headers.items() if k.lower() == "content-type"), []))
        if response.status_code != 200 or not kind.startswith("text/event-stream"):
            failures.append(f"{path}: {response.status_code} {kind} {response.text[:300]}")
            continue
        try:
            case.validate_response(response)
        except BaseExceptionGroup as group:  # Schemathesis's FailureGroup, a check each
            failures.extend(f"{path}: {str(error)[:1500]}" for error in group.exceptions)
        else:
            events = response.text.count("data:")
            print(f"streamed {path}: {events} events match the description")
    return failures


def main():
    st = shutil.which("st") or os.path.join(os.path.dirname(sys.executable), "st")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [BINARY, "--port", str(port), "--api-key", KEY, "--metrics-key", KEY,
         # A validated request generates at most 128 tokens less its prompt.
         "--max-seq-len", "128", "--kv-budget-tokens", "4096",
         "--max-n", "4", "--max-prompts", "4", "--max-choices", "8",
         "--max-body-bytes", "65536", "--body-timeout", "5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if proc.poll() is not None or time.time() > deadline:
                print("the server did not start:", proc.stderr.read()[-2000:])
                return 1
            time.sleep(0.5)
        started = time.time()
        run = subprocess.run(
            [st, "run", base + "/openapi.json", "--checks", CHECKS,
             "--max-examples", MAX_EXAMPLES, "--seed", SEED, "--workers", "2",
             "--request-timeout", "60", "--no-color",
             "--header", f"Authorization: Bearer {KEY}",
             "--report", "ndjson", "--report-dir", "/tmp/schemathesis-report",
             # Each run is the seed's own: no examples replayed from an earlier run.
             "--generation-database", "none"],
            text=True, capture_output=True,
            # Its example database (.schemathesis/) goes there, not into the checkout.
            cwd=tempfile.gettempdir(),
        )
        seconds = time.time() - started
        print(run.stdout[-6000:])
        if run.stderr.strip():
            print(run.stderr[-2000:])
        streamed = check_streams(base)
        alive = proc.poll() is None
        rss = peak_rss_mib(proc.pid) if alive else float("nan")
        summary = {
            "schemathesis_exit": run.returncode,
            "seconds": round(seconds, 1),
            "server_alive": alive,
            "server_peak_rss_mib": round(rss, 1),
            "max_examples_per_operation": int(MAX_EXAMPLES),
            "seed": int(SEED),
        }
        print(json.dumps(summary))
        if run.returncode != 0:
            print("schemathesis found failures (above)")
            return 1
        if streamed:
            print("streamed answers that break the description:", *streamed, sep="\n  ")
            return 1
        if not alive:
            print("the server died during the run:", proc.stderr.read()[-2000:])
            return 1
        if rss > MAX_RSS_MIB:
            print(f"the server's peak memory {rss:.0f} MiB is over {MAX_RSS_MIB} MiB")
            return 1
        return 0
    finally:
        stop(proc, 40)


if __name__ == "__main__":
    sys.exit(main())
