#!/usr/bin/env python3
"""A soak test: hostile and well-behaved clients together on loopback, for minutes.

Usage: soak.py SERVER_BINARY [SECONDS] [--json]

Starts the server (demo model, three API-key tenants) and first asks each of eight
well-behaved requests alone, one at a time (sampled at temperature 1 with a seed, the
default request, and greedy, whole and streamed). Then, for SECONDS (default 180), tenant
`good` repeats those requests from four threads while tenants `bad` and `worse` send, in
a loop: bodies over the size limit, JSON nested past the depth limit, keys given twice,
too many prompts and choices, huge stop strings, malformed JSON, connections that send
half a header and hold it, streams that are never read, and bursts over the tenant's
share of choices. Every well-behaved answer must equal its solo answer exactly (text,
and the tokens' log-probabilities), every hostile request must get the status its class
expects (or a closed connection where the server hangs up), the process must stay alive,
and its peak resident memory must stay within a bound.

Prints the counts (served, refused by class, process deaths, answers that differ from
the solo answer); exits 1 if any expectation failed.
"""
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from local_server import free_port, peak_rss_mib, stop

BINARY = sys.argv[1]
SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else 180.0
AS_JSON = "--json" in sys.argv
KEYS = {"good": "soak-good-key", "bad": "soak-bad-key", "worse": "soak-worse-key"}
MAX_RSS_MIB = 1536
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a tokenizer does in one sentence.",
]


class Soak:
    def __init__(self):
        self.port = free_port()
        self.lock = threading.Lock()
        self.counts = {}
        self.failures = []
        self.stop = threading.Event()

    def count(self, key):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def fail(self, message):
        with self.lock:
            if len(self.failures) < 20:
                self.failures.append(message)
            self.counts["failures"] = self.counts.get("failures", 0) + 1

    def start(self):
        keys = os.path.join(tempfile.mkdtemp(), "keys.txt")
        with open(keys, "w") as f:
            f.write("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
        self.proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--api-keys-file", keys,
             "--max-seq-len", "512", "--kv-budget-tokens", "8192",
             "--max-choices-per-tenant", "48", "--header-timeout", "2",
             "--write-timeout", "5", "--body-timeout", "5", "--max-connections", "256"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("the server exited while starting")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except Exception:
                time.sleep(0.5)
        raise SystemExit("the server did not start")

    def post(self, tenant, path, body, timeout=120):
        """One request; returns (status, body bytes), or (None, b"") when the server closed
        the connection."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=data, headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {KEYS[tenant]}",
            })
            response = conn.getresponse()
            return response.status, response.read()
        except (ConnectionError, http.client.HTTPException, socket.timeout, OSError):
            return None, b""
        finally:
            conn.close()

    # The well-behaved requests and what each answer is reduced to for comparison.
    def good_requests(self):
        requests = []
        for i, prompt in enumerate(PROMPTS):
            for stream in (False, True):
                requests.append({
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 24, "seed": 1000 + i, "logprobs": True,
                    "top_logprobs": 2, "stream": stream,
                    # Half sampled at temperature 1 (the default request), half greedy.
                    **({"temperature": 0} if i % 2 else {}),
                })
        return requests

    def answer(self, request):
        status, body = self.post("good", "/v1/chat/completions", request)
        if status != 200:
            return None, status
        if not request["stream"]:
            choice = json.loads(body)["choices"][0]
            return (choice["message"]["content"], json.dumps(choice["logprobs"])), status
        text, logprobs = "", []
        for line in body.decode().splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    text += c["delta"].get("content") or ""
                    if c.get("logprobs"):
                        logprobs += c["logprobs"]["content"]
        return (text, json.dumps({"content": logprobs, "refusal": None})), status

    def good_client(self, solo):
        requests = self.good_requests()
        i = 0
        while not self.stop.is_set():
            k = i % len(requests)
            got, status = self.answer(requests[k])
            if got is None:
                self.fail(f"a well-behaved request got {status}")
            elif got != solo[k]:
                self.count("good_differ")
                self.fail(f"well-behaved request {k} differs from its solo answer")
            else:
                self.count("good_served")
            i += 1

    def expect(self, name, tenant, body, statuses, path="/v1/chat/completions"):
        status, _ = self.post(tenant, path, body, timeout=30)
        if status in statuses:
            self.count(f"refused_{name}" if status != 200 else f"served_{name}")
        else:
            self.fail(f"{name}: got {status}, expected one of {statuses}")

    def hostile_client(self, tenant):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        round_ = 0
        while not self.stop.is_set():
            round_ += 1
            self.expect("too_large", tenant, b'{"prompt": "' + b"a" * (3 << 20) + b'"}',
                        {413, None}, "/v1/completions")
            self.expect("too_deep", tenant, b"[" * 100_000 + b"]" * 100_000, {400})
            self.expect("repeated_key", tenant,
                        b'{"messages": [{"role": "user", "content": "a"}], "messages": []}',
                        {400})
            self.expect("too_many_prompts", tenant,
                        {"prompt": ["a"] * 10_000, "n": 16}, {400}, "/v1/completions")
            self.expect("huge_stop", tenant, {**chat, "stop": ["x" * 200_000]}, {400})
            self.expect("malformed", tenant, b'{"messages": [', {400})
            self.expect("bad_value", tenant, {**chat, "temperature": 1e300}, {400})
            self.half_headers(8)
            if round_ % 4 == 0:
                self.unread_streams(tenant, 4)
                self.burst(tenant)

    def half_headers(self, n):
        """Connections that send half a request header: the server must close each."""
        socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
            socks.append(s)
        for s in socks:
            try:
                closed = s.recv(1024) is not None
            except (socket.timeout, OSError):
                closed = False
            self.count("refused_half_header" if closed else "half_header_held")
            if not closed:
                self.fail("a half-header connection was held past the header timeout")
            s.close()

    def unread_streams(self, tenant, n):
        """Streams whose client never reads, then leaves."""
        body = json.dumps({"messages": [{"role": "user", "content": "Tell a long story."}],
                           "max_tokens": 400, "stream": True, "n": 4}).encode()
        socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\n"
                      + f"Authorization: Bearer {KEYS[tenant]}\r\n".encode()
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            socks.append(s)
        time.sleep(3)
        for s in socks:
            s.close()
            self.count("unread_stream")

    def burst(self, tenant):
        """More choices at once than the tenant's share: some must get 429."""
        statuses = []
        def one():
            status, _ = self.post(tenant, "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "Count."}],
                                   "max_tokens": 8, "n": 8})
            statuses.append(status)
        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for status in statuses:
            if status == 200:
                self.count("served_burst")
            elif status == 429:
                self.count("refused_burst_429")
            else:
                self.fail(f"burst: got {status}")
        if 429 not in statuses:
            self.fail("a burst over the tenant's share got no 429")

    def run(self):
        self.start()
        try:
            solo = []
            for request in self.good_requests():
                got, status = self.answer(request)
                if got is None:
                    raise SystemExit(f"a solo request got {status}")
                solo.append(got)
            started = time.time()
            threads = [threading.Thread(target=self.good_client, args=(solo,)) for _ in range(4)]
            threads += [threading.Thread(target=self.hostile_client, args=(t,))
                        for t in ("bad", "worse")]
            for t in threads:
                t.start()
            while time.time() - started < SECONDS and self.proc.poll() is None:
                time.sleep(1)
            self.stop.set()
            for t in threads:
                t.join(timeout=180)
            alive = self.proc.poll() is None
            result = {
                "seconds": round(time.time() - started, 1),
                "process_deaths": 0 if alive else 1,
                "peak_rss_mib": round(peak_rss_mib(self.proc.pid), 1) if alive else None,
                **dict(sorted(self.counts.items())),
            }
            result.setdefault("good_differ", 0)
            result.setdefault("failures", 0)
            print(json.dumps(result) if AS_JSON else "\n".join(
                f"{k:>28}: {v}" for k, v in result.items()))
            for message in self.failures:
                print("FAILED:", message)
            ok = (alive and not self.failures and result.get("good_served", 0) > 0
                  and result["peak_rss_mib"] <= MAX_RSS_MIB)
            return 0 if ok else 1
        finally:
            stop(self.proc, 40)


if __name__ == "__main__":
    sys.exit(Soak().run())
