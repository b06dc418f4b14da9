"""The `llama-burn-server` binary against the real `openai` Python client.

    python3 tests/python/test_openai_client.py PATH/TO/llama-burn-server

Starts the server on a free port of 127.0.0.1 with the demo model and an API key, waits
for /health, then checks `client.models.list()` and `client.chat.completions.create`
with and without `stream=True` (greedy answers must agree), the error a wrong key gets,
and that SIGTERM stops the server with exit status 0.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request

import openai

BINARY = None
MODEL = "smollm2-test"
KEY = "test-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenAIClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.port = free_port()
        cls.base = f"http://127.0.0.1:{cls.port}"
        cls.proc = subprocess.Popen(
            [BINARY, "--port", str(cls.port), "--served-model-name", MODEL,
             "--api-key", KEY, "--max-seq-len", "512", "--kv-budget-tokens", "4096"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while True:
            if cls.proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + cls.proc.stdout.read())
            try:
                with urllib.request.urlopen(cls.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                cls.proc.kill()
                raise RuntimeError("the server did not get ready in 120 s")
            time.sleep(0.2)
        cls.client = openai.OpenAI(base_url=cls.base + "/v1", api_key=KEY, max_retries=0)

    @classmethod
    def tearDownClass(cls):
        if cls.proc.poll() is None:
            cls.proc.kill()
            cls.proc.wait()

    def test_1_models_list(self):
        models = self.client.models.list()
        self.assertEqual([m.id for m in models.data], [MODEL])

    def test_2_chat_whole_and_streamed_agree(self):
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is the capital of France?"}]
        whole = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0)
        self.assertEqual(whole.object, "chat.completion")
        self.assertEqual(len(whole.choices), 1)
        answer = whole.choices[0].message.content
        self.assertTrue(answer)
        self.assertIn(whole.choices[0].finish_reason, ("stop", "length"))
        self.assertEqual(whole.usage.total_tokens,
                         whole.usage.prompt_tokens + whole.usage.completion_tokens)

        stream = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True})
        pieces, reasons, usage = [], [], None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
        self.assertEqual("".join(pieces), answer)
        self.assertEqual(reasons, [whole.choices[0].finish_reason])
        self.assertEqual(usage.completion_tokens, whole.usage.completion_tokens)

    def test_3_n_and_stop(self):
        # A stop string that never appears changes nothing.
        out = self.client.chat.completions.create(
            model=MODEL, n=2, max_tokens=8, temperature=0, stop=["never there"],
            messages=[{"role": "user", "content": "Say hello."}])
        self.assertEqual([c.index for c in out.choices], [0, 1])
        self.assertEqual(out.choices[0].message.content, out.choices[1].message.content)

    def test_4_errors(self):
        bad = openai.OpenAI(base_url=self.base + "/v1", api_key="wrong", max_retries=0)
        with self.assertRaises(openai.AuthenticationError):
            bad.models.list()
        with self.assertRaises(openai.NotFoundError):
            self.client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5)

    def test_9_sigterm_exits_zero(self):
        self.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.proc.wait(timeout=60), 0)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    BINARY = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
