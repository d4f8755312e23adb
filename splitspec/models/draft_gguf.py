"""Draft GGUF files in llama.cpp's ``dflash`` layout (docs/dflash2.md, GGUF): DFlash drafts and,
with a candidate selector (``selector_hidden.weight``), DFlash2 drafts.

Two GGUF layouts of DFlash drafts exist. lucebox's converter keeps the target's architecture name
and writes ``dflash.fc.weight`` plus ``ARCH.dflash.*`` keys (read by ``loader.dflash_config_from_gguf``).
llama.cpp's converter names the architecture ``dflash`` itself and writes the tensors and keys read
here:

- keys ``dflash.embedding_length``, ``feed_forward_length``, ``block_count``,
  ``attention.head_count(_kv)``, ``attention.key_length``, ``attention.layer_norm_rms_epsilon``,
  ``rope.freq_base``, ``block_size``, ``target_layers``, and for DFlash2 ``conv_kernel_size``,
  ``conv_group_size``, ``selector_rank``, ``selector_top_k``, ``attention.sliding_window`` with
  ``attention.sliding_window_pattern`` (one flag per layer), ``logit_scale`` and
  ``final_logit_softcapping``; the mask token is ``tokenizer.ggml.mask_token_id``;
- ``target_layers`` counts layer *inputs*: entry ``t`` is the output of the target's decoder layer
  ``t - 1`` (the embedding is input 0), so a tap id here is ``t - 1``. An older converter wrote the
  layer ids themselves; such a file cannot be told apart and is read one layer late.
- tensors ``fc.weight``, ``enc.output_norm.weight`` (the taps' norm), ``output_norm.weight``,
  ``blk.N.*`` as a target's layers, ``blk.N.{attn,ffn}_conv_base`` and
  ``blk.N.{attn,ffn}_conv_proj.weight`` (the convolutions before and after each sublayer),
  ``selector_hidden.weight`` and the two codebooks ``selector_{predecessor,successor}.weight``.
"""

from __future__ import annotations

from splitspec.models.dflash import DFlashConfig
from splitspec.models.dflash2 import DFlash2Config
from splitspec.models.gguf_file import GGUFFile, ModelFileError

ARCH = "dflash"
# GGUF tensor name -> draft module parameter name, for the top-level tensors.
GLOBAL_NAMES = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "hidden_norm.weight",
    "output_norm.weight": "norm.weight",
    "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
    "selector_predecessor.weight": "candidate_selector.predecessor_codebook",
    "selector_successor.weight": "candidate_selector.successor_codebook",
}
SELECTOR_TENSOR = "selector_hidden.weight"


def shape_fields(f: GGUFFile, arch: str) -> dict:
    """A draft config's shape fields from either GGUF layout's ``arch.*`` keys (the KV heads default
    to the heads, the head size to hidden / heads, eps to 1e-6, RoPE theta to 1e6)."""
    hidden, heads = int(f.get(f"{arch}.embedding_length")), int(f.get(f"{arch}.attention.head_count"))
    return dict(
        hidden_size=hidden,
        intermediate_size=int(f.get(f"{arch}.feed_forward_length")),
        num_layers=int(f.get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(f.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 1_000_000.0)),
    )


def is_llama_dflash(f: GGUFFile) -> bool:
    return f.architecture == ARCH


def llama_dflash_config(f: GGUFFile) -> DFlashConfig:
    """The draft's config: a ``DFlash2Config`` when the file has a candidate selector."""
    def key(name, default=None, required=True):
        value = f.get(f"{ARCH}.{name}", default)
        if value is None and required:
            raise ModelFileError(f"{f.path}: no {ARCH}.{name} (a draft in llama.cpp's dflash layout needs it)")
        return value

    num_layers = int(key("block_count"))
    inputs = [int(t) for t in key("target_layers")]
    if min(inputs, default=0) < 1:
        raise ModelFileError(f"{f.path}: {ARCH}.target_layers {inputs} count layer inputs from the embedding (0); a tap needs 1 or more")
    if f.get(f"{ARCH}.attention.causal", False):
        raise ModelFileError(f"{f.path}: {ARCH}.attention.causal is true; DFlash blocks are non-causal")
    mask = f.get("tokenizer.ggml.mask_token_id", None)
    if mask is None:
        raise ModelFileError(f"{f.path}: no tokenizer.ggml.mask_token_id (the draft's mask token)")
    fields = dict(
        **shape_fields(f, ARCH), block_size=int(key("block_size")), mask_token_id=int(mask),
        target_layer_ids=tuple(t - 1 for t in inputs),
    )
    if not f.has_tensor(SELECTOR_TENSOR):
        return DFlashConfig(**fields, vocab_size=None)
    window = int(key("attention.sliding_window", 0, required=False))
    pattern = [bool(p) for p in key("attention.sliding_window_pattern", [True] * num_layers if window else [], required=False)]
    if window and (len(pattern) != num_layers or len(set(pattern)) > 1):
        raise ModelFileError(
            f"{f.path}: {ARCH}.attention.sliding_window_pattern {pattern} must give one kind of attention to all {num_layers} layers"
        )
    config = DFlash2Config(
        **fields,
        vocab_size=f.tensor_shape("selector_predecessor.weight")[0],
        conv_kernel_size=int(key("conv_kernel_size")),
        conv_group_size=int(key("conv_group_size")),
        selector_rank=int(key("selector_rank")),
        selector_top_k=int(key("selector_top_k")),
        sliding_window=window if window and pattern[0] else 0,
        output_multiplier=float(key("logit_scale", 1.0)),
        final_logit_softcapping=float(key("final_logit_softcapping", 0.0)),
    )
    try:
        config.check(str(f.path))
    except ValueError as exc:
        raise ModelFileError(str(exc)) from exc
    return config
