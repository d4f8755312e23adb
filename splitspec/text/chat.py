"""Chat templates: a model's Jinja template turning chat messages into its prompt text.

Templates come from model files (GGUF ``tokenizer.chat_template``, ``tokenizer_config.json``), so
they are untrusted code: they run in Jinja's immutable sandbox. The environment matches what the
templates are written for (the Hugging Face convention): ``trim_blocks`` and ``lstrip_blocks``,
loop controls, a ``tojson`` filter that keeps non-ASCII text, and the globals ``raise_exception``
(a template's way to reject a conversation) and ``strftime_now``. The template sees ``messages``,
``add_generation_prompt``, ``tools`` and ``documents`` (None) and the tokenizer's named special
tokens (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that does not compile, or that rejected the conversation; the message says which."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (each with ``role`` and ``content``)."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc
