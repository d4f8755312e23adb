"""Reading JSON request bodies: each field checked for type and range, errors naming the field.

Both HTTP APIs translate their JSON into the gateway's own request (``gateway_pb2.GenerateRequest``
plus, for chats, the structured messages and tools); the ranges the gateway itself checks
(temperature, top_p, budget, max_tokens against the context, ...) are left to it, so one place
decides them for gRPC and HTTP alike.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from splitspec.errors import InvalidArgument
from splitspec.v1 import gateway_pb2

SCORES = {"lattice": gateway_pb2.Speculation.LATTICE, "independent": gateway_pb2.Speculation.INDEPENDENT}
MODES = {"ddtree": gateway_pb2.Speculation.DDTREE, "chain": gateway_pb2.Speculation.CHAIN, "off": gateway_pb2.Speculation.OFF}
MAX_INT32 = 2**31 - 1
_MISSING = object()


def parse_json(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"body: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidArgument("body: must be a JSON object")
    try:  # JSON's \ud800 escapes can spell lone surrogates, which are no text (gRPC's UTF-8 check refuses them too)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument("body: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode") from None
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _get_typed(body: dict, name: str, default: Any, where: str, kind: type, noun: str) -> Any:
    """``body[name]`` of type ``kind``; ``default`` when absent (required when there is none)."""
    value = body.get(name, default)
    if value is _MISSING:
        raise InvalidArgument(f"{where}{name}: required")
    if value is not default and not isinstance(value, kind):
        raise InvalidArgument(f"{where}{name}: must be {noun}, not {_kind(value)}")
    return value


def get_str(body: dict, name: str, default: Any = _MISSING, where: str = "") -> Any:
    return _get_typed(body, name, default, where, str, "a string")


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name}: must be true or false, not {_kind(value)}")
    return value


def get_int(body: dict, name: str, default: int | None = None, low: int = 0, high: int = MAX_INT32, where: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{where}{name}: must be an integer, not {_kind(value)}")
    if not low <= value <= high:
        raise InvalidArgument(f"{where}{name}: {value} is outside [{low}, {high}]")
    return value


def get_float(body: dict, name: str, default: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{name}: must be a finite number, not {value!r}")
    return float(value)


def get_list(body: dict, name: str, default: Any = _MISSING, where: str = "") -> Any:
    return _get_typed(body, name, default, where, list, "a list")


def refuse(body: dict, name: str, allowed: Any, why: str) -> None:
    """A field whose only supported value is ``allowed`` (None: absent) refused otherwise, naming it."""
    value = body.get(name)
    if value is not None and value != allowed and not (allowed is None and value in (False, 0, [], {})):
        raise InvalidArgument(f"{name}: {why}")


def sampling(req: gateway_pb2.GenerateRequest, body: dict, temperature_default: float = 1.0) -> None:
    """temperature, top_p, top_k, seed (a random seed when absent, as the hosted APIs sample anew), ignore_eos."""
    req.temperature = get_float(body, "temperature", temperature_default)
    top_p = get_float(body, "top_p")
    if top_p is not None:
        req.top_p = top_p
    req.top_k = get_int(body, "top_k", 0, low=-1)
    if req.top_k == -1:  # vLLM's spelling of "off"
        req.top_k = 0
    req.ignore_eos = get_bool(body, "ignore_eos")  # an extension, as vLLM has it
    seed = get_int(body, "seed", None, low=-(2**63), high=2**64 - 1)
    req.seed = random.getrandbits(63) if seed is None else seed % 2**64


def stops(req: gateway_pb2.GenerateRequest, body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise InvalidArgument(f"{name}: must be a string or a list of strings")
    req.stop.extend(values)
    return values


def speculation(req: gateway_pb2.GenerateRequest, body: dict) -> None:
    """The extension field ``speculation: {mode, budget, chain_seed, scores}`` (``extra_body`` in the clients)."""
    spec = body.get("speculation")
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise InvalidArgument("speculation: must be an object {mode, budget, chain_seed, scores}")
    unknown = set(spec) - {"mode", "budget", "chain_seed", "scores"}
    if unknown:
        raise InvalidArgument(f"speculation.{sorted(unknown)[0]}: unknown field (use mode, budget, chain_seed, scores)")
    mode = spec.get("mode")
    if mode is not None:
        if mode not in MODES:
            raise InvalidArgument(f"speculation.mode: {mode!r} is not one of ddtree, chain, off")
        req.speculation.mode = MODES[mode]
    budget = get_int(spec, "budget", None, low=1, where="speculation.")
    if budget is not None:
        req.speculation.budget = budget
    chain_seed = spec.get("chain_seed")
    if chain_seed is not None:
        if not isinstance(chain_seed, bool):
            raise InvalidArgument("speculation.chain_seed: must be true or false")
        req.speculation.chain_seed = chain_seed
    scores = spec.get("scores")
    if scores is not None:
        if scores not in SCORES:
            raise InvalidArgument(f"speculation.scores: {scores!r} is not one of lattice, independent")
        req.speculation.scores = SCORES[scores]
