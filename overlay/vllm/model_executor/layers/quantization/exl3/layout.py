# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the checkpoint tensors of one EXL3 layer land on this tensor-parallel rank.

A layer is one or more shards (q/k/v, gate/up) of one input. Each checkpoint module
covers one shard or several consecutive ones (Qwen3.5's `in_proj_qkv` is shards q, k
and v of vLLM's `in_proj_qkvz`): a covered shard is a column range of its module, and
a shard is a shard whichever module it comes from. Its parameters hold, per rank:

* `trellis` int16: the shards side by side along n, `[k_alloc/16, n_alloc/16, 16K]` when
  every shard has the same bitrate and codebook; otherwise a flat int16 buffer holding
  one such block per *run* (consecutive shards of equal bitrate and codebook), each run
  one kernel call;
* `suh` fp16 `[S, k_alloc]`, one row per shard; `svh` fp16 `[n_alloc]`.

Every allocated dim is a multiple of the 128-wide Hadamard block, so the kernel never
cuts a block. A column-parallel rank allocates, per shard, the 128-aligned window of
checkpoint blocks covering its columns (tp_rules.py) and keeps its own
`[keep, keep + width)` of it; when some shard keeps less than it computes, one
precomputed column index gathers what vLLM receives. A row split of k must fall on a
multiple of 128 (x is split there; no window can help). What a rank allocates beyond the
checkpoint (vLLM-added head/vocab padding, or the tail of a dim vLLM does not round) is
zero-filled with `svh = 0` / `suh = 0`, which makes it contribute exactly zero whatever
the trellis holds there. A module covering several shards gives each of them its window
of the module's columns (the shard's offset inside the module plus the rank's start), so
a shard boundary inside a 128-block costs a recomputed block, never a wrong column; each
covered shard gets its own copy of the module's `suh` row. Violations are errors naming
the module, the rank and the numbers.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from .format import (
    HADAMARD_SIZE,
    TILE,
    WORDS_PER_BIT,
    Codebook,
    Exl3FormatError,
    Exl3ModuleSpec,
    round_up,
)
from .tp_rules import (
    ColumnWindow,
    column_window,
    rank_column_window,
    row_split_error,
)


class Exl3LayoutError(Exl3FormatError):
    """The checkpoint cannot be placed on this rank as vLLM laid the layer out."""


class Split(Enum):
    """Which dim vLLM divides across tensor-parallel ranks."""

    NONE = "replicated"
    COLUMN = "column-parallel"  # output features (each shard's n)
    ROW = "row-parallel"  # input features (k)


def trellis_words(bits: float) -> int:
    """int16 words per 16x16 tile at this bitrate."""
    return int(WORDS_PER_BIT * bits)


@dataclass(frozen=True)
class ShardLayout:
    name: str  # checkpoint module key
    bits: float
    codebook: Codebook
    ckpt_rows: int  # k of the checkpoint tensor (padded to 128)
    ckpt_cols: int  # n of the checkpoint tensor (padded to 128)
    src_col: int  # first checkpoint column this rank computes (a multiple of 128)
    col: int  # first column of this shard in the layer's allocated output
    alloc: int  # columns computed for this shard (a multiple of 128)
    keep: int  # offset of the columns vLLM receives inside the shard's allocation
    width: int  # columns vLLM receives for this shard: [keep, keep + width)
    real_cols: (
        int  # checkpoint columns that are real outputs; svh is forced to 0 from here on
    )
    module: int = 0  # index of the checkpoint module this shard is a column range of

    @property
    def copy_cols(self) -> int:
        """Checkpoint columns that exist inside this rank's allocation; the rest stay
        zero."""
        return max(0, min(self.alloc, self.ckpt_cols - self.src_col))


@dataclass(frozen=True)
class KernelRun:
    """Consecutive shards sharing bitrate and codebook: one kernel call over their
    columns."""

    first: int  # shard index range [first, stop)
    stop: int
    col: int
    cols: int
    bits: float
    codebook: Codebook
    word_start: int  # the run's block inside the flat trellis storage
    word_stop: int
    shard_widths: tuple[int, ...]  # allocated columns per shard (kernel shard_widths)


@dataclass(frozen=True)
class Exl3Layout:
    prefix: str  # vLLM module name, for messages
    tp_rank: int
    k_width: int  # input features vLLM passes in
    k_alloc: int  # input features allocated (a multiple of 128)
    src_row: int  # first checkpoint input row this rank reads
    shards: tuple[ShardLayout, ...]
    runs: tuple[KernelRun, ...]

    @property
    def n_alloc(self) -> int:
        return sum(s.alloc for s in self.shards)

    @property
    def out_width(self) -> int:
        """Output columns returned to vLLM."""
        return sum(s.width for s in self.shards)

    @property
    def uniform(self) -> bool:
        return len(self.runs) <= 1

    @property
    def trellis_shape(self) -> tuple[int, ...]:
        if self.uniform:
            bits = self.shards[0].bits
            return (self.k_alloc // TILE, self.n_alloc // TILE, trellis_words(bits))
        return (self.runs[-1].word_stop,)

    @property
    def identity_output(self) -> bool:
        """Every shard keeps all it computes: the allocated output is what vLLM
        receives."""
        return all(s.keep == 0 and s.width == s.alloc for s in self.shards)

    def kept_columns(self) -> list[int] | None:
        """For each returned column, its column in the allocated output (the kept window
        of every shard, in shard order); None when the output is returned as computed.
        """
        if self.identity_output:
            return None
        return [
            c
            for s in self.shards
            for c in range(s.col + s.keep, s.col + s.keep + s.width)
        ]

    def copy_rows(self, shard: ShardLayout) -> int:
        """Checkpoint input rows that exist inside this rank's allocation."""
        return max(0, min(self.k_alloc, shard.ckpt_rows - self.src_row))

    def module_shards(self, module: int) -> tuple[int, ...]:
        """The shards (consecutive) that checkpoint module `module` covers."""
        return tuple(i for i, s in enumerate(self.shards) if s.module == module)

    def run_trellis(self, trellis: torch.Tensor, run: KernelRun) -> torch.Tensor:
        """Run `run`'s block [k_alloc/16, cols/16, 16 * bits] of the layer's
        `trellis` parameter (either shape of it: see trellis_shape)."""
        return trellis.view(-1)[run.word_start : run.word_stop].view(
            self.k_alloc // TILE, run.cols // TILE, trellis_words(run.bits)
        )

    def run_of(self, shard_index: int) -> KernelRun:
        for run in self.runs:
            if run.first <= shard_index < run.stop:
                return run
        raise IndexError(shard_index)


def _runs(k_alloc: int, shards: Sequence[ShardLayout]) -> tuple[KernelRun, ...]:
    runs: list[KernelRun] = []
    first, words = 0, 0
    for i in range(1, len(shards) + 1):
        if i < len(shards) and (shards[i].bits, shards[i].codebook) == (
            shards[first].bits,
            shards[first].codebook,
        ):
            continue
        group = shards[first:i]
        cols = sum(s.alloc for s in group)
        size = (k_alloc // TILE) * (cols // TILE) * trellis_words(group[0].bits)
        runs.append(
            KernelRun(
                first,
                i,
                group[0].col,
                cols,
                group[0].bits,
                group[0].codebook,
                words,
                words + size,
                tuple(s.alloc for s in group),
            )
        )
        first, words = i, words + size
    return tuple(r for r in runs if r.cols)


def _shard(
    spec: Exl3ModuleSpec,
    window: ColumnWindow,
    col: int,
    real_cols: int,
    module: int = 0,
) -> ShardLayout:
    return ShardLayout(
        spec.prefix,
        spec.bits,
        spec.codebook,
        spec.in_features,
        spec.out_features,
        window.first,
        col,
        window.alloc,
        window.keep,
        window.width,
        real_cols,
        module,
    )


def _check_fits(
    prefix: str, what: str, ckpt: int, vllm_total: int, rank: int, name: str
) -> None:
    """The checkpoint's (padded) dim against the layer's: the layer may be wider by
    whole blocks (vLLM padding) or narrower by less than one block (the format's own
    padding)."""
    if round_up(vllm_total, HADAMARD_SIZE) < ckpt:
        raise Exl3LayoutError(
            f"EXL3 {prefix} (rank {rank}): checkpoint {name} has {ckpt} {what} but the "
            "layer "
            f"has {vllm_total}; the checkpoint does not belong to this model "
            "configuration"
        )
    if vllm_total > ckpt and (vllm_total - ckpt) % HADAMARD_SIZE:
        raise Exl3LayoutError(
            f"EXL3 {prefix} (rank {rank}): the layer pads {name}'s {ckpt} {what} to "
            f"{vllm_total}; padding must be whole {HADAMARD_SIZE}-wide blocks after "
            "the "
            f"checkpoint's last block (got {vllm_total - ckpt})"
        )


def _compositions(total: int, parts: int):
    """Every way to cut `total` consecutive shards into `parts` non-empty runs."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def module_spans(
    prefix: str, specs: Sequence[Exl3ModuleSpec], totals: Sequence[int]
) -> tuple[int, ...]:
    """How many consecutive output shards each checkpoint module covers.

    One module per shard when the counts agree. With fewer modules than shards, a
    module covers the shards whose full widths (`totals`, all ranks) add up to its
    stored n once padded to 128, the way the format pads one projection; exactly one
    such cut must exist. The model's loader then names the shards of each module (a
    tuple shard id), and weights.py holds it to this cut.
    """
    if len(specs) == len(totals):
        return (1,) * len(specs)
    if len(specs) > len(totals):
        raise Exl3LayoutError(
            f"EXL3 {prefix}: {len(specs)} checkpoint modules for {len(totals)} output "
            f"shards ({', '.join(s.prefix for s in specs)})"
        )
    cuts = []
    for spans in _compositions(len(totals), len(specs)):
        first, fits = 0, True
        for spec, span in zip(specs, spans):
            covered = sum(totals[first : first + span])
            fits = fits and round_up(covered, HADAMARD_SIZE) == spec.out_features
            first += span
        if fits:
            cuts.append(spans)
    if len(cuts) != 1:
        stored = ", ".join(f"{s.prefix}: n={s.out_features}" for s in specs)
        why = "no" if not cuts else f"{len(cuts)} ways (ambiguous), not exactly one"
        raise Exl3LayoutError(
            f"EXL3 {prefix}: {len(specs)} checkpoint modules ({stored}) for "
            f"{len(totals)} output shards of widths {list(totals)}: {why} cut of the "
            f"shards into consecutive runs matches the stored widths (padded to "
            f"{HADAMARD_SIZE})"
        )
    return cuts[0]


def plan_linear(
    prefix: str,
    specs: Sequence[Exl3ModuleSpec],
    *,
    split: Split,
    tp_rank: int,
    tp_size: int,
    k_width: int,
    widths: Sequence[int],
    kv_replicas: Sequence[int] | None = None,
) -> Exl3Layout:
    """Layout of a (fused) linear on one rank.

    `specs` are the checkpoint modules in shard order, each covering one output shard
    or several consecutive ones (`module_spans`); `k_width`/`widths` are vLLM's per-rank
    input features and per-shard output features; `kv_replicas[s]` is how many ranks
    share shard s's slice (QKV's replicated KV heads).
    """
    if split is Split.ROW and (len(specs) != 1 or len(widths) != 1):
        raise Exl3LayoutError(
            f"EXL3 {prefix}: a row-parallel layer must have one shard"
        )
    replicas = list(kv_replicas) if kv_replicas is not None else [1] * len(widths)
    slices = [
        tp_size // replicas[s] if split is Split.COLUMN else 1
        for s in range(len(widths))
    ]
    spans = module_spans(prefix, specs, [w * n for w, n in zip(widths, slices)])
    k_ckpt = specs[0].in_features
    for spec in specs[1:]:
        if spec.in_features != k_ckpt:
            raise Exl3LayoutError(
                f"EXL3 {prefix}: fused shards have different input sizes "
                f"({specs[0].prefix}: k={k_ckpt}, {spec.prefix}: k={spec.in_features})"
            )

    if split is Split.ROW:
        why = row_split_error(k_width, tp_size)
        if why:
            raise Exl3LayoutError(f"EXL3 {prefix} (rank {tp_rank} of {tp_size}): {why}")
    k_total = k_width * (tp_size if split is Split.ROW else 1)
    _check_fits(prefix, "input features", k_ckpt, k_total, tp_rank, specs[0].prefix)
    src_row = tp_rank * k_width if split is Split.ROW else 0

    shards: list[ShardLayout] = []
    col, s = 0, 0
    for m, (spec, span) in enumerate(zip(specs, spans)):
        covered = range(s, s + span)
        _check_fits(
            prefix,
            "output features",
            spec.out_features,
            sum(widths[i] * slices[i] for i in covered),
            tp_rank,
            spec.prefix,
        )
        offset = 0  # the shard's first column inside its checkpoint module
        for i in covered:
            if split is Split.COLUMN:
                window = rank_column_window(widths[i], tp_rank, replicas[i], offset)
            else:
                window = column_window(offset, widths[i])
            shards.append(_shard(spec, window, col, spec.out_features, m))
            col += window.alloc
            offset += widths[i] * slices[i]
        s += span

    k_alloc = round_up(k_width, HADAMARD_SIZE)
    return Exl3Layout(
        prefix,
        tp_rank,
        k_width,
        k_alloc,
        src_row,
        tuple(shards),
        _runs(k_alloc, shards),
    )


def plan_lm_head(
    prefix: str,
    spec: Exl3ModuleSpec,
    *,
    tp_rank: int,
    hidden: int,
    vocab_start: int,
    vocab_per_rank: int,
    org_vocab: int,
) -> Exl3Layout:
    """Layout of a vocab-parallel lm_head on one rank.

    The vocab is the trellis' n. vLLM gives each rank `vocab_per_rank` columns starting
    at `vocab_start` (padded to 64, so generally not 128-aligned); the rank computes the
    window of checkpoint blocks covering its range and returns exactly its range (the
    column-parallel rule of tp_rules.py). Columns at or past `org_vocab` come out
    exactly zero.
    """
    if round_up(org_vocab, HADAMARD_SIZE) != spec.out_features:
        raise Exl3LayoutError(
            f"EXL3 {prefix} (rank {tp_rank}): checkpoint {spec.prefix} has "
            f"{spec.out_features} vocab columns, expected the model's vocab "
            f"{org_vocab} padded "
            f"to {round_up(org_vocab, HADAMARD_SIZE)}"
        )
    _check_fits(
        prefix, "input features", spec.in_features, hidden, tp_rank, spec.prefix
    )
    shard = _shard(spec, column_window(vocab_start, vocab_per_rank), 0, org_vocab)
    k_alloc = round_up(hidden, HADAMARD_SIZE)
    return Exl3Layout(
        prefix, tp_rank, hidden, k_alloc, 0, (shard,), _runs(k_alloc, [shard])
    )
