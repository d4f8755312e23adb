"""``splitspec train-draft``: flags -> ``DraftTrainConfig`` -> ``train_draft``. Parsing imports no torch."""

from __future__ import annotations

import argparse

from splitspec.train.data import DEFAULT_GLOB


def _taps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer numbers") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="target model: GGUF file, Hugging Face directory or hf:// reference; it stays frozen")
    p.add_argument("data", nargs="+", help="training text: files, directories (searched recursively, see --glob) and JSONL files "
                   "(one document per line: a 'text' field, or 'prompt' + 'completion')")
    p.add_argument("--out", required=True, help="folder for the draft (config.json + model.safetensors), train_log.json and checkpoint.pt")
    p.add_argument("--glob", default=DEFAULT_GLOB, help="comma-separated file name patterns read from directories")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per packed training sequence")
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="share of the text, by document, held out for evaluation")
    p.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                   help="dflash, or dflash2: DFlash plus dynamic convolutions and a candidate selector (docs/dflash2.md)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the draft")
    p.add_argument("--taps", type=_taps, default=None, help="comma-separated target layers whose outputs feed the draft "
                   "(default: evenly spaced from layer 1, one per draft layer, as DFlash's training code does)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per drafted block, anchor included")
    p.add_argument("--mask-token-id", type=int, default=None, help="token id that fills the block after the anchor "
                   "(default: the tokenizer's <|mask|>)")
    p.add_argument("--anchors", type=int, default=512, help="blocks per sequence per step, at random distinct positions")
    p.add_argument(
        "--labels", choices=["text", "target"], default="text",
        help="what block rows learn to predict: the text's next tokens (the published recipe), or the target's "
        "own greedy tokens on that text (self-distillation: the draft learns what verification accepts)",
    )
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight decay over block rows: row k weighs exp(-(k-1)/gamma)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate of AdamW")
    p.add_argument("--warmup-fraction", type=float, default=0.04, help="share of the steps with linear warmup, before cosine decay")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps of the whole run")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu or cuda:N")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draft's initial weights, the batch order and the anchors")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations (loss and acceptance estimate)")
    p.add_argument("--eval-sequences", type=int, default=16, help="held-out sequences per evaluation")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between writes of OUT/checkpoint.pt")
    p.add_argument("--resume", action="store_true", help="continue exactly from OUT/checkpoint.pt (same settings and text)")
    p.add_argument("--init", default=None, metavar="DRAFT_DIR", help="start from the weights of a draft this command wrote "
                   "(its config must match these settings): fine-tuning on new text, or a second schedule after a finished run")
    p.add_argument("--stop-at", type=int, default=None, help="end this run after this step, leaving a checkpoint to --resume from")
    d2 = p.add_argument_group("DFlash2 (--arch dflash2; defaults are the published drafts')")
    d2.add_argument("--selector-top-k", type=int, default=16, help="candidates per block row the selector chooses among")
    d2.add_argument("--selector-rank", type=int, default=256, help="rank of the selector's pair term")
    d2.add_argument("--selector-weight", type=float, default=1.0, help="weight of the selector's loss beside the draft's")
    d2.add_argument("--conv-group-size", type=int, default=16, help="channels sharing one dynamic convolution coefficient")
    d2.add_argument("--sliding-window", type=int, default=0, help="context positions a block row attends to (0: all)")


def run(args: argparse.Namespace) -> int:
    import torch

    from splitspec.train.draft import DraftTrainConfig, train_draft

    if args.threads:
        torch.set_num_threads(args.threads)
    config = DraftTrainConfig(
        target=args.target, data=args.data, out=args.out, glob=args.glob, seq_len=args.seq_len,
        heldout_fraction=args.heldout_fraction, arch=args.arch, layers=args.layers, taps=args.taps, block_size=args.block_size,
        mask_token_id=args.mask_token_id, anchors=args.anchors, labels=args.labels, gamma=args.gamma, lr=args.lr,
        warmup_fraction=args.warmup_fraction, grad_clip=args.grad_clip, steps=args.steps, batch_size=args.batch_size,
        device=args.device, seed=args.seed, eval_every=args.eval_every, eval_sequences=args.eval_sequences,
        checkpoint_every=args.checkpoint_every, resume=args.resume, init=args.init, stop_at=args.stop_at,
        selector_top_k=args.selector_top_k, selector_rank=args.selector_rank, selector_weight=args.selector_weight,
        conv_group_size=args.conv_group_size, sliding_window=args.sliding_window,
    )
    result = train_draft(config)
    print(
        f"wrote {result.out_dir} after step {result.step}: held-out loss {result.heldout_loss:.4f}, "
        f"acceptance estimate {result.heldout_acceptance:.3f}, {result.steps_per_second:.2f} steps/s, {result.wall_time_s:.1f} s"
    )
    return 0
