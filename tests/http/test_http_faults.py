"""Admission limits answer 429 and a target that is down 503, each in the API's own error shape;
SIGTERM lets a stream in flight finish."""

from __future__ import annotations

import signal
import threading
import time

import anthropic
import openai
import pytest

from tests.http.conftest import httpx
from tests.tools import free_port

pytestmark = pytest.mark.slow
LONG = {"model": "target", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "stream": True, "ignore_eos": True}


def _start(services, tiny_pair, *args):
    target = services.start("target", "target", "--model", str(tiny_pair.target))
    port = free_port()
    services.start("gateway", "gateway", "--target", target, "--draft", "", "--http-listen", f"127.0.0.1:{port}",
                   "--health-interval", "0.2", *args)
    return f"http://127.0.0.1:{port}"


def test_admission_limit_is_429_and_target_down_is_503(services, tiny_pair):
    url = _start(services, tiny_pair, "--max-running", "1", "--max-waiting", "0")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/chat/completions", json=LONG) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # the slot is taken
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert info.value.status_code == 429 and "waiting" in info.value.body["message"]
        with pytest.raises(anthropic.RateLimitError) as ainfo:
            anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(
                model="target", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert ainfo.value.body["error"]["type"] == "rate_limit_error"

    services.stop("target", signal.SIGKILL)
    deadline = time.monotonic() + 20
    while httpx.get(url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert info.value.status_code == 503 and "unavailable" in info.value.body["message"]


def test_sigterm_lets_a_stream_finish(services, tiny_pair):
    url = _start(services, tiny_pair)
    body = dict(LONG, max_tokens=300)
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        threading.Timer(0.05, services.procs["gateway"].send_signal, (signal.SIGTERM,)).start()
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]", rest[-3:]
    assert '"finish_reason":"length"' in "".join(rest)
    assert services.stop("gateway") == 0
