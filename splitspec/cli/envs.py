"""Environment variables: every command-line flag ``--some-flag`` of a service can be set as
``SPLITSPEC_<SERVICE>_SOME_FLAG`` (flags win over the environment). For example
``SPLITSPEC_TARGET_MODEL=/models/qwen3-8b.gguf``, ``SPLITSPEC_GATEWAY_BUDGET=32``, or a memory cap
(``--memory-cap-gb``) as ``SPLITSPEC_TARGET_MEMORY_CAP_GB=22``, ``SPLITSPEC_DRAFT_MEMORY_CAP_GB=8``
or ``SPLITSPEC_SERVE_MEMORY_CAP_GB=24``. ``splitspec serve`` passes its workers their flags on the
command line, so under serve its own variables rule and a worker's variables fill only the flags
serve does not pass.
"""

from __future__ import annotations

import argparse
import os

PREFIX = "SPLITSPEC_"


def apply_env_defaults(parser: argparse.ArgumentParser, service: str) -> None:
    """Replace each option's default by its environment variable, when set, and say so in --help."""
    for action in parser._actions:  # argparse has no public iterator over options
        if not action.option_strings or action.dest == "help":
            continue
        name = f"{PREFIX}{service.upper()}_{action.dest.upper()}"
        action.help = f"{action.help or ''} [env {name}]".strip()
        raw = os.environ.get(name)
        if raw is None:
            continue
        if action.type is not None:
            action.default = action.type(raw)
        elif isinstance(action.default, bool) or action.nargs == 0:
            action.default = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            action.default = raw
        action.required = False
