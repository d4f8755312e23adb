#!/usr/bin/env python3
"""Build splitspec's built-in model pair: a small Qwen3 target trained from scratch on the Python
standard library, with its own BPE tokenizer, plus a DFlash draft for it.

Stages (each reads the previous stages' files in --build-dir and writes its own, plus a
STAGE_log.json with the exact command, wall time and results that the model card quotes):

  corpus   CPU, ~1-2 min: select the stdlib sources (manifest.json), train the tokenizer on the
           training split (tokenizer.json), pack both splits as uint16 ids (corpus.npz)
  target   GPU: train the target on corpus.npz and write target.gguf (F16, tokenizer embedded)
  draft    GPU: train a draft for target.gguf (splitspec.train.draft): DFlash into draft/, or with
           --draft-arg arch=dflash2 a DFlash2 draft into draft-dflash2/ (its log: draft-dflash2_log.json)
  card     write MODEL_CARD.md from the logs (and --measurements, a JSON list of AL rows)
  install  copy target.gguf, draft/, manifest.json and MODEL_CARD.md into splitspec/builtin/
  all      every stage in order

The corpus stage can run on another machine than the GPU stages: carry --build-dir along.
Everything is seeded by --seed. Target and draft hyper-parameters: --target-FIELD flags (one per
field of splitspec.train.target.TargetTrainConfig) and --draft-arg FIELD=VALUE (fields of
splitspec.train.draft.DraftTrainConfig; VALUE is read as JSON when it parses, else as a string).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILTIN = REPO / "splitspec" / "builtin"
STAGES = ("corpus", "target", "draft", "card", "install")
# TargetTrainConfig fields the stage sets itself from --build-dir and --seed.
_TARGET_PATHS = ("data", "tokenizer", "out", "seed", "progress")

log = logging.getLogger("build_builtin_pair")


def _target_fields():
    from splitspec.train.target import TargetTrainConfig

    return [f for f in dataclasses.fields(TargetTrainConfig) if f.name not in _TARGET_PATHS]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stages", nargs="+", choices=[*STAGES, "all"], help="stages to run, in the order given")
    p.add_argument("--build-dir", type=Path, default=REPO / "build" / "builtin", help="where every stage reads and writes")
    p.add_argument("--seed", type=int, default=0, help="seed of the target's and the draft's initialisation and data order")
    corpus = p.add_argument_group("corpus")
    corpus.add_argument("--stdlib", type=Path, default=None, help="standard-library folder (default: this interpreter's)")
    corpus.add_argument("--only", action="append", default=[], help="keep only files under this relative path prefix (repeatable; for small test builds)")
    corpus.add_argument("--heldout", action="append", default=None, help="held-out module path (repeatable; default: splitspec.train.corpus.HELDOUT)")
    corpus.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary, special tokens included")
    target = p.add_argument_group("target (defaults: TargetTrainConfig's)")
    for f in _target_fields():
        flag = f"--target-{f.name.replace('_', '-')}"
        if f.type in ("bool", bool):
            target.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            target.add_argument(flag, type={"int": int, "float": float}.get(str(f.type), str), default=None, help=f"default {f.default}")
    draft = p.add_argument_group("draft")
    draft.add_argument("--draft-arg", action="append", default=[], metavar="FIELD=VALUE", help="a DraftTrainConfig field (repeatable)")
    card = p.add_argument_group("card")
    card.add_argument("--measurements", type=Path, default=None, help="JSON list of {prompt_set, mode, budget, acceptance_length, tokens_per_s, device} rows")
    p.add_argument("--install-dir", type=Path, default=BUILTIN, help="where `install` copies the pair")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (how the card's commands are run)."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _write_log(build: Path, stage: str, started: float, **results) -> dict:
    entry = {
        "stage": stage, "command": shlex.join(["python", _shown(Path(sys.argv[0])), *sys.argv[1:]]), "python": platform.python_version(),
        "host": platform.node(), "wall_s": round(time.perf_counter() - started, 2), **results,
    }
    (build / f"{stage}_log.json").write_text(json.dumps(entry, indent=2) + "\n")
    return entry


def _read_log(build: Path, stage: str) -> dict | None:
    path = build / f"{stage}_log.json"
    return json.loads(path.read_text()) if path.is_file() else None


def stage_corpus(args: argparse.Namespace) -> None:
    from splitspec.train import corpus

    started = time.perf_counter()
    config = corpus.CorpusConfig(
        **({"root": args.stdlib} if args.stdlib else {}),
        **({"heldout": tuple(args.heldout)} if args.heldout else {}), only=tuple(args.only),
    )
    counts = corpus.build_corpus(args.build_dir, config, args.vocab_size)
    entry = _write_log(args.build_dir, "corpus", started, **counts)
    log.info("corpus: %d train + %d held-out tokens, corpus.npz of %d bytes, in %.1f s",
             counts["train_tokens"], counts["heldout_tokens"], counts["packed_bytes"], entry["wall_s"])


def stage_target(args: argparse.Namespace) -> None:
    import torch

    from splitspec.builtin import TARGET_FILE
    from splitspec.train import corpus
    from splitspec.train.target import TargetTrainConfig, train_target

    started = time.perf_counter()
    overrides = {f.name: getattr(args, f"target_{f.name}") for f in _target_fields() if getattr(args, f"target_{f.name}") is not None}
    build = args.build_dir
    config = TargetTrainConfig(
        data=build / corpus.PACKED_FILE, tokenizer=build / corpus.TOKENIZER_FILE, out=build / TARGET_FILE,
        seed=args.seed, progress=not args.no_progress, **overrides,
    )
    result = train_target(config)
    device = torch.cuda.get_device_name() if result.device.startswith("cuda") else platform.processor() or "cpu"
    config_dict = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}
    entry = _write_log(
        build, "target", started, config=config_dict, result=result.to_dict(), device_name=device,
        torch=torch.__version__, file_bytes=(build / TARGET_FILE).stat().st_size,
    )
    log.info("target: held-out loss %.4f -> %.4f (best, step %d); %.1f s training at %.0f tokens/s, %.1f s in all",
             result.heldout_loss_initial, result.heldout_loss_best, result.best_step, result.wall_s, result.tokens_per_s, entry["wall_s"])


def _parse_draft_args(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--draft-arg {pair!r}: expected FIELD=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def stage_draft(args: argparse.Namespace) -> None:
    try:
        from splitspec.train.draft import DraftTrainConfig, train_draft
    except ImportError as exc:
        raise SystemExit(f"the draft stage needs splitspec.train.draft (DFlash draft training), which is not installed: {exc}") from exc
    import torch

    from splitspec.builtin import DRAFT_DIRS, DRAFT_FILES, TARGET_FILE
    from splitspec.train import corpus

    started = time.perf_counter()
    build = args.build_dir
    overrides = _parse_draft_args(args.draft_arg)
    folder = DRAFT_DIRS.get(overrides.get("arch", "dflash"))
    if folder is None:
        raise SystemExit(f"--draft-arg arch={overrides['arch']}: choose one of {', '.join(DRAFT_DIRS)}")
    config = DraftTrainConfig(
        target=str(build / TARGET_FILE), data=[str(build / corpus.PACKED_FILE)], out=str(build / folder), seed=args.seed, **overrides,
    )
    result = train_draft(config)
    as_dict = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result).items()}
    files = [build / folder / name for name in DRAFT_FILES]  # what ships
    _write_log(
        build, folder, started, config={k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()},
        result=as_dict, torch=torch.__version__, device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        file_bytes=sum(f.stat().st_size for f in files),
    )


def stage_card(args: argparse.Namespace) -> None:
    from splitspec.builtin import CARD_FILE
    from splitspec.train.card import render_card
    from splitspec.train.corpus import MANIFEST_FILE

    build = args.build_dir
    measurements = json.loads(args.measurements.read_text()) if args.measurements else []
    logs = {stage: _read_log(build, stage) for stage in ("corpus", "target", "draft", "draft-dflash2")}
    manifest = json.loads((build / MANIFEST_FILE).read_text())
    (build / CARD_FILE).write_text(render_card(manifest, logs, measurements))
    log.info("card: %s", build / CARD_FILE)


def stage_install(args: argparse.Namespace) -> None:
    from splitspec.builtin import CARD_FILE, DRAFT_DIR, DRAFT_DIRS, DRAFT_FILES, TARGET_FILE
    from splitspec.train.corpus import MANIFEST_FILE

    build, dest = args.build_dir, args.install_dir
    sources = [build / TARGET_FILE, build / MANIFEST_FILE, build / CARD_FILE, *(build / DRAFT_DIR / f for f in DRAFT_FILES)]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise SystemExit(f"install: missing {', '.join(missing)}; run the earlier stages first")
    for folder in DRAFT_DIRS.values():  # the DFlash draft is required; the others go along when built
        files = [build / folder / f for f in DRAFT_FILES]
        if folder != DRAFT_DIR and all(f.is_file() for f in files):
            sources += files
    for source in sources:
        (dest / source.relative_to(build)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / source.relative_to(build))
    log.info("install: copied the pair into %s", dest)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    args.build_dir.mkdir(parents=True, exist_ok=True)
    stages = STAGES if "all" in args.stages else args.stages
    for stage in stages:
        globals()[f"stage_{stage}"](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
