"""The `llama-burn-server` binary against the real `openai` Python client.

    python3 tests/python/test_openai_client.py PATH/TO/llama-burn-server

Starts the server on a free port of 127.0.0.1 with the demo model and an API key, waits
for /health, then checks `client.models.list()` and `client.chat.completions.create`
with and without `stream=True` (greedy answers must agree), the error a wrong key gets,
log-probabilities (chat, streamed and not; completions), the seed sent back, penalties,
`logit_bias`, vLLM's extensions through `extra_body`, 400s naming the field, a LoRA
adapter (the test fixture, `--lora`) selected by `model`, streamed and not, and loaded and
unloaded at run time through the admin routes, the echo of token-id prompts,
`embeddings.create` (one and many inputs, float and base64, token ids, `dimensions`), and
that SIGTERM stops the server with exit status 0.
"""

import math

import json
import os
import signal
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request

import openai

from local_server import free_port

BINARY = None
MODEL = "smollm2-test"
KEY = "test-key"
ADMIN = "admin-key"
ADAPTER = "smol-lora"
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "lora")


class OpenAIClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.port = free_port()
        cls.base = f"http://127.0.0.1:{cls.port}"
        cls.proc = subprocess.Popen(
            [BINARY, "--port", str(cls.port), "--served-model-name", MODEL,
             "--api-key", KEY, "--max-seq-len", "512", "--kv-budget-tokens", "4096",
             "--lora", f"{ADAPTER}={os.path.join(FIXTURES, 'peft')}", "--admin-key", ADMIN],
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
        self.assertEqual([m.id for m in models.data], [MODEL, ADAPTER])
        self.assertEqual(models.data[1].parent, MODEL)

    def _admin(self, route, body, key=ADMIN):
        request = urllib.request.Request(
            self.base + route, data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def test_11_lora_adapter_by_model_whole_and_streamed(self):
        prompt = "The capital of France is"
        base = self.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        whole = self.client.completions.create(
            model=ADAPTER, prompt=prompt, max_tokens=16, temperature=0)
        self.assertEqual(whole.model, ADAPTER)
        # The fixture's adapter changes this continuation from its 11th token on.
        self.assertNotEqual(whole.choices[0].text, base.choices[0].text)
        streamed = "".join(
            c.choices[0].text for c in self.client.completions.create(
                model=ADAPTER, prompt=prompt, max_tokens=16, temperature=0, stream=True)
            if c.choices)
        self.assertEqual(streamed, whole.choices[0].text)
        chat = self.client.chat.completions.create(
            model=ADAPTER, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            temperature=0)
        self.assertEqual(chat.model, ADAPTER)
        self.assertTrue(chat.choices[0].message.content)
        with self.assertRaises(openai.NotFoundError) as e:
            self.client.completions.create(model="no-such-adapter", prompt=prompt, max_tokens=2)
        self.assertEqual(e.exception.code, "model_not_found")

    def test_12_lora_adapters_load_and_unload_at_run_time(self):
        gguf = os.path.join(FIXTURES, "adapter.gguf")
        # The admin key opens the routes; an API key does not.
        status, _ = self._admin("/v1/load_lora_adapter",
                                {"lora_name": "late", "lora_path": gguf}, key=KEY)
        self.assertEqual(status, 401)
        status, body = self._admin("/v1/load_lora_adapter",
                                   {"lora_name": "late", "lora_path": gguf})
        self.assertEqual(status, 200, body)
        self.assertEqual(body["rank"], 4)
        self.assertIn("late", [m.id for m in self.client.models.list().data])
        out = self.client.completions.create(
            model="late", prompt="Once upon a time", max_tokens=4, temperature=0)
        self.assertEqual(out.usage.completion_tokens, 4)
        # A file that is not an adapter: 400, and the server goes on.
        status, body = self._admin("/v1/load_lora_adapter",
                                   {"lora_name": "bad", "lora_path": os.path.join(FIXTURES, "reference.json")})
        self.assertEqual(status, 400, body)
        status, body = self._admin("/v1/unload_lora_adapter", {"lora_name": "late"})
        self.assertEqual(status, 200, body)
        self.assertNotIn("late", [m.id for m in self.client.models.list().data])
        with self.assertRaises(openai.NotFoundError):
            self.client.completions.create(model="late", prompt="Hi", max_tokens=2)
        status, _ = self._admin("/v1/unload_lora_adapter", {"lora_name": "late"})
        self.assertEqual(status, 404)

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
        # The same prompt again: its whole blocks (16 tokens each, never the last token)
        # come from the prefix cache.
        self.assertEqual(usage.prompt_tokens_details.cached_tokens,
                         (usage.prompt_tokens - 1) // 16 * 16)

    def test_3_n_and_stop(self):
        messages = [{"role": "user", "content": "Say hello."}]
        plain = self.client.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0, messages=messages)
        text = plain.choices[0].message.content
        self.assertTrue(text)
        # A stop string that never appears changes nothing: both choices are the answer
        # without `stop`.
        out = self.client.chat.completions.create(
            model=MODEL, n=2, max_tokens=8, temperature=0, stop=["never there"],
            messages=messages)
        self.assertEqual([c.index for c in out.choices], [0, 1])
        self.assertEqual([c.message.content for c in out.choices], [text, text])
        # A stop string that does appear cuts the answer just before it, with
        # finish_reason "stop".
        words = text.split()
        self.assertGreaterEqual(len(words), 2, text)
        stop = words[1]
        cut = self.client.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0, stop=[stop], messages=messages)
        self.assertEqual(cut.choices[0].message.content, text[:text.index(stop)])
        self.assertEqual(cut.choices[0].finish_reason, "stop")

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

    def test_5_chat_logprobs_whole_and_streamed(self):
        messages = [{"role": "user", "content": "Name a color."}]
        whole = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
            top_logprobs=5)
        content = whole.choices[0].logprobs.content
        self.assertEqual(len(content), whole.usage.completion_tokens)
        for entry in content:
            self.assertLessEqual(entry.logprob, 0.0)
            self.assertEqual(len(entry.top_logprobs), 5)
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(entry.logprob, max(t.logprob for t in entry.top_logprobs),
                                   places=6)
            self.assertTrue(all(t.logprob <= 0.0 for t in entry.top_logprobs))
            self.assertLessEqual(sum(math.exp(t.logprob) for t in entry.top_logprobs),
                                 1.0 + 1e-5)
            self.assertEqual(bytes(entry.bytes).decode("utf-8", "replace"), entry.token)
        text = "".join(e.token for e in content if e.token != "<|im_end|>")
        self.assertEqual(text, whole.choices[0].message.content)

        stream = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
            top_logprobs=5, stream=True)
        streamed = []
        for chunk in stream:
            for choice in chunk.choices:
                if choice.logprobs is not None and choice.logprobs.content:
                    streamed.extend(choice.logprobs.content)
        self.assertEqual([(e.token, e.logprob) for e in streamed],
                         [(e.token, e.logprob) for e in content])
        # Without logprobs asked for, none come.
        plain = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0)
        self.assertIsNone(plain.choices[0].logprobs)

    def test_6_completions_logprobs(self):
        out = self.client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
            logprobs=3)
        lp = out.choices[0].logprobs
        self.assertEqual(len(lp.tokens), out.usage.completion_tokens)
        self.assertEqual(len(lp.token_logprobs), len(lp.tokens))
        self.assertTrue(all(x <= 0.0 for x in lp.token_logprobs))
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            self.assertLessEqual(len(top), 3)
            self.assertAlmostEqual(chosen, max(top.values()), places=6)
        self.assertEqual(lp.text_offset, sorted(lp.text_offset))
        self.assertEqual(lp.text_offset[0], 0)
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.completions.create(model=MODEL, prompt="a", max_tokens=2, logprobs=6)
        self.assertEqual(e.exception.param, "logprobs")
        # echo with max_tokens=0: the prompt's log-probabilities (lm-evaluation-harness's
        # loglikelihood), streamed and not; the first token has none.
        prompt = "The capital of France is Paris."
        echo = self.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        lp = echo.choices[0].logprobs
        self.assertEqual(echo.choices[0].text, prompt)
        self.assertEqual("".join(lp.tokens), prompt)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertTrue(all(x <= 0.0 for x in lp.token_logprobs[1:]))
        self.assertEqual(echo.usage.completion_tokens, 0)
        streamed = []
        for chunk in self.client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    streamed.extend(choice.logprobs.token_logprobs)
        self.assertEqual(streamed, lp.token_logprobs)

    def test_65_echo_of_token_ids(self):
        # What lm-evaluation-harness sends: lists of token ids, echo, logprobs 1 and
        # max_tokens 0. Each list's decoded text comes back with one entry per token (the
        # first null), the same whether the list is sent alone or beside another.
        ids = [504, 3458, 314, 4649, 30, 40, 2055, 281]
        other = [1, 2, 3, 4]
        alone = self.client.completions.create(
            model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=1)
        both = self.client.completions.create(
            model=MODEL, prompt=[other, ids], max_tokens=0, echo=True, logprobs=1)
        lp = alone.choices[0].logprobs
        self.assertEqual(len(lp.token_logprobs), len(ids))
        self.assertIsNone(lp.token_logprobs[0])
        self.assertTrue(all(x <= 0.0 for x in lp.token_logprobs[1:]))
        self.assertEqual("".join(lp.tokens), alone.choices[0].text)
        self.assertEqual(alone.usage.completion_tokens, 0)
        paired = [c for c in both.choices if c.text == alone.choices[0].text]
        self.assertEqual(len(paired), 1)
        self.assertEqual(paired[0].logprobs.token_logprobs, lp.token_logprobs)

    def test_66_embeddings(self):
        import struct

        def f32(values):
            return [struct.unpack("<f", struct.pack("<f", v))[0] for v in values]

        texts = ["a cat sat on the mat", "a dog sat", "The capital of France is Paris."]
        # The client asks for base64 by default and decodes it to floats.
        many = self.client.embeddings.create(model=MODEL, input=texts)
        self.assertEqual([d.index for d in many.data], [0, 1, 2])
        self.assertGreater(many.usage.prompt_tokens, 0)
        self.assertEqual(many.usage.total_tokens, many.usage.prompt_tokens)
        for text, item in zip(texts, many.data):
            one = self.client.embeddings.create(model=MODEL, input=text)
            # The same vector alone and in a batch, bit for bit.
            self.assertEqual(one.data[0].embedding, item.embedding)
            as_float = self.client.embeddings.create(
                model=MODEL, input=text, encoding_format="float")
            self.assertEqual(f32(as_float.data[0].embedding), item.embedding)
            self.assertAlmostEqual(math.sqrt(sum(x * x for x in item.embedding)), 1.0,
                                   places=5)
        self.assertNotEqual(many.data[0].embedding, many.data[1].embedding)
        short = self.client.embeddings.create(model=MODEL, input=texts[0], dimensions=16)
        self.assertEqual(len(short.data[0].embedding), 16)
        ids = self.client.embeddings.create(model=MODEL, input=[[504, 3458, 314]])
        self.assertEqual(len(ids.data[0].embedding), len(many.data[0].embedding))
        self.assertEqual(ids.usage.prompt_tokens, 3)
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.embeddings.create(model=MODEL, input="a", dimensions=100000)
        self.assertEqual(e.exception.param, "dimensions")
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.embeddings.create(model=ADAPTER, input="a")
        self.assertEqual(e.exception.param, "model")

    def test_7_seed_comes_back_and_reproduces(self):
        messages = [{"role": "user", "content": "Tell me a story."}]
        first = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=1.0)
        seed = first.model_extra["seed"]
        self.assertEqual(first.system_fingerprint, f"llama-burn-seed-{seed}")
        again = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=seed)
        self.assertEqual(again.choices[0].message.content, first.choices[0].message.content)
        self.assertEqual(again.model_extra["seed"], seed)

    def test_85_structured_outputs(self):
        from typing import List, Literal, Optional
        import pydantic

        class Pet(pydantic.BaseModel):
            kind: Literal["cat", "dog"]
            legs: int = pydantic.Field(ge=0, le=8)

        class Person(pydantic.BaseModel):
            name: str = pydantic.Field(max_length=12)
            age: int = pydantic.Field(ge=0, le=120)
            code: str = pydantic.Field(pattern=r"^[A-Z]{2}[0-9]{2}$")
            pets: List[Pet] = pydantic.Field(max_length=2)
            nickname: Optional[str] = pydantic.Field(default=None, max_length=8)

        messages = [{"role": "user", "content": "Describe a person as JSON."}]
        # parse(): nested objects in an array, enums, bounded numbers, an optional field
        # and a string pattern, through OpenAI's strict json_schema response_format.
        out = self.client.chat.completions.parse(
            model=MODEL, messages=messages, max_tokens=150, temperature=1.0, seed=4,
            response_format=Person)
        person = out.choices[0].message.parsed
        self.assertIsInstance(person, Person)
        Person.model_validate_json(out.choices[0].message.content)
        # The same streamed: the client reassembles the deltas and parses them.
        with self.client.chat.completions.stream(
                model=MODEL, messages=messages, max_tokens=150, temperature=1.0, seed=4,
                response_format=Person) as stream:
            final = stream.get_final_completion()
        self.assertEqual(final.choices[0].message.parsed, person)
        # vLLM's structured_outputs through extra_body: a choice and a regex.
        out = self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Pick a side."}],
            max_tokens=8, temperature=1.0,
            extra_body={"structured_outputs": {"choice": ["left", "right"]}})
        self.assertIn(out.choices[0].message.content, ["left", "right"])
        out = self.client.completions.create(
            model=MODEL, prompt="The year was", max_tokens=8, temperature=1.0,
            extra_body={"structured_outputs": {"regex": " [12][0-9]{3}"}})
        self.assertRegex(out.choices[0].text, r"^ [12][0-9]{3}$")
        # A schema that does not compile: a 400 naming response_format.
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "bad", "schema": {"type": "nonsense"}}})
        self.assertEqual(e.exception.param, "response_format")

    def test_86_tools_round_trip(self):
        from typing import Literal
        import pydantic

        class GetWeather(pydantic.BaseModel):
            city: str = pydantic.Field(max_length=20)
            unit: Literal["celsius", "fahrenheit"]

        tools = [openai.pydantic_function_tool(GetWeather, name="get_weather",
                                               description="The weather in a city")]
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        # tool_choice="required": tool_calls whose arguments validate, no content (one
        # call: with parallel calls this small model calls again and again).
        out = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=48, temperature=0, tools=tools,
            tool_choice="required", parallel_tool_calls=False)
        choice = out.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls")
        self.assertIsNone(choice.message.content)
        call = choice.message.tool_calls[0]
        self.assertEqual(call.function.name, "get_weather")
        GetWeather.model_validate_json(call.function.arguments)
        # A named function, through parse(): the client parses the arguments itself.
        parsed = self.client.chat.completions.parse(
            model=MODEL, messages=messages, max_tokens=48, temperature=0, tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        named = parsed.choices[0].message.tool_calls[0]
        self.assertIsInstance(named.function.parsed_arguments, GetWeather)
        # The same streamed: the client reassembles the deltas into the same call.
        with self.client.chat.completions.stream(
                model=MODEL, messages=messages, max_tokens=48, temperature=0, tools=tools,
                tool_choice="required", parallel_tool_calls=False) as stream:
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls[0]
        self.assertEqual(final.choices[0].finish_reason, "tool_calls")
        self.assertEqual(streamed.function.name, "get_weather")
        self.assertEqual(json.loads(streamed.function.arguments),
                         json.loads(call.function.arguments))
        # The result goes back as a tool message; the next answer is text.
        history = messages + [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.id, "type": "function",
                "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id,
             "content": json.dumps({"temperature": 21, "sky": "sunny"})},
        ]
        answer = self.client.chat.completions.create(
            model=MODEL, messages=history, max_tokens=24, temperature=0, tools=tools,
            tool_choice="none")
        self.assertTrue(answer.choices[0].message.content)
        self.assertFalse(answer.choices[0].message.tool_calls)
        pieces = []
        for chunk in self.client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=24, temperature=0, tools=tools,
                tool_choice="none", stream=True):
            for c in chunk.choices:
                self.assertFalse(c.delta.tool_calls)
                pieces.append(c.delta.content or "")
        self.assertEqual("".join(pieces), answer.choices[0].message.content)
        # A named function that is not among the tools: a 400 naming tool_choice.
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, tools=tools,
                tool_choice={"type": "function", "function": {"name": "nope"}})
        self.assertEqual(e.exception.param, "tool_choice")

    def test_87_responses(self):
        import pydantic

        # Text, whole and streamed alike (greedy); stored, retrieved, deleted.
        whole = self.client.responses.create(
            model=MODEL, input="Write a long story about a dragon.", max_output_tokens=12,
            temperature=0, instructions="You are a storyteller.")
        self.assertEqual(whole.status, "incomplete")
        self.assertEqual(whole.incomplete_details.reason, "max_output_tokens")
        self.assertTrue(whole.output_text)
        self.assertEqual(whole.usage.output_tokens, 12)
        with self.client.responses.stream(
                model=MODEL, input="Write a long story about a dragon.", max_output_tokens=12,
                temperature=0, instructions="You are a storyteller.") as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        self.assertEqual(final.output_text, whole.output_text)
        self.assertEqual(kinds[:2], ["response.created", "response.in_progress"])
        self.assertEqual(kinds[-1], "response.completed")
        self.assertEqual(final.status, "incomplete")
        self.assertIn("response.output_text.delta", kinds)
        self.assertEqual(final.usage.input_tokens_details.cached_tokens,
                         (final.usage.input_tokens - 1) // 16 * 16)
        got = self.client.responses.retrieve(whole.id)
        self.assertEqual((got.id, got.output_text), (whole.id, whole.output_text))
        self.client.responses.delete(whole.id)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(whole.id)

        # A function tool round trip through previous_response_id.
        schema = {"type": "object", "additionalProperties": False,
                  "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 20},
                                 "unit": {"type": "string",
                                          "enum": ["celsius", "fahrenheit"]}}}
        tools = [{"type": "function", "name": "get_weather", "strict": True,
                  "description": "The weather in a city", "parameters": schema}]
        first = self.client.responses.create(
            model=MODEL, input="What is the weather in Paris?", max_output_tokens=48,
            temperature=0, tools=tools, tool_choice="required", parallel_tool_calls=False)
        calls = [item for item in first.output if item.type == "function_call"]
        self.assertEqual(len(calls), 1)
        self.assertEqual(calls[0].name, "get_weather")
        self.assertEqual(set(json.loads(calls[0].arguments)), {"city", "unit"})
        second = self.client.responses.create(
            model=MODEL, previous_response_id=first.id, max_output_tokens=24,
            temperature=0, tools=tools, tool_choice="none",
            input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                    "output": json.dumps({"temperature": 21, "sky": "sunny"})}])
        self.assertTrue(second.output_text)
        self.assertEqual(second.previous_response_id, first.id)

        # text.format with a JSON Schema, parsed into a Pydantic model.
        class City(pydantic.BaseModel):
            name: str = pydantic.Field(max_length=12)
            population: int = pydantic.Field(ge=0, le=100000000)

        parsed = self.client.responses.parse(
            model=MODEL, input="Describe a city as JSON.", max_output_tokens=100,
            temperature=0, text_format=City)
        self.assertIsInstance(parsed.output_parsed, City)

        # Refusals by name; another response id: 404.
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.responses.create(model=MODEL, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "http://example.com/a.png"}]}])
        self.assertEqual(e.exception.param, "input[0].content[0].type")
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.create(
                model=MODEL, input="Hi", previous_response_id="resp_nope")

    def test_8_penalties_logit_bias_and_vllm_extensions(self):
        messages = [{"role": "user", "content": "List five fruits, one per line."}]
        greedy = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, temperature=0, logprobs=True)
        tokens = [e.token for e in greedy.choices[0].logprobs.content]
        # A +100 bias forces a token: 198 is the newline of the demo model's vocabulary.
        forced = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, temperature=1.0,
            logit_bias={"198": 100}, logprobs=True)
        forced_tokens = [e.token for e in forced.choices[0].logprobs.content]
        self.assertEqual(forced_tokens, ["\n"] * 5)
        # A -100 bias bans it: the greedy answer had newlines, the banned one has none.
        self.assertIn("\n", tokens)
        banned = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, temperature=0,
            logit_bias={"198": -100}, logprobs=True)
        self.assertNotIn("\n", [e.token for e in banned.choices[0].logprobs.content])
        # Penalties change a greedy answer and are accepted at their limits.
        penalized = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, temperature=0,
            frequency_penalty=2.0, presence_penalty=2.0)
        self.assertNotEqual(penalized.choices[0].message.content,
                            greedy.choices[0].message.content)
        # vLLM's extensions: top_k=1 and min_p=1 at temperature 1 are greedy.
        for extra in ({"top_k": 1}, {"min_p": 1.0}):
            out = self.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=30, temperature=1.0,
                extra_body=extra)
            self.assertEqual(out.choices[0].message.content,
                             greedy.choices[0].message.content, extra)
        # ignore_eos: exactly max_tokens tokens; min_tokens holds a forced stop token back;
        # stop_token_ids ends at the forced newline.
        out = self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
            temperature=0, extra_body={"ignore_eos": True, "repetition_penalty": 1.1})
        self.assertEqual(out.usage.completion_tokens, 40)
        self.assertEqual(out.choices[0].finish_reason, "length")
        out = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=0,
            logit_bias={"2": 100}, extra_body={"min_tokens": 4})
        self.assertEqual(out.usage.completion_tokens, 5)
        self.assertEqual(out.choices[0].finish_reason, "stop")
        out = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=0,
            logit_bias={"198": 100}, extra_body={"stop_token_ids": [198]})
        self.assertEqual(out.usage.completion_tokens, 1)
        # Out of range: a 400 naming the field.
        for kwargs, field in [
            ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
            ({"frequency_penalty": 2.5}, "frequency_penalty"),
            ({"presence_penalty": -2.5}, "presence_penalty"),
            ({"logit_bias": {"198": 150}}, "logit_bias"),
            ({"extra_body": {"top_k": -3}}, "top_k"),
            ({"extra_body": {"min_p": 2}}, "min_p"),
            ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
            ({"extra_body": {"min_tokens": 9}}, "min_tokens"),
            ({"extra_body": {"stop_token_ids": [10**9]}}, "stop_token_ids"),
        ]:
            with self.assertRaises(openai.BadRequestError, msg=field) as e:
                self.client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=4, **kwargs)
            self.assertEqual(e.exception.param, field)

    def test_9_sigterm_exits_zero(self):
        self.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.proc.wait(timeout=60), 0)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    BINARY = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
