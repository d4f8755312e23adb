"""A tiny pair whose chat template offers tools (Qwen's format), and the three services with HTTP on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

try:  # the HTTP client the installed openai and anthropic packages use, for raw requests
    import httpx2 as httpx
except ImportError:  # pragma: no cover - releases before httpx2
    import httpx  # noqa: F401

from splitspec.fixtures.tiny import TinySpec, gguf_weights, random_draft, random_target, write_draft_dir, write_target_gguf
from splitspec.text.tokenizer import byte_level_vocab
from tests.tools import free_port

TOKEN = "test-token"

# A short Qwen2.5-style template: tools in the system turn, calls as <tool_call> JSON, results as <tool_response>.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

Call a function as <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def make_tools_pair(out: Path, seed: int = 1) -> tuple[Path, Path]:
    """A tiny random qwen3 target with :data:`TOOLS_TEMPLATE` as its chat template, and a DFlash draft."""
    out.mkdir(parents=True, exist_ok=True)
    spec = TinySpec(seed=seed)
    rng = np.random.default_rng(seed)
    vocab = byte_level_vocab()
    target, state = random_target(spec, len(vocab.tokens), rng)
    target_path = out / "target.gguf"
    write_target_gguf(target_path, target, gguf_weights(target, state), vocab, chat_template=TOOLS_TEMPLATE)
    draft, tensors = random_draft(target, spec, vocab.special_ids["<|mask|>"], rng)
    write_draft_dir(out / "draft", draft, tensors, target.num_layers)
    return target_path, out / "draft"


@pytest.fixture(scope="module")
def tools_pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_tools_pair(tmp_path_factory.mktemp("tools-pair"))


@pytest.fixture(scope="module")
def http_gateway(module_services, tools_pair):
    """target + draft + gateway (gRPC on a Unix socket, HTTP on a loopback port, auth token on)."""
    s = module_services
    target_model, draft_model = tools_pair
    target = s.start("target", "target", "--model", str(target_model))
    draft = s.start("draft", "draft", "--model", str(draft_model), "--target-model", str(target_model))
    port = free_port()
    address = s.start(
        "gateway", "gateway", "--target", target, "--draft", draft, "--http-listen", f"127.0.0.1:{port}",
        "--auth-token", TOKEN, "--max-running", "64", "--max-waiting", "64", "--max-request-bytes", str(1 << 20),
    )
    yield {"grpc": address, "url": f"http://127.0.0.1:{port}", "target": target, "draft": draft, "services": s, "model": "target"}
