"""Memory plans: what a worker's device memory will hold, part by part, checked against a cap
before the big pools are allocated.

Terms:

- **cap** (``--memory-cap-gb``, in GiB of 2^30 bytes): the device memory a worker may use. On
  CUDA, torch's caching allocator is held to it (``torch.cuda.set_per_process_memory_fraction``,
  set before the weights load); on a CPU nothing enforces it, and it is a budget the plan is
  checked against (which is how the CPU tests exercise a refusal).
- **budget**: the cap less a **headroom** of 1/24 of the cap, at most 1 GiB, for what no plan
  sees: cuBLAS and Triton workspaces, the allocator's rounding and fragmentation, tensors of a
  few KB. A 24 GiB cap leaves a 23 GiB budget (the figures of issue #17).
- **parts** of a plan, in bytes:

  - *weights*: the parameters and buffers of the loaded modules as they are (GGUF blocks kept
    quantized are buffers), measured, not predicted; a draft adds its own copies of the target's
    embedding and LM head. A tensor behind two names (tied embeddings, fused projections) counts once.
  - *KV cache*: the target's paged pool, ``--max-kv-tokens`` in whole blocks plus the pad block.
  - *state slots*: a hybrid target's conv window and recurrent state per sequence, for
    ``--max-sequences`` slots plus the pad slot (``Qwen35Slots``).
  - *tree buffers*: a hybrid target's conv input and delta-rule inputs (``qwen35.TreeRows``: its
    commit recomputes the accepted path's state from them) for every row of
    the largest verify pass (its sequences' largest trees plus roots), twice: the last pass's
    candidates stay referenced (``Qwen35Slots.pending``) while the next pass makes its own.
  - *workspace*: activations of the largest pass, a tile of weights expanded from their blocks
    (``native.gguf_expand``: prompt chunks and other passes of many rows) and the outputs that
    captured CUDA graphs keep, an estimate whose basis the plan states (below, and in its log lines).
  - *context slots*: the draft's pooled context K/V (``services.draft.graphs.BlockGraphs``).

The workspace estimate: a row of a pass holds at most ``8 x hidden + 3 x intermediate`` values
of the compute dtype live at once (the residual stream, norms, mixer and MLP outputs, tap
features; the MLP's gate, up and product), plus, where it is projected to logits, ``vocab`` values
in the compute dtype and two float32 copies (the logits, and a sampling or log-softmax copy).
Decode and verify attention reads keys in place (``native/paged_attention``), as it does on
GPUs; a prompt chunk's attention gathers its sequence's keys and values and masks them
(``_prompt_attention_bytes``), for a context as long as the KV cache. A
target's prompt features go to the host chunk by chunk (``TargetEngine._prefill``), so its prompt
pass holds one chunk's; the draft projects a prompt's features a chunk at a time (``APPEND_CHUNK``)
and holds its keys and values twice (joined, then appended). A target's captured graphs write
their float32 logits and tap features into buffers of the runner, as many rows as the largest
pass captured at start (``PassRunner.warm_up``: tree passes, and prompt chunks, whose logits are
one row), which no graph captured later exceeds; on CUDA the target logs what torch has reserved
once warm-up is over.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES
from torch import nn

from native import gguf_expand
from native.gguf_matmul import QuantLinear
from services.draft.engine import APPEND_CHUNK
from services.target.engine import TargetLimits
from services.target.graphs import (
    PREFILL_BUCKETS,
    PREFILL_CHUNK,
    ROW_BUCKETS,
    WARM_BLOCKS,
    bucket,
    pass_row_limit,
    recurrent_pass_rows,
    warm_up_passes,
)
from services.worker.batching import StepBatcher
from splitspec.models.layers import FusedLinear
from splitspec.models.qwen35 import Qwen35Config, tree_row_bytes

logger = logging.getLogger(__name__)

GiB = 1 << 30
MAX_HEADROOM = GiB
# Taps of a target the plan assumes a draft asks for: the published DFlash drafts (z-lab's for
# Qwen3-8B and Qwen3.5-27B) read five target layers.
PLAN_TAPS = 5
# Steps of at most this many sequences share a pass (the batcher's own default, read here so
# the plan follows it).
PASS_SEQUENCES = inspect.signature(StepBatcher.__init__).parameters["max_batch"].default

# Each part's label in the log, in the log's order; then, per worker, what lowers each part.
LABELS = {
    "weights": "weights", "kv_cache": "KV cache", "state_slots": "state slots", "tree_buffers": "tree buffers",
    "context_slots": "context slots", "workspace": "workspace",
}
REMEDIES = {
    "target": {
        "weights": "a smaller model or quantization, or --keep-quantized on to keep GGUF Q8_0/Q4_K/Q6_K blocks as they are",
        "kv_cache": "lower --max-kv-tokens",
        "state_slots": "lower --max-sequences, or --state-dtype bfloat16",
        "tree_buffers": "lower --max-tree-nodes or --max-sequences, or --state-dtype bfloat16",
        "workspace": "lower --max-tree-nodes or --max-sequences, or --max-kv-tokens for shorter prompts' tap features",
    },
    "draft": {
        "weights": "a smaller draft, a narrower --dtype, or --keep-quantized on",
        "context_slots": "lower --graph-sequences or --graph-context",
        "workspace": "lower --max-sequences, or --graph-context for shorter prompts' tap features",
    },
}


class MemoryPlanError(ValueError):
    """A configuration whose plan does not fit its cap (the CLI prints it as one line, exit 2)."""


def cap_bytes(gb: float) -> int | None:
    """``--memory-cap-gb`` in bytes; None for 0 (no cap)."""
    if gb < 0:
        raise MemoryPlanError(f"--memory-cap-gb {gb:g}: a cap cannot be negative (0 = no cap)")
    return int(gb * GiB) if gb else None


def headroom(cap: int) -> int:
    """What a ``cap`` keeps back for what no plan sees: a 24th of it, at most ``MAX_HEADROOM``."""
    return min(MAX_HEADROOM, cap // 24)


UNITS = (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10))


def unit_of(nbytes: int) -> tuple[str, int]:
    """The largest unit of which ``nbytes`` is at least one (KiB at least)."""
    return next(((name, scale) for name, scale in UNITS if abs(nbytes) >= scale), UNITS[-1])


def size(nbytes: int, unit: tuple[str, int] | None = None) -> str:
    """``12.34 GiB``, ``144.38 MiB``: in ``unit``, else the largest that keeps the figure at least one."""
    name, scale = unit or unit_of(nbytes)
    return f"{nbytes / scale:.2f} {name}"


@dataclass
class MemoryPlan:
    """The device bytes a worker will hold, by part (see the module docstring), and its cap."""

    worker: str  # "target" or "draft": whose flags a refusal names
    weights: int = 0
    kv_cache: int = 0
    state_slots: int = 0
    tree_buffers: int = 0
    workspace: int = 0
    context_slots: int = 0
    cap: int | None = None  # bytes; None = no cap
    basis: dict[str, str] = field(default_factory=dict)  # part -> how its figure was found

    @property
    def parts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in LABELS}

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def budget(self) -> int | None:
        """What the parts may add up to: the cap less its headroom."""
        return None if self.cap is None else self.cap - headroom(self.cap)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    def describe(self) -> str:
        """The plan as one readable block: GiB per part with its basis, the total and the cap."""
        unit = unit_of(max(self.total, self.cap or 0))  # one unit down the column: GiB but for tiny models
        lines = [f"{self.worker} memory plan:"]
        for name, nbytes in self.parts.items():
            if nbytes or name == "weights":
                lines.append(f"  {LABELS[name]:<14}{size(nbytes, unit):>12}  {self.basis.get(name, '')}".rstrip())
        lines.append(f"  {'total':<14}{size(self.total, unit):>12}")
        if self.cap is None:
            lines.append("  no cap (--memory-cap-gb 0)")
        else:
            verdict = "fits" if self.fits else f"over by {size(self.total - self.budget, unit)}"
            lines.append(
                f"  cap {size(self.cap, unit)} (--memory-cap-gb {self.cap / GiB:.4g}), budget {size(self.budget, unit)} "
                f"after {size(headroom(self.cap), unit)} of headroom: {verdict}"
            )
        return "\n".join(lines)

    def check(self) -> None:
        """Raise :class:`MemoryPlanError` when the parts exceed the budget, naming every part
        (largest first) with the flags that lower it."""
        if self.fits:
            return
        remedies = REMEDIES[self.worker]
        named = sorted(((nbytes, name) for name, nbytes in self.parts.items() if nbytes), reverse=True)
        # Parts under a twentieth of the total would not make the difference: left out of the advice.
        advice = "; ".join(
            f"{LABELS[name]} {size(nbytes)}: {remedies[name]}" for nbytes, name in named if nbytes >= self.total // 20
        )
        raise MemoryPlanError(
            f"the {self.worker} needs {size(self.total)}, over the {size(self.budget)} budget of --memory-cap-gb "
            f"{self.cap / GiB:.4g} ({size(headroom(self.cap))} kept as headroom). {advice}; or raise --memory-cap-gb"
        )


def tensor_bytes(*owners: nn.Module | torch.Tensor) -> int:
    """Bytes of the distinct storages behind the parameters and buffers of the given modules and
    the given tensors: a tensor seen under two names, or views of one storage (fused projections),
    count once."""
    seen: set = set()
    total = 0
    for owner in owners:
        tensors = [*owner.parameters(), *owner.buffers()] if isinstance(owner, nn.Module) else [owner]
        for t in tensors:
            if t.device.type == "meta":  # no storage address: only the same tensor is shared
                key, nbytes = id(t), t.nbytes
            else:
                storage = t.untyped_storage()
                key, nbytes = (t.device, storage.data_ptr()), storage.nbytes()
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def _row_bytes(hidden: int, intermediate: int, itemsize: int) -> int:
    """Activation bytes one row of a pass holds live at most (see the module docstring)."""
    return (8 * hidden + 3 * intermediate) * itemsize


def _logits_row_bytes(vocab: int, itemsize: int) -> int:
    return vocab * (itemsize + 8)


def _prompt_attention_bytes(c, chunk: int, context: int, itemsize: int) -> int:
    """What one attention layer holds for a prompt chunk of ``chunk`` rows over ``context``
    positions (``layers.QKVProjection.attend_paged``'s gathered path): the keys and values gathered
    out of their blocks, the chunk's boolean mask, and the additive mask in the compute dtype that
    the fused kernel builds from it."""
    return 2 * context * c.num_kv_heads * c.head_dim * itemsize + chunk * context * (1 + itemsize)


def graph_output_rows(sequences: int, max_rows: int = ROW_BUCKETS[-1], blocks: tuple[int, ...] = WARM_BLOCKS) -> int:
    """Rows of the output buffers that the graphs captured by ``PassRunner.warm_up(sequences, blocks)``
    write to (``PassRunner.capture_rows``): its largest pass, rows padded to a bucket."""
    if sequences <= 0:
        return 0
    return max((bucket(n * rows, ROW_BUCKETS) for _, rows, n in warm_up_passes(sequences, max_rows, blocks)), default=0)


def prompt_graph_rows(prefill_chunk: int) -> int:
    """Rows of the largest prompt chunk that ``PassRunner.warm_up`` captures for chunks of
    ``prefill_chunk`` rows (``TargetEngine.prompt_chunk``), padded to its bucket: the most rows of
    features a prompt graph writes."""
    return bucket(min(prefill_chunk, PREFILL_CHUNK), PREFILL_BUCKETS)


def expand_tile_bytes(model: nn.Module, itemsize: int) -> int:
    """The most expanded weight a matmul of many rows holds at once (``native.gguf_expand``): a
    tile of the largest kept-quantized weight (fused ones too), up to ``TILE_BYTES``; 0 where none
    is kept."""
    shapes = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, QuantLinear)]
    for module in model.modules():
        for fused in vars(module).values():
            if isinstance(fused, FusedLinear) and fused.qtype is not None:
                block_values, block_bytes = GGML_QUANT_SIZES[fused.qtype]
                shapes.append((fused.out_features, fused.weight.shape[1] // block_bytes * block_values))
    return max((gguf_expand.tile_rows(n, k, itemsize) * k * itemsize for n, k in shapes), default=0)


def target_plan(
    model: nn.Module, config, dtype: torch.dtype, limits: TargetLimits, warm_up_sequences: int = 0, cap: int | None = None,
    warm_up_blocks: tuple[int, ...] = WARM_BLOCKS,
) -> MemoryPlan:
    """The plan of a target ``model`` (loaded, or on the meta device) serving ``limits``, computing
    in ``dtype``; ``warm_up_sequences``: the batch the engine's captured graphs are warmed up for
    (0 when passes are not captured as graphs) with ``warm_up_blocks`` rows per sequence."""
    c, itemsize = config, dtype.itemsize
    hybrid = isinstance(config, Qwen35Config)
    plan = MemoryPlan("target", cap=cap)
    plan.weights = tensor_bytes(model)
    plan.basis["weights"] = "parameters and buffers as loaded"

    per_position = model.position_bytes(config, dtype)
    blocks = -(-limits.max_kv_tokens // limits.block_size) + 1  # + the pad block, as TargetEngine allocates
    plan.kv_cache = blocks * limits.block_size * per_position
    plan.basis["kv_cache"] = f"{limits.max_kv_tokens:,} positions (+ pad block) x {size(per_position)}"

    pass_sequences = min(limits.max_sequences, PASS_SEQUENCES)
    tree_rows = pass_sequences * (limits.max_tree_nodes + 1)
    if hybrid:
        state_dtype = model.recurrent_dtype(dtype)
        state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * state_dtype.itemsize
        slot = c.num_linear_layers * ((c.conv_kernel - 1) * c.conv_channels * itemsize + state)
        plan.state_slots = (limits.max_sequences + 1) * slot
        plan.basis["state_slots"] = f"({limits.max_sequences} + 1 pad) slots x {size(slot)} ({str(state_dtype).removeprefix('torch.')} states)"
        candidate = tree_row_bytes(config, dtype)  # a row's K/V goes to the KV cache
        plan.tree_buffers = 2 * tree_rows * candidate
        plan.basis["tree_buffers"] = (
            f"2 passes x {tree_rows} rows ({pass_sequences} x {limits.max_tree_nodes + 1}) x {size(candidate)} (conv + delta-rule inputs)"
        )
        if warm_up_sequences:  # captured passes write theirs into rows reserved once (PassRunner)
            reserved = recurrent_pass_rows(limits.max_sequences)
            plan.tree_buffers += reserved * candidate
            plan.basis["tree_buffers"] += f", + {reserved} rows reserved for the captured passes"

    taps = min(PLAN_TAPS, c.num_layers)
    row = _row_bytes(c.hidden_size, c.intermediate_size, itemsize)
    feature_row = taps * c.hidden_size * itemsize
    verify = tree_rows * (row + _logits_row_bytes(c.vocab_size, itemsize) + feature_row)
    if hybrid:  # the tree kernel's scratch: every row's state, one layer at a time
        verify += tree_rows * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * state_dtype.itemsize
    prompt_attention = _prompt_attention_bytes(c, limits.prefill_chunk, limits.max_kv_tokens, itemsize)
    prefill = limits.prefill_chunk * (row + feature_row) + _logits_row_bytes(c.vocab_size, itemsize) + prompt_attention
    expanded = expand_tile_bytes(model, itemsize)
    graph_rows = graph_output_rows(warm_up_sequences, pass_row_limit(hybrid, limits.max_sequences), warm_up_blocks)
    # Warm-up's prompt chunks write one row of logits and a chunk of features.
    prompt_rows = prompt_graph_rows(limits.prefill_chunk) if graph_rows else 0
    feature_rows = max(graph_rows, prompt_rows)
    outputs = (graph_rows + (prompt_rows > 0)) * c.vocab_size * 4 + feature_rows * feature_row
    plan.workspace = max(verify, prefill) + expanded + outputs
    plan.basis["workspace"] = (
        f"estimate: the larger of a verify pass of {tree_rows} rows ({size(verify)}) and a prompt chunk of "
        f"{limits.prefill_chunk} rows with {taps} taps' features and its attention over {limits.max_kv_tokens:,} positions ({size(prefill)})"
        + (f", + {size(expanded)} of weights expanded from their blocks for many rows" if expanded else "")
        + (f", + {graph_rows} rows of logits and {feature_rows} of features the captured graphs write to" if graph_rows else "")
    )
    return plan


def draft_plan(
    model: nn.Module, embed: torch.Tensor | nn.Module, lm_head: torch.Tensor | nn.Module, slots: int, context: int, max_sequences: int,
    cap: int | None = None,
) -> MemoryPlan:
    """The plan of a DFlash ``model`` with the target's ``embed`` and ``lm_head``, ``slots`` context
    slots of ``context`` positions (``--graph-sequences``, ``--graph-context``) and at most
    ``max_sequences`` live contexts. Contexts beyond the slots grow on demand, outside the plan."""
    c = model.config
    dtype = next(model.parameters()).dtype
    # The embedding is a tensor [vocab, hidden], or a module keeping its GGUF blocks.
    itemsize, vocab = dtype.itemsize, getattr(embed, "num_embeddings", None) or embed.shape[0]
    plan = MemoryPlan("draft", cap=cap)
    plan.weights = tensor_bytes(model, embed, lm_head)
    plan.basis["weights"] = "draft parameters and buffers + the target's embedding and LM head, as loaded"
    if slots:
        # BlockGraphs' pool: per layer K and V [H_kv, slots * context + B, D] (B: the scratch region).
        plan.context_slots = c.num_layers * 2 * c.num_kv_heads * (slots * context + c.block_size) * c.head_dim * itemsize
        plan.basis["context_slots"] = f"{slots} x {context:,} positions x {size(c.num_layers * 2 * c.num_kv_heads * c.head_dim * itemsize)}"
    pass_sequences = min(max_sequences, PASS_SEQUENCES)
    rows = pass_sequences * c.block_size
    block = rows * _row_bytes(c.hidden_size, c.intermediate_size, itemsize) + pass_sequences * (c.block_size - 1) * _logits_row_bytes(vocab, itemsize)
    # A prompt's features arrive at once and are projected a chunk at a time (APPEND_CHUNK rows:
    # their features, fc and norm outputs); its keys and values are joined, then appended.
    chunk = min(context, APPEND_CHUNK)
    append = chunk * (c.num_taps + 3) * c.hidden_size * itemsize + 2 * c.num_layers * 2 * c.num_kv_heads * context * c.head_dim * itemsize
    plan.workspace = max(block, append)
    plan.basis["workspace"] = (
        f"estimate: the larger of a pass of {pass_sequences} x {c.block_size} rows ({size(block)}) and a prompt of "
        f"{context:,} positions appended in chunks of {chunk} ({size(append)})"
    )
    return plan


def most_kv_tokens(plan_at: Callable[[int], MemoryPlan], tokens: int, block_size: int) -> int:
    """``tokens`` KV positions when their plan (``plan_at(positions)``) fits its budget, else the
    most whole blocks below that whose plan fits; one block when none does (its plan then refuses,
    naming what to lower). The plan grows with the positions, so a bisection finds them."""
    if plan_at(tokens).fits:
        return tokens
    low, high = 1, max(1, tokens // block_size)  # in blocks
    while low < high:
        mid = (low + high + 1) // 2
        if plan_at(mid * block_size).fits:
            low = mid
        else:
            high = mid - 1
    return low * block_size


def apply_cap(device: torch.device, cap: int | None) -> None:
    """Hold torch's allocator on ``device`` to ``cap`` bytes (CUDA; a CPU's cap is the plan's only)."""
    if cap is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if cap >= total:
        logger.warning("--memory-cap-gb %.2f is not below the %.2f GiB of %s: nothing to hold the allocator to", cap / GiB, total / GiB, device)
        return
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    logger.info("memory cap: torch may allocate %.2f GiB of the %.2f GiB of %s", cap / GiB, total / GiB, device)


def out_of_memory(worker: str, cap: int, exc: BaseException) -> MemoryPlanError:
    """The error for a load that ran out of a capped device."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return MemoryPlanError(
        f"the {worker}'s weights did not load within --memory-cap-gb {cap / GiB:g}: {first}; "
        "raise --memory-cap-gb, or load a smaller model or quantization"
    )
