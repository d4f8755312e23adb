"""Model output -> content, reasoning and tool calls, incrementally, for the HTTP APIs.

The gateway streams plain text; chat models put structure into it:

- reasoning between ``<think>`` and ``</think>`` at the start of the output (Qwen3, DeepSeek-R1 style),
  returned apart (OpenAI ``reasoning_content``, Anthropic ``thinking`` blocks);
- tool calls, in the formats the Qwen and Llama 3 chat templates ask for:
  - Qwen / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in the
    content, one block per call;
  - Llama 3.1+: the whole answer is JSON, ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
    optionally after ``<|python_tag|>``, several calls separated by ``;``.

:class:`OutputParser` takes text deltas as they arrive and returns :class:`Event` s. Text that could
still be the start of a marker is held back until it is settled (as stop strings are in TextStream),
so markers never leak into the content, and a tool call is emitted whole once its block closes.
Text that looked like a call but does not parse is passed on as content: nothing is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Event:
    kind: str  # "content" | "reasoning" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call_from(obj, id_prefix: str) -> ToolCall | None:
    """A tool call from a parsed JSON object in either format, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args, new_call_id(id_prefix))


def parse_json_calls(text: str, id_prefix: str = "call_") -> list[ToolCall] | None:
    """Llama 3 style: the whole text is one call object, a list of them, or calls separated by ``;``."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body:
        return None
    decoder = json.JSONDecoder()
    objects, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        objects.extend(obj if isinstance(obj, list) else [obj])
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    calls = [_call_from(o, id_prefix) for o in objects]
    return calls if calls and all(calls) else None


class OutputParser:
    """Splits streamed model text into content, reasoning and tool-call events.

    ``reasoning``: a ``<think>`` block at the start is reasoning. ``tools``: the request offered
    tools, so tool-call formats are looked for (without tools the text is all content).
    """

    def __init__(self, *, reasoning: bool = True, tools: bool = False, id_prefix: str = "call_") -> None:
        self.tools, self.id_prefix = tools, id_prefix
        self._state = "start" if reasoning else "after_reasoning"
        self._buf = ""  # text not passed on yet
        self._thought = False  # a think block was seen: the whitespace after it is dropped
        self._after_call = False  # a tool call just closed: the whitespace after it is dropped
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            before = (self._state, len(self._buf))
            step = getattr(self, "_" + self._state)(final)
            out.extend(e for e in step if e.text or e.call)
            if (self._state, len(self._buf)) == before:
                break
        if final and self._buf:  # whatever is left is content
            kind = "reasoning" if self._state == "reasoning" else "content"
            out.append(Event(kind, self._buf))
            self._buf = ""
        return _merge(out)

    # Each state consumes what it can of self._buf and may move to another state.

    def _start(self, final: bool) -> list[Event]:
        stripped = self._buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buf = stripped[len(THINK_OPEN) :]
            self._state = "reasoning"
            self._thought = True
        elif not final and THINK_OPEN.startswith(stripped):
            pass  # still could open a think block
        else:
            self._state = "after_reasoning"
        return []

    def _reasoning(self, final: bool) -> list[Event]:
        at = self._buf.find(THINK_CLOSE)
        if at >= 0:
            text, self._buf = self._buf[:at], self._buf[at + len(THINK_CLOSE) :].lstrip()
            self._state = "after_reasoning"
            return [Event("reasoning", text)]
        keep = 0 if final else _partial_suffix(self._buf, THINK_CLOSE)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return [Event("reasoning", text)]

    def _after_reasoning(self, final: bool) -> list[Event]:
        """The answer's start: a Llama-style JSON answer is held whole, anything else is content."""
        stripped = self._buf.lstrip()
        if self._thought:
            if not stripped and not final:
                return []  # only whitespace after the think block so far: wait
            self._buf = stripped
        if not self.tools:
            self._state = "content"
        elif stripped.startswith(("{", "[", PYTHON_TAG)):
            self._state = "json"
        elif stripped and not (not final and PYTHON_TAG.startswith(stripped)):
            self._state = "content"
        elif final:
            self._state = "content"
        elif stripped == "" and self._buf:
            pass  # only whitespace so far: wait
        return []

    def _json(self, final: bool) -> list[Event]:
        if not final:
            return []
        calls = parse_json_calls(self._buf, self.id_prefix)
        if calls is None:
            self._state = "content"
            return []
        self._buf = ""
        self._state = "content"
        self.calls.extend(calls)
        return [Event("tool_call", call=c) for c in calls]

    def _content(self, final: bool) -> list[Event]:
        if self._after_call:
            stripped = self._buf.lstrip()
            if not stripped and not final:
                return []
            self._buf, self._after_call = stripped, False
        if not self.tools:
            text, self._buf = self._buf, ""
            return [Event("content", text)]
        at = self._buf.find(CALL_OPEN)
        if at >= 0:
            text, self._buf = self._buf[:at], self._buf[at + len(CALL_OPEN) :]
            self._state = "call"
            return [Event("content", text)]
        keep = 0 if final else _partial_suffix(self._buf, CALL_OPEN)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return [Event("content", text)]

    def _call(self, final: bool) -> list[Event]:
        at = self._buf.find(CALL_CLOSE)
        if at < 0:
            if final:  # cut off (max_tokens): give the text back as it was
                self._buf = CALL_OPEN + self._buf
                self._state = "content_rest"
            return []
        body, rest = self._buf[:at], self._buf[at + len(CALL_CLOSE) :]
        try:
            call = _call_from(json.loads(body), self.id_prefix)
        except ValueError:
            call = None
        if call is None:
            self._buf = rest
            self._state = "content"
            return [Event("content", CALL_OPEN + body + CALL_CLOSE)]
        self.calls.append(call)
        self._buf = rest
        self._after_call = True
        self._state = "content"
        return [Event("tool_call", call=call)]

    def _content_rest(self, final: bool) -> list[Event]:
        text, self._buf = self._buf, ""
        return [Event("content", text)]


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent text events of one kind joined."""
    out: list[Event] = []
    for e in events:
        if out and e.kind == out[-1].kind and e.kind != "tool_call":
            out[-1] = Event(e.kind, out[-1].text + e.text)
        else:
            out.append(e)
    return out


def parse_output(text: str, *, reasoning: bool = True, tools: bool = False, id_prefix: str = "call_") -> tuple[str, str, list[ToolCall]]:
    """Whole-text form: (content, reasoning, tool calls)."""
    parser = OutputParser(reasoning=reasoning, tools=tools, id_prefix=id_prefix)
    events = parser.push(text) + parser.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    thought = "".join(e.text for e in events if e.kind == "reasoning")
    return content, thought, [e.call for e in events if e.call is not None]
