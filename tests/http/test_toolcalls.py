"""Model output -> content, reasoning and tool calls: streamed in any split equals parsed whole."""

from __future__ import annotations

import random

import pytest

from services.gateway.http.toolcalls import OutputParser, parse_output

CASES = [
    ("hello world", True, ("hello world", "", [])),
    ("hello world", False, ("hello world", "", [])),
    ("<think>hmm</think>\n\nThe answer", True, ("The answer", "hmm", [])),
    ("<think>hmm</think>\n\nThe answer", False, ("The answer", "hmm", [])),
    ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', True,
     ("Sure. ", "", [("get_weather", {"city": "Paris"})])),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>', True,
     ("", "", [("a", {}), ("b", {"x": 1})])),
    ('<think>plan</think><tool_call>{"name": "a", "arguments": {}}</tool_call>', True, ("", "plan", [("a", {})])),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', True, ("", "", [("get_weather", {"city": "Paris"})])),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}', True, ("", "", [("f", {}), ("g", {})])),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', False, ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [])),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>', False, ('<tool_call>{"name": "a", "arguments": {}}</tool_call>', "", [])),
    ("{not json", True, ("{not json", "", [])),
    ('{"a": 1}', True, ('{"a": 1}', "", [])),
    ("x <tool_call>{bad}</tool_call> y", True, ("x <tool_call>{bad}</tool_call> y", "", [])),
    ('x <tool_call>{"name": "f"', True, ('x <tool_call>{"name": "f"', "", [])),  # cut off by max_tokens
    ("a < b <tool", True, ("a < b <tool", "", [])),
    ("<thi", True, ("<thi", "", [])),
    ("<think>abc", True, ("", "abc", [])),
]


@pytest.mark.parametrize("text,tools,expected", CASES)
def test_whole_and_streamed_agree(text, tools, expected):
    content, reasoning, calls = parse_output(text, tools=tools)
    assert (content, reasoning, [(c.name, c.arguments) for c in calls]) == expected
    rng = random.Random(0)
    for _ in range(50):
        parser, events, i = OutputParser(tools=tools), [], 0
        while i < len(text):
            n = rng.randint(1, 5)
            events += parser.push(text[i : i + n])
            i += n
        events += parser.finish()
        got = (
            "".join(e.text for e in events if e.kind == "content"),
            "".join(e.text for e in events if e.kind == "reasoning"),
            [(e.call.name, e.call.arguments) for e in events if e.call],
        )
        assert got == expected


def test_markers_never_leak_into_streamed_content():
    parser = OutputParser(tools=True)
    seen = []
    for ch in 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>':
        seen += [e.text for e in parser.push(ch) if e.kind == "content"]
    assert "".join(seen) == "ok " and all("<" not in s for s in seen)
