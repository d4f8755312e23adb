"""The tool-call round trip through the official clients, against a tiny target trained (in the test,
seconds on the CPU) to answer a fixed chat with a tool call and the tool's result with a sentence."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.client import worker_state
from tests.http.conftest import TOKEN
from tests.http.tool_model import ANSWER, CALL_ARGUMENTS, QUESTION, RESULT, TOOLS, train_tool_pair
from tests.tools import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(module_services, tmp_path_factory):
    target_model, draft_model = train_tool_pair(tmp_path_factory.mktemp("tool-model"))
    s = module_services
    target = s.start("target", "target", "--model", str(target_model))
    draft = s.start("draft", "draft", "--model", str(draft_model), "--target-model", str(target_model))
    port = free_port()
    s.start("gateway", "gateway", "--target", target, "--draft", draft, "--http-listen", f"127.0.0.1:{port}", "--auth-token", TOKEN)
    yield {"url": f"http://127.0.0.1:{port}", "target": target, "draft": draft}


def test_openai_tool_call_round_trip(gateway):
    client = openai.OpenAI(base_url=gateway["url"] + "/v1", api_key=TOKEN, max_retries=0)
    first = client.chat.completions.create(model="target", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=160)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGUMENTS
    assert not choice.message.content

    # Streamed: the same call as one tool_calls delta, and the finish reason.
    chunks = list(client.chat.completions.create(model="target", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=160, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "get_weather", CALL_ARGUMENTS)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # The tool's result sent back: the model answers from it.
    messages = [*QUESTION, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = client.chat.completions.create(model="target", messages=messages, tools=TOOLS, temperature=0, max_tokens=160)
    assert second.choices[0].message.content == ANSWER
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert worker_state(gateway["target"], gateway["draft"]).empty


def test_anthropic_tool_use_round_trip(gateway):
    client = anthropic.Anthropic(base_url=gateway["url"], api_key=TOKEN, max_retries=0)
    fn = TOOLS[0]["function"]
    tools = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    first = client.messages.create(model="target", messages=QUESTION, tools=tools, max_tokens=160, extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == CALL_ARGUMENTS

    with client.messages.stream(model="target", messages=QUESTION, tools=tools, max_tokens=160, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == [CALL_ARGUMENTS]

    messages = [*QUESTION, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    second = client.messages.create(model="target", messages=messages, tools=tools, max_tokens=160, extra_body={"temperature": 0})
    assert second.stop_reason == "end_turn"
    assert "".join(b.text for b in second.content if b.type == "text") == ANSWER
