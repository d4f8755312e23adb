"""A tiny target trained (seconds on the CPU) to answer a fixed chat with a tool call, and the tool's
result with a sentence: a real model for the tool-call round trip, not a mock.

It is the tiny pair's geometry and byte-level vocabulary with :data:`TOOLS_TEMPLATE`; its weights
are fitted with splitspec's training loss (``splitspec.train.target.sequence_loss``) to the two
conversations below, rendered by the same chat template the gateway uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from splitspec.fixtures.tiny import TinySpec, gguf_weights, random_draft, random_target, write_draft_dir, write_target_gguf
from splitspec.models.dense import DenseForCausalLM
from splitspec.text.chat import ChatTemplate
from splitspec.text.tokenizer import Tokenizer, byte_level_vocab
from splitspec.train.target import sequence_loss
from tests.http.conftest import TOOLS_TEMPLATE

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ARGUMENTS = {"city": "Paris"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = "18 C, sunny"
ANSWER = "It is 18 C and sunny in Paris."


def answered(call_id: str = "call_1") -> list[dict]:
    """The conversation after the call, with the tool's result (the chat-template form)."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}}
    return [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


def train_tool_pair(out: Path, steps: int = 400, seed: int = 0) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    spec = TinySpec(seed=seed)
    vocab = byte_level_vocab()
    config, state = random_target(spec, len(vocab.tokens), np.random.default_rng(seed))
    target_path = out / "target.gguf"
    # A random model first: its tokenizer renders and encodes the training conversations.
    write_target_gguf(target_path, config, gguf_weights(config, state), vocab, chat_template=TOOLS_TEMPLATE)
    tokenizer = Tokenizer.load(str(target_path))
    chat = ChatTemplate(TOOLS_TEMPLATE, tokenizer.special_tokens)
    end = [vocab.special_ids["<|im_end|>"]]
    sequences = []
    for messages, reply in ((QUESTION, CALL_TEXT), (answered(), ANSWER)):
        prompt = chat.prompt(messages, True, tokenizer.special_token_strings, {"tools": TOOLS}).encode(tokenizer)
        sequences.append(torch.tensor([prompt + tokenizer.encode(reply) + end]))

    torch.manual_seed(seed)
    model = DenseForCausalLM(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        loss = sum(sequence_loss(model, s) for s in sequences)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.05 * len(sequences):  # the greedy answer is the trained one well before this
            break
    trained = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    write_target_gguf(target_path, config, gguf_weights(config, trained), vocab, chat_template=TOOLS_TEMPLATE)
    draft, tensors = random_draft(config, spec, vocab.special_ids["<|mask|>"], np.random.default_rng(seed))
    write_draft_dir(out / "draft", draft, tensors, config.num_layers)
    (out / "train.json").write_text(json.dumps({"steps": step + 1, "loss": loss.item()}))
    return target_path, out / "draft"
