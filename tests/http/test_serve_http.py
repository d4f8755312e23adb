"""`splitspec serve --http-listen` starts the gateway's HTTP API, names it in the ready line, and
the openai client reaches the pair through it."""

from __future__ import annotations

import openai
import pytest

from tests.test_serve import _serve
from tests.tools import free_port

pytestmark = pytest.mark.slow


def test_serve_names_and_serves_the_http_api(tiny_pair):
    address = f"127.0.0.1:{free_port()}"
    with _serve(tiny_pair, "--http-listen", address) as served:
        ready = served.wait_log(r"splitspec serve: ready on .*").group(0)
        assert f"HTTP API http://{address}/v1" in ready
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1)
        assert reply.usage.completion_tokens >= 1 and reply.usage.model_extra["mean_acceptance_length"] >= 1.0
