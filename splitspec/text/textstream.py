"""Incremental detokenization for streaming: UTF-8-safe text deltas with exact stop handling.

Text is decoded from a short window of recent token ids and only its new, complete part is sent:
a window whose text ends in U+FFFD may end inside a multi-byte character (a byte token of an emoji,
say), so that one character is held back until the next token settles it. The window is trimmed to
a few tokens of context, so each push costs the same however long the output grows.

Stop strings are matched on the decoded text. Text that could still be the start of a stop string
is held back until it is disambiguated; the stop string itself is never sent.

Token ids follow the text: a delta reports the tokens whose text (some of it, at least) it
delivers, so a token is held back with its text. When a stop string ends the stream, the tokens
whose text lies wholly at or after the stop string's start are never reported: the reported ids
are exactly the tokens of the delivered text (the last one may run on into the stop string when the
stop string starts inside it). A stop token is reported (it ends the stream and adds no text).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from splitspec.text.tokenizer import Tokenizer

__all__ = ["StreamDelta", "TextStream"]

# Tokens of context kept in front of new ones. A character still incomplete at the end of the
# window spans at most 3 bytes, hence at most the 3 last (non-special) tokens, so 4 keeps it whole.
_CONTEXT_TOKENS = 4
# The window is trimmed back to `_CONTEXT_TOKENS` once it grows past this.
_MAX_WINDOW = 16


@dataclass
class StreamDelta:
    """What one :meth:`TextStream.push` or :meth:`TextStream.flush` produced."""

    text: str  # new text safe to send
    token_ids: list[int]  # the tokens of that text (and a stop token that ended the stream)
    finished: bool  # a stop string / stop token ended the stream
    stop_reason: str | None  # "stop_string" | "stop_token" | None


class TextStream:
    """Turns generated token ids, pushed as they are committed, into text deltas.

    Joined, the deltas' text equals ``tokenizer.decode`` of all pushed ids up to the end (special
    tokens skipped, a stop token contributing nothing) cut before the first occurrence of any stop
    string, and the deltas' ids are the tokens of that text (see the module's docstring). After the
    stream finishes or is flushed, :meth:`push` raises RuntimeError.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop_strings: Sequence[str] = (),
        stop_token_ids: Collection[int] = (),
        prompt_ids: Sequence[int] = (),
    ) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop_strings = tuple(stop_strings)
        self._stop_prefixes = {s[:i] for s in self._stop_strings for i in range(1, len(s))}
        self._longest_prefix = max(map(len, self._stop_prefixes), default=0)
        self._stop_ids = frozenset(stop_token_ids)
        # Decode window: recent non-special ids (prompt tail as context), and how many characters of
        # its decoded text were already passed on.
        self._window = [i for i in prompt_ids if i not in tokenizer.special_ids][-_CONTEXT_TOKENS:]
        self._passed = len(tokenizer.decode(self._window))
        self._held = ""  # decoded text that may be the start of a stop string
        self._num_tokens = 0
        self._num_reported = 0
        # Text positions, in characters of the decoded output (before stop strings are cut): how far
        # it was decoded and how far delivered. Consumed tokens not reported yet, each with the
        # position its text starts at.
        self._decoded = 0
        self._delivered = 0
        self._unsettled = False  # the window's text ended in a U+FFFD that more tokens may complete
        self._unreported: list[tuple[int, int]] = []
        self._closed = False

    @property
    def num_tokens(self) -> int:
        """Tokens consumed so far (up to and including a stop token), reported or not."""
        return self._num_tokens

    @property
    def num_reported(self) -> int:
        """Tokens reported in deltas so far: the tokens of the text delivered (and a stop token)."""
        return self._num_reported

    def push(self, token_ids: Sequence[int]) -> StreamDelta:
        """Feed newly committed tokens; tokens after a stop are dropped and not reported."""
        if self._closed:
            raise RuntimeError("push() on a finished or flushed TextStream")
        parts: list[str] = []
        reason = None
        for token_id in token_ids:
            self._num_tokens += 1
            is_stop = token_id in self._stop_ids  # ends the stream, adds no text, releases what is held
            if not is_stop and token_id not in self._tokenizer.special_ids:
                self._window.append(token_id)
            start = self._decoded
            new_text, starts_later = self._next_text(final=is_stop)
            self._unreported.append((token_id, start + starts_later))
            text, matched = self._match_stop(new_text, final=is_stop)
            parts.append(text)
            if matched or is_stop:
                reason = "stop_string" if matched else "stop_token"
                break
        self._closed = reason is not None
        return StreamDelta("".join(parts), self._report(everything=reason == "stop_token"), reason is not None, reason)

    def flush(self) -> StreamDelta:
        """End of generation without a stop token (e.g. length limit): release all held-back text
        and the tokens held back with it."""
        if self._closed:
            return StreamDelta("", [], False, None)
        self._closed = True
        text, matched = self._match_stop(self._next_text(final=True)[0], final=True)
        return StreamDelta(text, self._report(everything=not matched), matched, "stop_string" if matched else None)

    def _report(self, *, everything: bool) -> list[int]:
        """The unreported tokens whose text starts before the end of the delivered text (all of them
        when ``everything``), now reported; once the stream is closed, the rest are dropped."""
        if everything:
            ids = [token_id for token_id, _ in self._unreported]
            self._unreported = []
        else:
            cut = next((n for n, (_, start) in enumerate(self._unreported) if start >= self._delivered), len(self._unreported))
            ids = [token_id for token_id, _ in self._unreported[:cut]]
            self._unreported = self._unreported[cut:]
        self._num_reported += len(ids)
        return ids

    def _next_text(self, *, final: bool) -> tuple[str, int]:
        """Newly settled text of the window (all of it when ``final``), trimming the window; and 1
        if the token just added starts after the character that was still unsettled (0 if in it or
        at it): that U+FFFD stays and more text follows it, so it was an invalid sequence of its own."""
        decoded = self._tokenizer.decode(self._window)
        end = len(decoded) if final else _settled_length(decoded)
        starts_later = int(self._unsettled and decoded[self._passed : self._passed + 1] == "\ufffd" and len(decoded) > self._passed + 1)
        text = decoded[self._passed : end]
        self._passed = max(self._passed, end)
        self._unsettled = len(decoded) > self._passed
        self._decoded += len(text)
        if len(self._window) > _MAX_WINDOW:
            unsettled = len(decoded) - self._passed
            self._window = self._window[-_CONTEXT_TOKENS:]
            self._passed = len(self._tokenizer.decode(self._window)) - unsettled
        return text, starts_later

    def _match_stop(self, text: str, *, final: bool) -> tuple[str, bool]:
        """Pass ``text`` through the stop-string filter: the text that can be sent now, and whether a
        stop string matched (then the text ends right before it)."""
        buffer = self._held + text
        starts = [i for i in (buffer.find(s) for s in self._stop_strings) if i >= 0]
        if starts:
            self._held = ""
            self._delivered += min(starts)
            return buffer[: min(starts)], True
        keep = 0 if final else self._held_back_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        self._delivered += len(buffer) - keep
        return buffer[: len(buffer) - keep], False

    def _held_back_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins a stop string (0 if none)."""
        for n in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-n:] in self._stop_prefixes:
                return n
        return 0


def _settled_length(text: str) -> int:
    """Length of ``text`` that more tokens cannot change: all but a trailing U+FFFD, which may stand
    for an incomplete UTF-8 sequence (one of those always decodes to a single U+FFFD)."""
    return len(text) - 1 if text.endswith("\ufffd") else len(text)
