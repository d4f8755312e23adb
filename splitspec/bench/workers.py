"""Benchmark-only worker processes — never for serving users.

``python -m splitspec.bench.workers COMMAND --listen ADDRESS ...`` runs the real target or draft
service (the same servicers, engines and transport as ``splitspec target``/``splitspec draft``)
around a model that only the benchmark and the tests use:

- ``random-target --model random:SHAPE``: a target of random weights of a real shape
  (``splitspec.bench.random_weights``), drawn on the device; it has no tokenizer, so its gateway
  is given one with ``--tokenizer``. A ``*-q4km`` shape's linears are GGUF blocks: with
  ``--keep-quantized`` they stay in them (``QuantLinear``), without it (or with ``auto``, its
  default: random weights have no file to size) they are dequantized to ``--dtype``.
- ``random-draft --model random:SHAPE-dflash --target-model random:SHAPE``: a DFlash draft of
  random weights with the random target's embedding and LM head (a ``*-q4km`` target's Q4_K
  embedding and Q6_K head kept in their blocks with ``--keep-quantized``, as ``splitspec draft``
  keeps a GGUF target's).
- ``oracle-draft --table FILE --target-model TARGET``: the OracleDrafter (``oracle_drafter.py``),
  which proposes recorded continuations corrupted at ``--corruption``.
- ``shaped-oracle-draft --model random:SHAPE-dflash --target-model random:SHAPE --table FILE``:
  ``random-draft``'s engine running every pass, answering with the OracleDrafter's proposals
  (``shaped_oracle.py``): the round of the real draft shape at the oracle's acceptance length.

Every other flag is the service's own (``splitspec target --help``, ``splitspec draft --help``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from services.draft import main as draft_main
from services.target import main as target_main
from splitspec.cli.envs import apply_env_defaults
from splitspec.cli.logs import setup_logging
from splitspec.transport import busypoll
from splitspec.transport.allocator import keep_message_buffers

logger = logging.getLogger(__name__)

BENCH_WORKERS = ("random-target", "random-draft", "oracle-draft", "shaped-oracle-draft")


def random_target(args: argparse.Namespace, device, dtype, state_dtype):
    from splitspec.bench.random_weights import random_target as build
    from splitspec.models.quantized import kept_summary

    model, config = build(args.model, device, dtype, state_dtype, keep_quantized=args.keep_quantized == "on")
    logger.info("random target %s: %s", args.model, kept_summary(model))
    return model, config, [], ""


def random_draft(args: argparse.Namespace):
    from splitspec.bench.random_weights import random_draft as build
    from splitspec.bench.random_weights import random_target_head
    from splitspec.models.devices import resolve_device, resolve_dtype
    from splitspec.models.quantized import head_summary

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, _ = build(args.model, device, dtype)
    embed, head, target_config = random_target_head(args.target_model, device, dtype, keep_quantized=args.keep_quantized == "on")
    logger.info("random draft %s: the target's %s", args.model, head_summary(embed, head))
    engine = draft_main.draft_engine(args, model, embed, head, device)
    return engine, target_config, str(dtype).removeprefix("torch."), str(device)


def oracle_draft(args: argparse.Namespace):
    from splitspec.bench.oracle_drafter import OracleDrafter, OracleTable
    from splitspec.bench.random_weights import is_random, random_target_config
    from splitspec.models.loader import read_target_config

    target = random_target_config(args.target_model) if is_random(args.target_model) else read_target_config(args.target_model)
    engine = OracleDrafter(OracleTable(args.model), target.vocab_size, corruption=args.corruption, delay_s=args.delay, selector=args.selector)
    logger.warning("ORACLE drafter (benchmark/test only): %s, corruption %.2f%s", args.model, args.corruption, ", with selector pair scores" if args.selector else "")
    return engine, target, "n/a", "cpu"


def shaped_oracle_draft(args: argparse.Namespace):
    from splitspec.bench.oracle_drafter import OracleDrafter, OracleTable
    from splitspec.bench.shaped_oracle import ShapedOracleDrafter

    engine, target, dtype, device = random_draft(args)
    oracle = OracleDrafter(OracleTable(args.table), target.vocab_size, block_size=engine.block_size, corruption=args.corruption)
    logger.warning("SHAPED ORACLE drafter (benchmark only): %s's passes, the oracle's proposals from %s at corruption %.2f",
                   args.model, args.table, args.corruption)
    return ShapedOracleDrafter(engine, oracle), target, dtype, device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m splitspec.bench.workers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    target = sub.add_parser("random-target", help="the target service on random weights of a real shape")
    target_main.add_arguments(target)
    draft = sub.add_parser("random-draft", help="the draft service with a random DFlash draft of a real shape")
    draft_main.add_arguments(draft)
    oracle = sub.add_parser("oracle-draft", help="the draft service with the OracleDrafter")
    draft_main.add_arguments(oracle, model=False)
    shaped = sub.add_parser("shaped-oracle-draft", help="the draft service with a random DFlash draft's passes and the OracleDrafter's proposals")
    draft_main.add_arguments(shaped)
    for p, dest in ((oracle, "model"), (shaped, "table")):  # the oracle worker's model is its table
        p.add_argument("--table", required=True, dest=dest, help='JSONL file of recorded sequences ({"tokens": [...]} per line)')
        p.add_argument("--corruption", type=float, default=0.0, help="per-depth probability that the true token loses rank 0")
    oracle.add_argument("--delay", type=float, default=0.0, help="seconds each proposal takes (a slow drafter, for deadline tests)")
    oracle.add_argument(
        "--selector", action="store_true",
        help="answer as a DFlash2 draft: pair scores whose transitions favour the recorded path (a selector that finds "
        "a corrupted depth's true token wherever it is a candidate)",
    )
    for p, service in ((target, "target"), (draft, "draft"), (oracle, "draft"), (shaped, "draft")):
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        p.add_argument("--log-json", action="store_true")
        apply_env_defaults(p, service)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_json)
    keep_message_buffers()
    if args.command == "random-target":
        service = target_main.run(args, build=random_target)
    else:
        builds = {"random-draft": random_draft, "oracle-draft": oracle_draft, "shaped-oracle-draft": shaped_oracle_draft}
        service = draft_main.run(args, build=builds[args.command])
    busypoll.run(service)
    return 0


if __name__ == "__main__":
    sys.exit(main())
