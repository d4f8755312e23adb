"""Chat templates: a model's Jinja template turning chat messages into its prompt text.

Templates come from model files (GGUF ``tokenizer.chat_template``, ``tokenizer_config.json``), so
they are untrusted code: they run in Jinja's immutable sandbox. The environment matches what the
templates are written for (the Hugging Face convention): ``trim_blocks`` and ``lstrip_blocks``,
loop controls, a ``tojson`` filter that keeps non-ASCII text, and the globals ``raise_exception``
(a template's way to reject a conversation) and ``strftime_now``. The template sees ``messages``,
``add_generation_prompt``, ``tools`` and ``documents`` (None) and the tokenizer's named special
tokens (``bos_token``, ``eos_token``, ...).

Message text is literal by default (:meth:`ChatTemplate.prompt`): a special-token string typed in a
message's role or content (``<|im_end|>``, say) is tokenized as the plain text it spells, so a user
cannot close their turn and forge a system turn; only the template's own special tokens are control
tokens. Trusted callers may let message text carry control tokens (``special_tokens_in_content``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from splitspec.text.tokenizer import Tokenizer

# Stand-ins for special-token strings typed in messages: characters of Supplementary Private Use Area-A.
_LITERAL_CHARS = range(0xF0000, 0xFFFFE)


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
        self.source = source

    def render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, extra: Mapping[str, object] | None = None
    ) -> str:
        """The prompt text of ``messages`` (each with ``role`` and ``content``); ``extra`` template
        variables (``tools``, ``documents``, ...) override the defaults."""
        try:
            variables = {"tools": None, "documents": None, **self.special_tokens, **(extra or {})}
            return self._template.render(
                variables, messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc

    def prompt(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        special_strings: Collection[str] = (),
        extra: Mapping[str, object] | None = None,
    ) -> ChatPrompt:
        """The prompt of ``messages`` with each of ``special_strings`` (a tokenizer's
        ``special_token_strings``) that the caller's text spells kept literal: every string in the
        messages (roles, contents, nested fields such as tool calls) and in ``extra`` (tools, ...).
        Such a string is rendered as a private-use character that :meth:`ChatPrompt.encode`
        tokenizes as the string's plain text. With no ``special_strings`` this is :meth:`render`'s
        text as it is.

        The template sees the stand-in characters, not the strings: a template that looks for a
        special token in a message (``'<think>' in content``) does not find one the user typed.
        """
        specials = sorted({s for s in special_strings if s}, key=len, reverse=True)
        values = [*_strings(messages), *_strings(extra)]
        found: set[str] = set()
        if specials:
            pattern = re.compile("|".join(map(re.escape, specials)))  # leftmost, then longest, as tokenizers match
            for value in values:
                found.update(pattern.findall(value))
        if not found:
            return ChatPrompt(self.render(messages, add_generation_prompt, extra))
        reserved = [self.source, *self.special_tokens.values()]
        chars = (chr(c) for c in _LITERAL_CHARS)
        stand_in: dict[str, str] = {}
        for special in sorted(found):
            stand_in[special] = next(c for c in chars if not any(c in v for v in values) and not any(c in r for r in reserved))

        def escape(text: str) -> str:
            return pattern.sub(lambda m: stand_in[m.group()], text)

        text = self.render(_map_strings(messages, escape), add_generation_prompt, _map_strings(extra, escape))
        return ChatPrompt(text, {c: s for s, c in stand_in.items()})

    def encode(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        *,
        special_tokens_in_content: bool = False,
        extra: Mapping[str, object] | None = None,
    ) -> list[int]:
        """Token ids of the prompt of ``messages`` (the template's own BOS included, none added);
        special-token strings in the messages are plain text unless ``special_tokens_in_content``."""
        strings = () if special_tokens_in_content else tokenizer.special_token_strings
        return self.prompt(messages, add_generation_prompt, strings, extra).encode(tokenizer)


def _strings(value) -> list[str]:
    """Every string in ``value``: itself, or inside its mappings' values and its lists and tuples."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _map_strings(value, fn):
    """``value`` with ``fn`` applied to every string in it (mappings become dicts, tuples lists)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt: ``text`` with each key of ``literals`` (a private-use character)
    standing for its value, a special-token string that a message spelled, to be tokenized as text."""

    text: str
    literals: dict[str, str] = field(default_factory=dict)

    @property
    def plain_text(self) -> str:
        """The prompt as the model reads it, the literals spelled out."""
        return self.text.translate(str.maketrans(self.literals)) if self.literals else self.text

    @property
    def num_bytes(self) -> int:
        """UTF-8 length of :attr:`plain_text`, without building it."""
        extra = sum(self.text.count(c) * (len(s.encode()) - len(c.encode())) for c, s in self.literals.items())
        return len(self.text.encode()) + extra

    def encode(self, tokenizer: Tokenizer) -> list[int]:
        """Token ids (no BOS added): the template's special tokens as control tokens, the literals as text."""
        return tokenizer.encode_with_literals(self.text, self.literals)
