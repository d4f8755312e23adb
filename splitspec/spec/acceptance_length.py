"""Acceptance length (AL): the one definition every figure in splitspec uses.

Definition
----------
**AL = tokens committed by verify steps / number of verify steps.**

A *verify step* is one target pass over a draft tree (or over the root alone when nothing was
drafted: target-only decoding, a draft fallback). A step commits its root, the last step's bonus
token, plus the draft nodes it accepted, so it commits ``accepted + 1`` tokens ("bonus included",
as in the speculative-decoding literature) and hands the client ``accepted + 1`` new tokens: the
accepted nodes and its own bonus token. Hence target-only decoding has AL exactly 1.0, and AL - 1
is the mean number of accepted draft tokens per step.

What is not counted:

- the first generated token of a request comes from the prompt's *prefill*, not from a verify
  step; neither it nor the prefill counts (nor does the re-prefill of a sequence a restarted
  target lost, and its token). So ``completion_tokens / steps`` is *not* AL: for ``n`` tokens
  generated target-only it is ``n / (n - 1)``;
- a request with no verify step at all (``max_tokens`` 1) has no AL; it is reported as 0.0.

Steps cut short. ``max_tokens`` never truncates a step: the gateway caps each tree's depth at the
tokens still wanted, so a step commits at most those. A stop condition (stop string, stop token,
EOS) can end a request inside a step's tokens, and the gateway may have run a step ahead of the
client by then (``services.gateway.runahead``); such steps count in full, every token they
committed, delivered or not. AL measures how far the target walked into the drafts, per target
pass: it is what the Prometheus histogram ``spec_decode_acceptance_length_tokens`` observes as each
step finishes (before anyone knows where a stop will fall), and ``usage.steps`` and
``usage.mean_acceptance_length`` agree with those metrics exactly. So a request that ended on
``length`` or ``context`` has ``completion_tokens == 1 + AL * steps`` (plus one per re-prefill), and
one that ended on a stop ``completion_tokens <= 1 + AL * steps`` (idem).

Several requests pool as total committed tokens over total steps (:func:`pooled_acceptance_length`),
never as a mean of their ALs.

Pure functions, no torch: the gateway (which runs without torch) and the benchmark both import them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class UsageLike(Protocol):
    """What the gateway's ``Usage`` message carries about speculation."""

    steps: int
    mean_acceptance_length: float


def acceptance_length(committed_tokens: int, verify_steps: int) -> float:
    """AL: ``committed_tokens`` (tokens committed by verify steps, bonus included, the prefill's
    token excluded) over ``verify_steps``; 0.0 when there was no verify step (see the module)."""
    if committed_tokens < 0 or verify_steps < 0:
        raise ValueError(f"acceptance_length: negative count ({committed_tokens} tokens, {verify_steps} steps)")
    return committed_tokens / verify_steps if verify_steps else 0.0


def committed_tokens(usage: UsageLike) -> int:
    """Tokens the verify steps of one request committed, recovered from its usage
    (``mean_acceptance_length`` is a float32 on the wire, ``steps`` an integer)."""
    return round(usage.mean_acceptance_length * usage.steps)


def pooled_acceptance_length(usages: Iterable[UsageLike]) -> float:
    """AL over several requests: all their committed tokens over all their steps."""
    committed = steps = 0
    for usage in usages:
        committed += committed_tokens(usage)
        steps += usage.steps
    return acceptance_length(committed, steps)
