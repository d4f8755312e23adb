"""The Anthropic Messages API: /v1/messages JSON <-> the gateway's request and stream."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from services.gateway.http import fields as f
from services.gateway.http.toolcalls import OutputParser
from services.gateway.server import ChatInput
from splitspec.errors import InvalidArgument
from splitspec.v1 import gateway_pb2


@dataclass
class MessagesCall:
    model: str
    stream: bool
    tools: bool
    stop_sequences: list[str]
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content: must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidArgument(f"{where}.content[{j}]: must be a content block object with a type")
    return content


def _text(blocks: list[dict], where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise InvalidArgument(f"{where}.content[{j}]: only text blocks are supported here, not {block['type']!r}")
        texts.append(block["text"])
    return "".join(texts)


def _system(system) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return _text(_blocks(system, "system"), "system")


def chat_messages(body: dict) -> list[dict]:
    """Anthropic messages -> chat-template messages: ``tool_use`` blocks become the assistant's
    ``tool_calls``, ``tool_result`` blocks become ``tool`` turns."""
    messages = f.get_list(body, "messages")
    if not messages:
        raise InvalidArgument("messages: must not be empty")
    out = []
    system = _system(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise InvalidArgument(f"{where}.role: must be user or assistant")
        blocks = _blocks(m.get("content"), where)
        text, calls = [], []
        for j, block in enumerate(blocks):
            kind = block["type"]
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "thinking":
                continue  # earlier reasoning is not sent back to the model
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise InvalidArgument(f"{where}.content[{j}]: a tool_use block needs name and an input object")
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": {"name": block["name"], "arguments": block.get("input", {})}})
            elif kind == "tool_result" and m["role"] == "user":
                result = block.get("content", "")
                result_text = result if isinstance(result, str) else _text(_blocks(result, f"{where}.content[{j}]"), f"{where}.content[{j}]")
                out.append({"role": "tool", "content": result_text, "tool_call_id": str(block.get("tool_use_id", ""))})
            else:
                raise InvalidArgument(f"{where}.content[{j}]: {kind!r} blocks are not supported in a {m['role']} message")
        if text or calls or not any(b["type"] == "tool_result" for b in blocks):
            msg = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def chat_tools(body: dict) -> list[dict] | None:
    tools = f.get_list(body, "tools", None)
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind not in (None, "auto", "none"):
        raise InvalidArgument("tool_choice.type: only auto and none are supported (a required or named tool cannot be forced yet)")
    if not tools or kind == "none":
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidArgument(f"tools[{i}].name: required")
        fn = {"name": tool["name"], "description": tool.get("description", ""), "parameters": tool.get("input_schema", {"type": "object"})}
        out.append({"type": "function", "function": fn})
    return out


def messages_request(body: dict, count_only: bool = False) -> tuple[gateway_pb2.GenerateRequest, ChatInput, MessagesCall]:
    f.get_str(body, "model")
    req = gateway_pb2.GenerateRequest()
    messages = chat_messages(body)
    tools = chat_tools(body)
    req.messages.messages.extend(gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    if not count_only:
        max_tokens = f.get_int(body, "max_tokens", None, low=1)
        if max_tokens is None:
            raise InvalidArgument("max_tokens: required")
        req.max_tokens = max_tokens
        f.sampling(req, body)
        stop_sequences = f.stops(req, body, "stop_sequences")
        f.speculation(req, body)
    else:
        stop_sequences = []
    call = MessagesCall(body["model"], f.get_bool(body, "stream"), tools is not None, stop_sequences)
    return req, ChatInput(messages, tools), call


def _stop(call: MessagesCall, final: gateway_pb2.Final, tool_use: bool) -> tuple[str, str | None]:
    if tool_use:
        return "tool_use", None
    reason = final.finish_reason
    if reason in (gateway_pb2.LENGTH, gateway_pb2.CONTEXT):
        return "max_tokens", None
    if reason == gateway_pb2.STOP and call.stop_sequences:
        # The gateway does not say which stop string matched; name it when there is only one.
        return "stop_sequence", call.stop_sequences[0] if len(call.stop_sequences) == 1 else None
    return "end_turn", None


def _usage(final: gateway_pb2.Final) -> dict:
    u = final.usage
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens, "mean_acceptance_length": round(u.mean_acceptance_length, 4)}


def message_response(call: MessagesCall, text: str, final: gateway_pb2.Final) -> dict:
    parser = OutputParser(tools=call.tools, id_prefix="toolu_")
    events = parser.push(text) + parser.finish()
    content = []
    for e in events:
        if e.kind == "reasoning":
            content.append({"type": "thinking", "thinking": e.text, "signature": ""})
        elif e.kind == "content":
            content.append({"type": "text", "text": e.text})
        else:
            content.append({"type": "tool_use", "id": e.call.id, "name": e.call.name, "input": e.call.arguments})
    stop_reason, stop_sequence = _stop(call, final, bool(parser.calls))
    return {
        "id": call.id, "type": "message", "role": "assistant", "model": call.model, "content": content,
        "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(final),
    }


class MessageEvents:
    """Streamed messages: text deltas in, Anthropic's SSE events (name, data) out."""

    def __init__(self, call: MessagesCall) -> None:
        self.call = call
        self.parser = OutputParser(tools=call.tools, id_prefix="toolu_")
        self.index = -1
        self.open: str | None = None  # kind of the open content block
        self.tool_use = False

    def start(self) -> list[tuple[str, dict]]:
        message = {
            "id": self.call.id, "type": "message", "role": "assistant", "model": self.call.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}))
        return out

    def _events(self, events) -> list[tuple[str, dict]]:
        out = []
        for e in events:
            if e.kind == "tool_call":
                self.tool_use = True
                out += self._open("tool_use", {"type": "tool_use", "id": e.call.id, "name": e.call.name, "input": {}})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(e.call.arguments, ensure_ascii=False)}
                out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
                out += self._close()
                continue
            if e.kind == "reasoning":
                if self.open != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                delta = {"type": "thinking_delta", "thinking": e.text}
            else:
                if self.open != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": e.text}
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return out

    def text(self, text: str) -> list[tuple[str, dict]]:
        return self._events(self.parser.push(text))

    def end(self, final: gateway_pb2.Final) -> list[tuple[str, dict]]:
        out = self._events(self.parser.finish()) + self._close()
        stop_reason, stop_sequence = _stop(self.call, final, self.tool_use)
        out.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": _usage(final)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out
