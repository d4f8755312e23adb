"""The ``splitspec`` command: one subcommand per service, plus serve, generate, make-tiny and train-draft."""

from __future__ import annotations

import argparse
import logging

from splitspec import __version__
from splitspec.cli.envs import apply_env_defaults
from splitspec.cli.logs import setup_logging
from splitspec.transport import busypoll

DESCRIPTION = """\
splitspec serves LLMs with DFlash block drafting and DDTree tree verification, split into three
gRPC services: a gateway (public API), a draft worker and a target worker.

Quick start:   splitspec serve            (the built-in pair, all three services locally)
               splitspec generate "def parse_args(" --max-tokens 128
"""


def build_parser() -> argparse.ArgumentParser:
    from services.draft import main as draft_main
    from services.gateway import main as gateway_main
    from services.target import main as target_main
    from splitspec.bench import main as bench_main
    from splitspec.cli import generate, health, serve
    from splitspec.train import main as train_main

    parser = argparse.ArgumentParser(prog="splitspec", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"splitspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        "target": (target_main.add_arguments, "run the target worker (model, KV cache, tree verify)"),
        "draft": (draft_main.add_arguments, "run the draft worker (DFlash block proposals)"),
        "gateway": (gateway_main.add_arguments, "run the gateway (public API, speculation loop)"),
        "serve": (serve.add_arguments, "run all three services locally, stopped together"),
        "generate": (generate.add_arguments, "stream a completion from a gateway"),
        "make-tiny": (_make_tiny_arguments, "write a tiny random target GGUF (qwen3, qwen2, llama or the qwen35 hybrid) and a matching DFlash or DFlash2 draft"),
        "health": (health.add_arguments, "check a service's gRPC health (exit 0 when serving)"),
        "bench": (bench_main.add_arguments, "time the components and the whole system on random weights of a real shape"),
        "train-draft": (train_main.add_arguments, "train a DFlash draft for a target on your text (the target stays frozen)"),
    }
    for name, (add, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add(p)
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
        p.add_argument("--log-json", action="store_true", help="log one JSON object per line")
        apply_env_defaults(p, name.replace("-", "_"))
    return parser


def _make_tiny_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="folder to write target.gguf and draft/ into")
    # The keys of splitspec.fixtures.tiny.WEIGHT_TYPES, listed here so that parsing never imports torch.
    weight_types = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
    p.add_argument("--weight-type", choices=weight_types, default="f32", help="GGUF type of the target's matrices")
    p.add_argument("--architecture", choices=["qwen3", "qwen2", "llama", "qwen35"], default="qwen3", help="architecture of the target")
    p.add_argument("--draft-arch", choices=["dflash", "dflash2"], default="dflash", help="the draft's architecture")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_json)
    log = logging.getLogger("splitspec")
    from splitspec.errors import ServiceError
    from splitspec.transport.allocator import keep_message_buffers

    keep_message_buffers()
    from splitspec.models.gguf_file import ModelFileError

    try:
        if args.command == "generate":
            from splitspec.cli.generate import run as run_generate

            return run_generate(args)
        if args.command == "serve":
            from splitspec.cli.serve import run as run_serve

            return run_serve(args, ["--log-level", args.log_level, *(["--log-json"] if args.log_json else [])])
        if args.command == "health":
            from splitspec.cli.health import run as run_health

            return run_health(args)
        if args.command == "bench":
            from splitspec.bench.main import run as run_bench

            return run_bench(args)
        if args.command == "train-draft":
            from splitspec.train.main import run as run_train

            return run_train(args)
        if args.command == "make-tiny":
            from splitspec.fixtures.tiny import TinySpec, make_tiny

            target, draft = make_tiny(args.out_dir, TinySpec(architecture=args.architecture, seed=args.seed, draft_arch=args.draft_arch), weight_type=args.weight_type)
            print(f"wrote {target} and {draft}")
            return 0
        module = {"target": "target", "draft": "draft", "gateway": "gateway"}[args.command]
        run = __import__(f"services.{module}.main", fromlist=["run"]).run
        busypoll.run(run(args))
        return 0
    except (ModelFileError, ServiceError, ValueError, OSError) as exc:
        # One clear line instead of a traceback wall: the file and key, or the flag, at fault.
        log.error("splitspec %s: %s", args.command, exc)
        return 2
    except KeyboardInterrupt:
        return 130
