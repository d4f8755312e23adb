"""The gateway's HTTP API through the official ``openai`` and ``anthropic`` packages, unmodified,
against the real three services: outputs equal Generate's for the same request."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import openai
import pytest

from splitspec.v1 import gateway_pb2
from tests.client import generate, worker_state
from tests.http.conftest import TOKEN, httpx

pytestmark = pytest.mark.slow
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def fib(n):"}]


def oai(gw, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw["url"] + "/v1", api_key=TOKEN, max_retries=0, **kw)


def anth(gw, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw["url"], api_key=TOKEN, max_retries=0, **kw)


def grpc_chat(gw, messages, **fields):
    msgs = gateway_pb2.Messages(messages=[gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    return generate(gw["grpc"], metadata=AUTH, messages=msgs, **fields)


def test_models_and_health(http_gateway):
    gw = http_gateway
    models = oai(gw).models.list()
    assert [m.id for m in models.data] == [gw["model"]]
    assert models.data[0].model_extra["context_length"] > 0
    assert oai(gw).models.retrieve(gw["model"]).id == gw["model"]
    health = httpx.get(gw["url"] + "/health")  # no token needed
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize("mode", ["ddtree", "chain", "off"])
def test_chat_equals_generate(http_gateway, mode):
    gw = http_gateway
    sampling = dict(max_tokens=24, temperature=0.8, seed=7)
    expected = grpc_chat(gw, MESSAGES, speculation=gateway_pb2.Speculation(mode=gateway_pb2.Speculation.Mode.Value(mode.upper()), budget=8), **sampling)
    reply = oai(gw).chat.completions.create(model=gw["model"], messages=MESSAGES, extra_body={"speculation": {"mode": mode, "budget": 8}}, **sampling)
    choice = reply.choices[0]
    assert (choice.message.content or "") == expected.text
    assert reply.usage.prompt_tokens == expected.final.usage.prompt_tokens
    assert reply.usage.completion_tokens == expected.final.usage.completion_tokens
    assert reply.usage.model_extra["mean_acceptance_length"] == pytest.approx(expected.final.usage.mean_acceptance_length, abs=1e-3)
    assert choice.finish_reason == ("length" if expected.final.finish_reason == gateway_pb2.LENGTH else "stop")

    # Streaming: the same text, usage in the last chunk.
    stream = oai(gw).chat.completions.create(
        model=gw["model"], messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        extra_body={"speculation": {"mode": mode, "budget": 8}}, **sampling,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[-1].usage.completion_tokens == expected.final.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [choice.finish_reason]


def test_completions_equal_generate(http_gateway):
    gw = http_gateway
    expected = generate(gw["grpc"], metadata=AUTH, text="import os\n", max_tokens=20, temperature=0.0)
    reply = oai(gw).completions.create(model=gw["model"], prompt="import os\n", max_tokens=20, temperature=0.0)
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == expected.final.usage.prompt_tokens
    streamed = "".join(c.choices[0].text for c in oai(gw).completions.create(
        model=gw["model"], prompt="import os\n", max_tokens=20, temperature=0.0, stream=True) if c.choices)
    assert streamed == expected.text


@pytest.mark.parametrize("mode", ["ddtree", "off"])
def test_chat_logprobs(http_gateway, mode):
    gw = http_gateway
    kw = dict(model=gw["model"], messages=MESSAGES, max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3,
              extra_body={"speculation": {"mode": mode, "budget": 8}})
    reply = oai(gw).chat.completions.create(**kw)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens > 0
    expected = grpc_chat(gw, MESSAGES, max_tokens=12, temperature=0.0)
    assert [lp.token for lp in content] == [tokenizer_text(gw, t) for t in expected.tokens]
    for lp in content:
        assert lp.logprob <= 0.0 and lp.bytes == list(lp.token.encode("utf-8"))
        assert len(lp.top_logprobs) == 3
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob, abs=1e-6)  # greedy: the chosen token is the most likely
    # Streamed: the same logprobs, spread over the chunks.
    stream = oai(gw).chat.completions.create(stream=True, **kw)
    streamed = [lp for c in stream if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in content]
    # Off by default.
    assert oai(gw).chat.completions.create(model=gw["model"], messages=MESSAGES, max_tokens=4).choices[0].logprobs is None


def tokenizer_text(gw, token_id: int) -> str:
    from splitspec.text.tokenizer import Tokenizer

    if "tokenizer" not in gw:
        gw["tokenizer"] = Tokenizer.load(worker_info_path(gw))
    return gw["tokenizer"].decode([token_id], skip_special_tokens=False)


def worker_info_path(gw) -> str:
    import grpc

    from splitspec.v1 import common_pb2, target_pb2_grpc

    with grpc.insecure_channel(gw["target"]) as ch:
        return target_pb2_grpc.TargetWorkerStub(ch).Info(common_pb2.InfoRequest(), timeout=10).tokenizer_path


def test_completion_logprobs(http_gateway):
    gw = http_gateway
    kw = dict(model=gw["model"], prompt="import os\n", max_tokens=10, temperature=0.0, logprobs=2)
    reply = oai(gw).completions.create(**kw)
    lp = reply.choices[0].logprobs
    n = reply.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n > 0
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-6) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    chunks = [c.choices[0].logprobs for c in oai(gw).completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset
    with pytest.raises(openai.BadRequestError) as info:
        oai(gw).completions.create(**{**kw, "logprobs": 6})
    assert info.value.body["param"] == "logprobs"


def test_anthropic_messages_equal_generate(http_gateway):
    gw = http_gateway
    expected = grpc_chat(gw, MESSAGES, max_tokens=24, temperature=0.5, top_k=20, seed=11)
    # This anthropic release has no sampling arguments of its own; the API's fields go in extra_body.
    kw = dict(model=gw["model"], system=MESSAGES[0]["content"], messages=MESSAGES[1:], max_tokens=24,
              extra_body={"temperature": 0.5, "top_k": 20, "seed": 11})
    message = anth(gw).messages.create(**kw)
    assert "".join(b.text for b in message.content if b.type == "text") == expected.text
    assert message.usage.input_tokens == expected.final.usage.prompt_tokens
    assert message.usage.output_tokens == expected.final.usage.completion_tokens
    assert message.stop_reason == ("max_tokens" if expected.final.finish_reason == gateway_pb2.LENGTH else "end_turn")
    with anth(gw).messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected.text
    assert final.usage.output_tokens == expected.final.usage.completion_tokens
    count = anth(gw).messages.count_tokens(model=gw["model"], system=MESSAGES[0]["content"], messages=MESSAGES[1:])
    assert count.input_tokens == expected.final.usage.prompt_tokens


def test_auth(http_gateway):
    gw = http_gateway
    for client in (openai.OpenAI(base_url=gw["url"] + "/v1", api_key="wrong", max_retries=0),):
        with pytest.raises(openai.AuthenticationError) as info:
            client.models.list()
        assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gw["url"], api_key="wrong", max_retries=0).messages.create(
            model=gw["model"], max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert httpx.post(gw["url"] + "/v1/chat/completions", json={}).status_code == 401


def test_errors_name_the_field(http_gateway):
    gw = http_gateway
    client = oai(gw)
    cases = [
        (dict(n=2), "n", openai.BadRequestError),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs", openai.BadRequestError),
        (dict(top_logprobs=2), "top_logprobs", openai.BadRequestError),  # without logprobs
        (dict(logprobs="yes"), "logprobs", openai.BadRequestError),
        (dict(max_tokens=10**6), "max_tokens", openai.BadRequestError),
        (dict(temperature=-1), "temperature", openai.BadRequestError),
        (dict(extra_body={"speculation": {"mode": "fast"}}), "speculation.mode", openai.BadRequestError),
        (dict(extra_body={"speculation": {"budget": 100000}}), "speculation.budget", openai.BadRequestError),
        (dict(extra_body={"speculation": {"scores": "viterbi"}}), "speculation.scores", openai.BadRequestError),
        (dict(model="gpt-4o"), "model", openai.NotFoundError),
    ]
    for fields, param, error in cases:
        kw = {"model": gw["model"], "messages": MESSAGES, "max_tokens": 4, **fields}
        with pytest.raises(error) as info:
            client.chat.completions.create(**kw)
        assert info.value.body["param"] == param, (fields, info.value.body)
        assert "Traceback" not in info.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as ainfo:
        anth(gw).messages.create(model=gw["model"], max_tokens=4, messages=[{"role": "system", "content": "x"}])
    assert ainfo.value.body["error"]["type"] == "invalid_request_error" and "messages[0].role" in ainfo.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        anth(gw).messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    big = httpx.post(gw["url"] + "/v1/chat/completions", headers={"authorization": f"Bearer {TOKEN}"},
                     content=b'{"model": "target", "messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}')
    assert big.status_code == 413 and big.json()["error"]["message"]


BAD_BODIES = [
    b"", b"not json", b"[]", b"null", b'{"model": 1}', b'{"model": "target"}', b'{"model": "target", "messages": "hi"}',
    b'{"model": "target", "messages": [{"role": "wizard", "content": "x"}]}',
    b'{"model": "target", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"model": "target", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
    b'{"model": "target", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    b'{"model": "target", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
    b'{"model": "target", "messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}',
    b'{"model": "target", "messages": [{"role": "user", "content": "x"}], "seed": -1e30}',
    b'{"model": "target", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
    b'{"model": "target", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": []}',
    b'{"model": "target", "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]}',
    b'{"model": "target", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    b'{"model": "target", "prompt": [99999999999]}', b'{"model": "target", "prompt": {"a": 1}}',
]


def test_bad_bodies_are_4xx_json(http_gateway):
    gw = http_gateway
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        for body in BAD_BODIES:
            r = httpx.post(gw["url"] + path, content=body, headers=headers, timeout=60)
            if r.status_code == 200:
                continue  # a body valid for this endpoint
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            error = r.json()["error"]
            assert error["message"] and "Traceback" not in error["message"], (path, body, r.text)
    assert httpx.get(gw["url"] + "/v1/nope", headers=headers).status_code == 404
    for name in ("target", "draft", "gateway"):
        assert gw["services"].procs[name].poll() is None


def test_disconnect_mid_stream_releases_the_sequence(http_gateway):
    gw = http_gateway
    body = {"model": gw["model"], "messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True,
            "extra_body": None}
    body.pop("extra_body")
    headers = {"authorization": f"Bearer {TOKEN}"}
    for _ in range(3):
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", gw["url"] + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: ") for line in got)
                assert worker_state(gw["target"], gw["draft"]).target_sequences >= 1
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while not worker_state(gw["target"], gw["draft"]).empty:
        assert time.monotonic() < deadline, worker_state(gw["target"], gw["draft"])
        time.sleep(0.1)


def test_concurrent_streams_equal_single_stream(http_gateway):
    gw = http_gateway
    client = oai(gw, timeout=300)

    def run(i: int) -> str:
        stream = client.chat.completions.create(
            model=gw["model"], messages=[{"role": "user", "content": f"item {i}:"}], max_tokens=12, temperature=0.9, seed=i, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    alone = {i: run(i) for i in range(4)}
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = run(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(results) == 32
    for i in range(4):
        assert results[i] == alone[i]
    singles = {i: run(i) for i in range(4, 32)}
    for i, text in singles.items():
        assert results[i] == text, i
    assert worker_state(gw["target"], gw["draft"]).empty


def test_tool_round_trip_renders_through_the_template(http_gateway):
    """Tools and tool results reach the chat template: the prompt grows by what the template writes."""
    gw = http_gateway
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    base = anth(gw).messages.count_tokens(model=gw["model"], messages=[{"role": "user", "content": "Weather in Paris?"}]).input_tokens
    with_tools = anth(gw).messages.count_tokens(
        model=gw["model"], messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"name": "get_weather", "description": "Weather of a city", "input_schema": tools[0]["function"]["parameters"]}],
    ).input_tokens
    assert with_tools > base + len(json.dumps(tools[0]["function"]["parameters"])) // 4
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    reply = oai(gw).chat.completions.create(model=gw["model"], messages=messages, tools=tools, max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens > with_tools  # the call and its result are in the prompt
