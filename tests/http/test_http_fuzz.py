"""The fuzz suite's requests (tests/test_fuzz.py: valid ones with fields corrupted across their
types' ranges) through /v1/completions: every answer is 200 with Generate's own output for the same
request, or a 4xx JSON error naming the problem, never a 500 or a traceback."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from splitspec.transport.rpc import CHANNEL_OPTIONS
from tests.client import generate, worker_state
from tests.http.conftest import httpx
from tests.test_fuzz import requests
from tests.tools import free_port

pytestmark = pytest.mark.slow
MODES = {1: "ddtree", 2: "chain", 3: "off"}


def as_json(fields: dict) -> dict | None:
    """The HTTP body of a GenerateRequest's fields, or None where HTTP has no spelling for them."""
    if fields.get("stop_token_ids"):
        return None
    body = {"model": "target"}
    if "text" in fields:
        body["prompt"] = fields["text"]
    elif "tokens" in fields:
        body["prompt"] = list(fields["tokens"].ids)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"):
        if name in fields:
            body[name] = fields[name]
    body.setdefault("temperature", 0.0)  # the gRPC default (the OpenAI API's is 1)
    spec = fields.get("speculation")
    if spec is not None:
        body["speculation"] = {"mode": MODES.get(spec.mode, f"mode{spec.mode}") if spec.mode else None, "budget": spec.budget or None}
        if spec.HasField("chain_seed"):
            body["speculation"]["chain_seed"] = spec.chain_seed
        if spec.scores:
            body["speculation"]["scores"] = {1: "lattice", 2: "independent"}.get(spec.scores, f"scores{spec.scores}")
    return body


def test_fuzzed_requests_through_http(module_services, tiny_pair):
    s = module_services
    target = s.start("target", "target", "--model", str(tiny_pair.target))
    draft = s.start("draft", "draft", "--model", str(tiny_pair.draft), "--target-model", str(tiny_pair.target))
    port = free_port()
    address = s.start("gateway", "gateway", "--target", target, "--draft", draft, "--http-listen", f"127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}/v1/completions"
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    statuses: dict[int, int] = {}
    client = httpx.Client(timeout=60)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests())
    def one(fields):
        body = as_json(fields)
        if body is None:
            return
        # Python's JSON writes NaN and Infinity (JavaScript's spelling, which many clients send); the gateway refuses them.
        r = client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 413, 429), (r.status_code, r.text, body)
        if r.status_code != 200:
            error = r.json()["error"]
            assert error["message"] and "Traceback" not in error["message"] and "incident" not in error["message"], body
            return
        if "seed" in fields:  # the same request through gRPC Generate gives the same text
            try:
                expected = generate(address, channel=channel, **fields)
            except grpc.RpcError:
                return  # a value HTTP reads differently (top_k -1 is vLLM's "off")
            assert r.json()["choices"][0]["text"] == expected.text, body

    try:
        one()
    finally:
        channel.close()
        client.close()
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 20, statuses
    for name in ("target", "draft", "gateway"):
        assert s.procs[name].poll() is None, f"{name} died"
    assert worker_state(target, draft).empty
