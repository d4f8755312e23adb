"""The OpenAI API: /v1/chat/completions and /v1/completions JSON <-> the gateway's request and stream."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.gateway.http import fields as f
from services.gateway.http.toolcalls import OutputParser, ToolCall
from services.gateway.server import ChatInput
from splitspec.errors import InvalidArgument
from splitspec.v1 import common_pb2, gateway_pb2

FINISH = {gateway_pb2.LENGTH: "length", gateway_pb2.CONTEXT: "length", gateway_pb2.STOP: "stop", gateway_pb2.EOS: "stop"}
JSON_OBJECT_INSTRUCTION = "Respond with a single valid JSON object and nothing else."
MAX_ID = 2**31 - 1
MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5  # OpenAI's limits: chat top_logprobs, completions logprobs


@dataclass
class ChatCall:
    """What the response needs to know about the request."""

    model: str
    stream: bool
    include_usage: bool
    tools: bool
    logprobs: bool = False  # the response carries the target's logprobs (GenerateResponse.logprobs)
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _unsupported(body: dict) -> None:
    f.refuse(body, "n", 1, "only n = 1 is supported")
    f.refuse(body, "best_of", 1, "only best_of = 1 is supported")
    f.refuse(body, "echo", None, "echo is not supported")
    f.refuse(body, "suffix", None, "suffix is not supported")
    f.refuse(body, "logit_bias", None, "logit_bias is not supported")
    f.refuse(body, "frequency_penalty", None, "frequency_penalty is not supported (use 0)")
    f.refuse(body, "presence_penalty", None, "presence_penalty is not supported (use 0)")


def _max_tokens(req: gateway_pb2.GenerateRequest, body: dict, *names: str) -> None:
    """0 (absent) lets the gateway fill the context, as the OpenAI API does."""
    for name in names:
        value = f.get_int(body, name, None, low=1)
        if value is not None:
            req.max_tokens = value
            return


def _text_of(content, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content: must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidArgument(f"{where}.content[{j}]: only text parts are supported, not {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _arguments(value, where: str) -> dict:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except ValueError:
            raise InvalidArgument(f"{where}: not valid JSON") from None
        if isinstance(parsed, dict):
            return parsed
    raise InvalidArgument(f"{where}: must be a JSON object (or a string holding one)")


def chat_messages(messages, response_format) -> list[dict]:
    """OpenAI messages -> chat-template messages (Hugging Face's convention: ``tool_calls`` with
    ``function.arguments`` as an object, ``tool`` turns with ``tool_call_id``)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidArgument(f"{where}: must be an object")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise InvalidArgument(f"{where}.role: {role!r} is not one of system, developer, user, assistant, tool")
        msg = {"role": role, "content": _text_of(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidArgument(f"{where}.tool_calls: must be a list")
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidArgument(f"{where}.tool_calls[{j}].function.name: required")
                args = _arguments(fn.get("arguments", {}), f"{where}.tool_calls[{j}].function.arguments")
                msg["tool_calls"].append({"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}})
        if role == "tool":
            msg["tool_call_id"] = f.get_str(m, "tool_call_id", "", where=where + ".")
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    instruction = _format_instruction(response_format)
    if instruction:
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + instruction).strip()}
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return out


def _format_instruction(response_format) -> str:
    """``response_format`` as an instruction to the model (no constrained decoding yet)."""
    if response_format is None:
        return ""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return ""
    if kind == "json_object":
        return JSON_OBJECT_INSTRUCTION
    if kind == "json_schema":
        schema = response_format.get("json_schema", {})
        return f"{JSON_OBJECT_INSTRUCTION} It must follow this JSON schema: {json.dumps(schema.get('schema', schema), ensure_ascii=False)}"
    raise InvalidArgument("response_format.type: must be text, json_object or json_schema")


def chat_tools(body: dict) -> list[dict] | None:
    """``tools`` as the chat template gets them, or None: none given, or ``tool_choice`` none."""
    tools = f.get_list(body, "tools", None)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise InvalidArgument("tool_choice: only auto and none are supported (a required or named tool cannot be forced yet)")
    if not tools or choice == "none":
        return None
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidArgument(f"tools[{i}]: must be {{type: function, function: {{name, description, parameters}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument(f"tools[{i}].function.name: required")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")}})
    return out


def chat_request(body: dict) -> tuple[gateway_pb2.GenerateRequest, ChatInput, ChatCall]:
    f.get_str(body, "model")
    _unsupported(body)
    req = gateway_pb2.GenerateRequest()
    messages = chat_messages(body.get("messages"), body.get("response_format"))
    tools = chat_tools(body)
    # The gateway's messages field carries role and text (what it checks and counts); the chat input
    # carries the whole structure (tool calls and results, tools) for the chat template.
    req.messages.messages.extend(gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    _max_tokens(req, body, "max_completion_tokens", "max_tokens")
    f.sampling(req, body)
    f.stops(req, body, "stop")
    f.speculation(req, body)
    req.logprobs = f.get_bool(body, "logprobs")
    req.top_logprobs = f.get_int(body, "top_logprobs", 0, high=MAX_TOP_LOGPROBS)
    if req.top_logprobs and not req.logprobs:
        raise InvalidArgument("top_logprobs: needs logprobs: true")
    call = ChatCall(body["model"], *_streaming(body), tools is not None, req.logprobs)
    return req, ChatInput(messages, tools, fill_context=True), call


def completion_request(body: dict) -> tuple[gateway_pb2.GenerateRequest, ChatCall]:
    f.get_str(body, "model")
    _unsupported(body)
    req = gateway_pb2.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(-MAX_ID <= t <= MAX_ID for t in prompt):
            raise InvalidArgument("prompt: token ids must be 32-bit integers")
        req.tokens.ids.extend(prompt)
    else:
        raise InvalidArgument("prompt: must be a string, a list of token ids, or a list of one of those (one prompt per request)")
    req.max_tokens = f.get_int(body, "max_tokens", 16, low=1)  # the Completions API's default
    f.sampling(req, body)
    f.stops(req, body, "stop")
    f.speculation(req, body)
    f.refuse(body, "top_logprobs", None, "not a Completions field (logprobs: N asks for the top N)")
    logprobs = f.get_int(body, "logprobs", None, high=MAX_COMPLETION_LOGPROBS)
    if logprobs is not None:
        req.logprobs, req.top_logprobs = True, logprobs
    call = ChatCall(body["model"], *_streaming(body), False, req.logprobs, id="cmpl-" + uuid.uuid4().hex)
    return req, call


def _streaming(body: dict) -> tuple[bool, bool]:
    """(``stream``, ``stream_options.include_usage``) of a request."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options: must be an object")
    return f.get_bool(body, "stream"), f.get_bool(options, "include_usage")


def usage(final: gateway_pb2.Final) -> dict:
    u = final.usage
    return {
        "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens,
        "mean_acceptance_length": round(u.mean_acceptance_length, 4), "steps": u.steps, "draft_fallbacks": u.draft_fallbacks,
    }


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    if index is not None:
        out = {"index": index, **out}
    return out


TokenText = Callable[[int], str]  # a token id's text (its decoded string, special tokens spelled out)


def _logprob(value: float) -> float:
    """A logprob as JSON can carry it: -inf (a token of probability 0) as OpenAI's -9999.0."""
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(logprobs: Sequence[common_pb2.TokenLogprob], token_text: TokenText) -> dict:
    """``choices[].logprobs`` of a chat completion (or of one chunk): ``{content: [...]}``."""

    def entry(token_id: int, value: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.id, lp.logprob), "top_logprobs": [entry(t.id, t.logprob) for t in lp.top]} for lp in logprobs
        ],
        "refusal": None,
    }


def _top_dict(top: Sequence[common_pb2.TopLogprob], token_text: TokenText) -> dict:
    """Alternatives as the Completions API's text -> logprob dict. Tokens whose texts coincide (byte
    tokens of partial characters all read U+FFFD) keep the most likely one's logprob."""
    out: dict = {}
    for t in top:
        out.setdefault(token_text(t.id), _logprob(t.logprob))
    return out


def completion_logprobs(logprobs: Sequence[common_pb2.TokenLogprob], token_text: TokenText, offset: int = 0) -> dict:
    """``choices[].logprobs`` of a completion (or of one chunk): tokens, token_logprobs, top_logprobs
    (one dict per token, text -> logprob) and text_offset (each token's start in the completion text,
    counting from ``offset``)."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(offset)
        tokens.append(token_text(lp.id))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(lp.logprob) for lp in logprobs],
        "top_logprobs": [_top_dict(lp.top, token_text) for lp in logprobs],
        "text_offset": offsets,
    }


def chat_response(
    call: ChatCall, text: str, final: gateway_pb2.Final, logprobs: Sequence = (), token_text: TokenText | None = None
) -> dict:
    parser = OutputParser(tools=call.tools)
    events = parser.push(text) + parser.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    message = {"role": "assistant", "content": content if content or not parser.calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if parser.calls:
        message["tool_calls"] = [tool_call_json(c) for c in parser.calls]
    finish = "tool_calls" if parser.calls else FINISH.get(final.finish_reason, "stop")
    return {
        "id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
                     "logprobs": chat_logprobs(logprobs, token_text) if call.logprobs else None}],
        "usage": usage(final),
    }


class ChatChunks:
    """Streamed chat: text deltas in, ``chat.completion.chunk`` objects out."""

    def __init__(self, call: ChatCall, token_text: TokenText | None = None) -> None:
        self.call, self.token_text = call, token_text
        self.parser = OutputParser(tools=call.tools)
        self.num_calls = 0

    def _chunk(self, delta: dict, finish: str | None = None) -> dict:
        return {
            "id": self.call.id, "object": "chat.completion.chunk", "created": self.call.created, "model": self.call.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    def start(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _events(self, events) -> list[dict]:
        out = []
        for e in events:
            if e.kind == "content":
                out.append(self._chunk({"content": e.text}))
            elif e.kind == "reasoning":
                out.append(self._chunk({"reasoning_content": e.text}))
            else:
                out.append(self._chunk({"tool_calls": [tool_call_json(e.call, self.num_calls)]}))
                self.num_calls += 1
        return out

    def text(self, text: str, logprobs: Sequence = ()) -> list[dict]:
        """The chunks of a text delta; with logprobs on, the delta's tokens' logprobs ride on its last
        chunk (on a chunk of their own, with an empty delta, when the text produced none yet)."""
        out = self._events(self.parser.push(text))
        if self.call.logprobs and logprobs:
            if not out:
                out.append(self._chunk({}))
            out[-1]["choices"][0]["logprobs"] = chat_logprobs(logprobs, self.token_text)
        return out

    def end(self, final: gateway_pb2.Final) -> list[dict]:
        out = self._events(self.parser.finish())
        finish = "tool_calls" if self.num_calls else FINISH.get(final.finish_reason, "stop")
        out.append(self._chunk({}, finish))
        if self.call.include_usage:
            chunk = self._chunk({})
            chunk["choices"] = []
            chunk["usage"] = usage(final)
            out.append(chunk)
        return out


def completion_response(
    call: ChatCall, text: str, final: gateway_pb2.Final, logprobs: Sequence = (), token_text: TokenText | None = None
) -> dict:
    lp = completion_logprobs(logprobs, token_text) if call.logprobs else None
    return {
        "id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
        "choices": [{"index": 0, "text": text, "finish_reason": FINISH.get(final.finish_reason, "stop"), "logprobs": lp}],
        "usage": usage(final),
    }


def completion_chunk(call: ChatCall, text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {
        "id": call.id, "object": "text_completion", "created": call.created, "model": call.model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}],
    }
