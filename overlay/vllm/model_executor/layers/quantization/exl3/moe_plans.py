# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What one call of an EXL3 MoE layer's CUDA kernel runs: its path, row block, k-splits
and math engine (`select_moe_call`).

Paths (`Exl3MoEPath`), by routed rows per expert (tokens x top-k / global experts):

* PAIRS, up to `pairs_max_pairs_per_expert`: every routed pair its own 16-row block of
  the grouped GEMM, laid out by the op itself (no alignment launches);
* ALIGNED, between: vLLM's `moe_align_block_size`, then the grouped GEMM in row blocks
  of the tier that decodes the least under uniform routing (`block_size`);
* RECONSTRUCT, from `reconstruct_min_rows_per_expert` (when the layer's experts fit
  the reconstruct scratch): every local expert reconstructed to the activation dtype,
  then vLLM's own fused MoE.

The decode tiers (16 and 32 rows) split k when few blocks would leave SMs idle
(`moe_splits`); the 64- and 128-row blocks run on Hopper's wgmma where the op can
(`wgmma_mode`). Every choice is a pure function of host-known shapes and the device,
never of the routing itself, so every replay of a captured graph and every process
runs the same calls. The numbers the rules compare against are data,
`Exl3MoEThresholds` (each field with the measurement behind it); tests and benchmarks
fix a choice through `Exl3MoEOverrides`, which vLLM's layers never set.
"""

import enum
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .moe_ops import (
    BLOCK_SIZES,
    GATE_UP_ROLES,
    PAIRS_BLOCK_SIZE,
    SPLIT_BLOCK_SIZES,
    STAGE_K,
    WGMMA_AUTO,
    WGMMA_FORCE,
    WGMMA_NEVER,
)


class Exl3MoEPath(enum.Enum):
    """How one call runs the routed experts (the module docstring)."""

    PAIRS = "pairs"
    ALIGNED = "aligned"
    RECONSTRUCT = "reconstruct"


@dataclass(frozen=True)
class Exl3MoEThresholds:
    """The measured numbers the path and split rules compare against."""

    # The pairs layout costs a re-read of an expert's trellis for every pair of the
    # batch that shares it: a uniform routing of P pairs over E experts reaches
    # E (1 - (1 - 1/E)^P) ~ P - P^2 / (2E) distinct experts, so it reads about P / (2E)
    # more trellis than the aligned one, and its first gate/up launch gives up the
    # prefetch overlap with the input transform; it saves vLLM's alignment (a memset and
    # two kernels, 4.9 µs of GPU time plus their launch gaps on an H200 for
    # Qwen3-30B-A3B at one token, torch.profiler). Measured (design notes, "MoE grouped
    # GEMM: the few-token path"; bench_moe.py rows exl3_pairs and exl3_aligned on four
    # layer shapes): faster or level at every point up to P = E / 8, mixed at E / 4
    # (faster for Qwen3-30B-A3B and Qwen3-235B-A22B, not for GLM-4.5-Air), slower
    # everywhere from E / 2. So up to an eighth of a routed pair per expert (top-8 of
    # 128 experts: 2 tokens; of 256, DeepSeek-V3: 4), where the excess read is at most
    # 6.5 %.
    pairs_max_pairs_per_expert: float = 0.125
    # The reconstruct writes every local expert's weights once per call (Qwen3-30B-A3B:
    # 1.2 GB per layer), which pays only once each expert's rows fill several of the
    # grouped GEMM's 128-row blocks, each of which decodes the expert's whole trellis
    # again. Three 128-row blocks: between the H200 crossings of the two paths
    # (bench_moe.py rows exl3 and exl3_reconstruct, 4 bits; design notes: MoE
    # large-batch path), about 290 rows for Qwen3-30B-A3B and 380 for GLM-4.5-Air.
    reconstruct_min_rows_per_expert: int = 384
    # The reconstruct scratch (one per device, shared by every layer, reserved at load
    # so vLLM's memory profiling counts it) takes at most this fraction of device
    # memory: a layer whose local experts need more keeps the grouped GEMM at every
    # batch size (DeepSeek-V3 at TP=1: 22.5 GB; Qwen3-235B-A22B: 4.8 GB, 3.4 % of an
    # H200).
    reconstruct_scratch_max_fraction: float = 0.05
    # A k-split shorter than this many 64-deep stages costs more (pipeline fill, its
    # fp32 partial rows and their sum) than spreading the trellis over more SMs gains:
    # the H200 bench lost with 16-stage splits and gained with 21-stage ones (design
    # notes, "MoE grouped GEMM: the few-token path").
    split_min_stages: int = 20


MOE_THRESHOLDS = Exl3MoEThresholds()


@dataclass(frozen=True)
class Exl3MoEOverrides:
    """Choices fixed for every call instead of the rules' (None: the rule), for tests
    and benchmarks, passed to the CUDA kernel's constructor."""

    # RECONSTRUCT needs the reconstruct scratch reserved for the layer.
    path: Exl3MoEPath | None = None
    # (gate_up, down) k-splits at the decode tiers, each capped at its k's stages;
    # (1, 1) is the unsplit kernel.
    splits: tuple[int, int] | None = None
    # True: Hopper's wgmma for the grouped GEMMs (an error where the op cannot run
    # it); False: mma.sync.
    wgmma: bool | None = None
    # The aligned layout's row block (one of BLOCK_SIZES) instead of block_size's.
    block: int | None = None

    def __post_init__(self) -> None:
        if self.block is not None and self.block not in BLOCK_SIZES:
            raise ValueError(
                f"Exl3MoEOverrides.block = {self.block}: not a row block of the "
                f"grouped GEMM ({', '.join(map(str, BLOCK_SIZES))})"
            )


NO_OVERRIDES = Exl3MoEOverrides()


class Exl3MoECallShape(NamedTuple):
    """What the rules read of one call: host-known shapes, never the routing."""

    tokens: int
    top_k: int
    global_experts: int
    local_experts: int
    hidden: int
    width: int  # the per-rank expert width
    # The largest 2 * bits of gate/up and of down: they set the GEMMs' shared memory.
    k2s: tuple[int, int]


class Exl3MoECall(NamedTuple):
    """What one call runs. block, splits and wgmma are the op's arguments (PAIRS and
    ALIGNED; RECONSTRUCT runs no grouped GEMM and leaves them at 0, (1, 1), auto)."""

    path: Exl3MoEPath
    block: int
    splits: tuple[int, int]
    wgmma: int


def pairs_layout(
    tokens: int,
    top_k: int,
    global_experts: int,
    thresholds: Exl3MoEThresholds = MOE_THRESHOLDS,
) -> bool:
    """Whether `tokens` x top-k routed pairs are few enough for the pairs layout."""
    return (
        0
        < tokens * top_k
        <= thresholds.pairs_max_pairs_per_expert * max(global_experts, 1)
    )


def reconstructs(
    tokens: int,
    top_k: int,
    global_experts: int,
    thresholds: Exl3MoEThresholds = MOE_THRESHOLDS,
) -> bool:
    """Whether `tokens` x top-k routed rows are enough for the reconstruct path."""
    return tokens * top_k >= thresholds.reconstruct_min_rows_per_expert * max(
        global_experts, 1
    )


# Instructions the grouped GEMM's k loop issues per decoded weight at each row block,
# relative to the 16-row block's: the mma.sync kernels' SASS (sass_loop.py, sm_90a,
# 4 bits: MCG 6.15 / 6.59 / 7.40 / 9.34, MUL1 5.73 / 6.10 / 6.91 / 8.85, so within 3 %
# of one ratio). They include the MMAs and activation loads of the block's padded rows.
# Hopper's wgmma issues fewer for the 64- and 128-row blocks (6.89 at MCG); the rule
# keeps the mma.sync costs there, which leans it towards smaller blocks. The 128-row
# tier's count (1.52) is raised to 1.78 by measurement (H200, bench_moe.py
# --block-sweep 64 128): at 64 rows per expert 64-row blocks were 2.5-6.3 % faster on
# three of the four bench layers, at 128 rows 128-row blocks 3.4-8.5 % faster on three.
# 1.78 puts the switch at 64.4 rows and stays below 1.80, from which the rule would fall
# back to 64-row blocks near 140 rows (two 128-row blocks against three 64-row ones).
BLOCK_DECODE_COST = {16: 1.00, 32: 1.07, 64: 1.20, 128: 1.78}
# The expected block counts sum R's distribution up to this many standard deviations
# above its mean (and one row); the terms left out are below the sum's own rounding.
BLOCK_TAIL_SIGMAS = 12


@functools.lru_cache(maxsize=1024)
def expected_blocks_per_expert(
    tokens: int, top_k: int, global_experts: int
) -> tuple[float, ...]:
    """E[ceil(R / b)] for each b of BLOCK_SIZES, R the rows one expert gets when the
    `tokens` x top-k routes (a token's top-k experts distinct) fall uniformly on the
    experts: R ~ Binomial(tokens, top-k / experts). Summed as the P(R > j b) over
    j >= 0; cached, since every MoE layer of a step asks for the same token count."""
    p = min(top_k, global_experts) / max(global_experts, 1)
    if tokens <= 0:
        return tuple(0.0 for _ in BLOCK_SIZES)
    if p >= 1.0:
        return tuple(float(math.ceil(tokens / b)) for b in BLOCK_SIZES)
    mean, sd = tokens * p, math.sqrt(tokens * p * (1.0 - p))
    top = min(tokens, math.ceil(mean + BLOCK_TAIL_SIGMAS * sd) + 1)
    log_p, log_q, lg_n = math.log(p), math.log1p(-p), math.lgamma(tokens + 1)
    above = []  # above[r] = P(R > r)
    cdf = 0.0
    for r in range(top + 1):
        cdf += math.exp(
            lg_n
            - math.lgamma(r + 1)
            - math.lgamma(tokens - r + 1)
            + r * log_p
            + (tokens - r) * log_q
        )
        above.append(max(0.0, 1.0 - cdf))
    return tuple(sum(above[0 : top + 1 : b]) for b in BLOCK_SIZES)


def block_size(tokens: int, top_k: int, global_experts: int) -> int:
    """The aligned layout's row block: the tier with the fewest expected decoded-weight
    instructions per expert. A block decodes its expert's trellis columns once for all
    its rows, and decoding bounds the GEMM at these row counts, so the cost of a tier is
    its expected blocks per expert (uniform routing) times its instructions per decoded
    weight (BLOCK_DECODE_COST); ties go to the smaller block. An expert whose rows just
    exceed a block pays for two, so the rule moves up a tier once that is likely enough:
    at 16 rows per expert on average it takes 32-row blocks, at 32 the 64-row ones,
    above 64.4 the 128-row ones. The H200 measured that (bench_moe.py --block-sweep,
    scripts/bench/README.md): 32-row blocks 10-11 % faster than 16-row ones at 16 rows
    per expert on three layer shapes, 64-row blocks 17 % faster than 32-row ones at 32
    (DeepSeek-V3, 1,024 tokens), 16-row blocks fastest at 8 rows and below, 64-row ones
    at 64 rows and 128-row ones at 128 on three of four layers each."""
    expected = expected_blocks_per_expert(tokens, top_k, global_experts)
    costs = [e * BLOCK_DECODE_COST[b] for b, e in zip(BLOCK_SIZES, expected)]
    return min(zip(costs, BLOCK_SIZES))[1]


def wgmma_mode(overrides: Exl3MoEOverrides, batch_invariant: bool) -> int:
    """The op's `wgmma` argument: the op's own choice (wgmma on sm_90a for the unsplit
    64- and 128-row blocks), except under batch invariance, where every batch size must
    sum a row in the same order and the decode tiers have only mma.sync."""
    if overrides.wgmma is not None:
        return WGMMA_FORCE if overrides.wgmma else WGMMA_NEVER
    if batch_invariant:
        return WGMMA_NEVER
    return WGMMA_AUTO


# The few-token path: split-k over the experts' k. At a few tokens each active expert's
# gate/up and down run in a few 16-row blocks that each walk the expert's whole k alone
# on one SM (Qwen3-30B-A3B at one token: 96 gate/up blocks over 32 stages of k, 128 down
# blocks over 12, on 132 SMs), so the time is one block's latency, not bytes. Splitting
# k spreads the same trellis over every resident block slot; the fp32 partial sums (a
# few hundred KB at these sizes, against MBs of trellis) are summed in a fixed order by
# the consumer that already exists (the SwiGLU transform, the top-k combine).
#
# Blocks of the 16- and 32-row tiers an SM holds at once, at most: their register cap
# (GemmShape::kMinBlocks, exl3_gemm.cuh) asks for 4 of 256 threads.
SPLIT_RESIDENT_BLOCKS_PER_SM = 4
# Their shared memory (GemmShape::kSmemBytes): GEMM_STAGES pipeline stages of 64 k,
# each one BM-row activation tile of 128 bytes a row and 512 * k2 bytes of trellis
# (4 k16 rows x 8 tiles x 16 * k2 bytes); the epilogue's staging reuses them. CUDA
# reserves 1 KB per block beside it. At 8 bits this allows only 2 blocks on sm_12x's
# 100 KB.
GEMM_STAGES = 4
STAGE_ROW_BYTES = 128
STAGE_TRELLIS_BYTES_PER_K2 = 512
SMEM_RESERVED_PER_BLOCK = 1024
# Columns of one GEMM block (one Hadamard block).
BLOCK_N = 128


@dataclass(frozen=True)
class SplitDevice:
    """What the split rule needs of the device: SMs and shared memory per SM."""

    sms: int
    smem_per_sm: int


_split_devices: dict[torch.device, SplitDevice] = {}


def split_device(device: torch.device) -> SplitDevice:
    """The device's SplitDevice (read once per device; no sync, safe in capture)."""
    found = _split_devices.get(device)
    if found is None:
        props = torch.cuda.get_device_properties(device)
        found = SplitDevice(
            props.multi_processor_count, props.shared_memory_per_multiprocessor
        )
        _split_devices[device] = found
    return found


def expected_row_blocks(
    tokens: int,
    top_k: int,
    global_experts: int,
    local_experts: int,
    block: int,
    pairs: bool = False,
) -> int:
    """Row blocks the alignment is expected to give this rank: the local experts a
    uniform routing of `tokens` x top-k distinct experts reaches, or the routed rows
    over the block size where those outnumber them. Host-known shapes only: real
    routings are skewed and reach fewer experts, so this errs towards fewer splits.

    `pairs`: the pairs layout's working blocks instead, one per routed pair whose expert
    is local (the expected share of them; the others' blocks return at once)."""
    if tokens <= 0:
        return 0
    if pairs:
        return max(1, math.ceil(tokens * top_k * local_experts / global_experts))
    miss = (1.0 - min(top_k, global_experts) / global_experts) ** tokens
    reached = round(local_experts * (1.0 - miss))
    rows = tokens * top_k * local_experts / global_experts
    return max(1, reached, math.ceil(rows / block))


def resident_blocks(block: int, k2: int, dev: SplitDevice) -> int:
    """Blocks of the block-row tier at bitrate k2 that one SM holds at once."""
    smem = (
        GEMM_STAGES * (block * STAGE_ROW_BYTES + STAGE_TRELLIS_BYTES_PER_K2 * k2)
        + SMEM_RESERVED_PER_BLOCK
    )
    return max(1, min(SPLIT_RESIDENT_BLOCKS_PER_SM, dev.smem_per_sm // smem))


def gemm_splits(tiles: int, k: int, slots: int, min_stages: int) -> int:
    """k-splits of one grouped GEMM of `tiles` blocks over k: as many as fit one wave of
    the resident slots (a second, partial wave would cost a whole split's time), each
    at least `min_stages` stages deep; 1 once the blocks fill half the slots."""
    if tiles <= 0:
        return 1
    return max(1, min(slots // tiles, k // STAGE_K // min_stages))


def moe_splits(
    tokens: int,
    top_k: int,
    global_experts: int,
    local_experts: int,
    hidden: int,
    width: int,
    block: int,
    k2s: tuple[int, int],
    dev: SplitDevice,
    pairs: bool = False,
    thresholds: Exl3MoEThresholds = MOE_THRESHOLDS,
) -> tuple[int, int]:
    """(gate_up_splits, down_splits) of the op for one call: a pure function of
    host-known shapes (k2s: the largest 2 * bits of gate/up and of down, which set the
    shared memory) and the device. Only the decode tiers are built with split-k.
    `pairs`: the call runs the pairs layout (its row blocks are counted)."""
    if block not in SPLIT_BLOCK_SIZES:
        return 1, 1
    blocks = expected_row_blocks(
        tokens, top_k, global_experts, local_experts, block, pairs
    )
    slots13 = dev.sms * resident_blocks(block, k2s[0], dev)
    slots2 = dev.sms * resident_blocks(block, k2s[1], dev)
    least = thresholds.split_min_stages
    return (
        gemm_splits(blocks * GATE_UP_ROLES * width // BLOCK_N, hidden, slots13, least),
        gemm_splits(blocks * hidden // BLOCK_N, width, slots2, least),
    )


def call_splits(
    shape: Exl3MoECallShape,
    block: int,
    pairs: bool,
    device: torch.device,
    *,
    batch_invariant: bool,
    overrides: Exl3MoEOverrides = NO_OVERRIDES,
    thresholds: Exl3MoEThresholds = MOE_THRESHOLDS,
) -> tuple[int, int]:
    """The op's (gate_up_splits, down_splits) for a call at `block` rows (moe_splits),
    or the overrides' capped at each k's stages; none on the large-batch tiers or under
    batch invariance (a split changes the order of a row's sums with the batch size)."""
    if block not in SPLIT_BLOCK_SIZES:
        return 1, 1
    if overrides.splits is not None:
        s13, s2 = overrides.splits
        return (
            max(1, min(s13, shape.hidden // STAGE_K)),
            max(1, min(s2, shape.width // STAGE_K)),
        )
    if batch_invariant:
        return 1, 1
    return moe_splits(
        shape.tokens,
        shape.top_k,
        shape.global_experts,
        shape.local_experts,
        shape.hidden,
        shape.width,
        block,
        shape.k2s,
        split_device(device),
        pairs=pairs,
        thresholds=thresholds,
    )


def select_moe_path(
    shape: Exl3MoECallShape,
    *,
    reconstruct_ready: bool,
    overrides: Exl3MoEOverrides = NO_OVERRIDES,
    thresholds: Exl3MoEThresholds = MOE_THRESHOLDS,
) -> Exl3MoEPath:
    """The call's path: the override, else RECONSTRUCT from its threshold when the
    layer's experts fit the scratch (`reconstruct_ready`), else PAIRS up to its
    threshold, else ALIGNED.

    Batch invariance keeps the PAIRS rule: a row's sums do not depend on the layout.
    Both run each routed row in a 16-row mma.sync block (batch invariance keeps wgmma
    off, and the block-size rule gives 16 rows at a few rows per expert), whose rows
    are independent and whose k loop and epilogue are the row's own; the combine sums
    a token's top-k in the same order either way."""
    if overrides.path is not None:
        return overrides.path
    tokens, top_k, experts = shape.tokens, shape.top_k, shape.global_experts
    if reconstruct_ready and reconstructs(tokens, top_k, experts, thresholds):
        return Exl3MoEPath.RECONSTRUCT
    if pairs_layout(tokens, top_k, experts, thresholds):
        return Exl3MoEPath.PAIRS
    return Exl3MoEPath.ALIGNED


def select_moe_call(
    shape: Exl3MoECallShape,
    device: torch.device,
    *,
    reconstruct_ready: bool,
    batch_invariant: bool,
    overrides: Exl3MoEOverrides = NO_OVERRIDES,
    thresholds: Exl3MoEThresholds = MOE_THRESHOLDS,
) -> Exl3MoECall:
    """What a call of `shape` on `device` runs (the module docstring)."""
    path = select_moe_path(
        shape,
        reconstruct_ready=reconstruct_ready,
        overrides=overrides,
        thresholds=thresholds,
    )
    if path is Exl3MoEPath.RECONSTRUCT:
        return Exl3MoECall(path, 0, (1, 1), WGMMA_AUTO)
    pairs = path is Exl3MoEPath.PAIRS
    if pairs:
        block = PAIRS_BLOCK_SIZE
    elif overrides.block is not None:
        block = overrides.block
    else:
        block = block_size(shape.tokens, shape.top_k, shape.global_experts)
    splits = call_splits(
        shape,
        block,
        pairs,
        device,
        batch_invariant=batch_invariant,
        overrides=overrides,
        thresholds=thresholds,
    )
    return Exl3MoECall(path, block, splits, wgmma_mode(overrides, batch_invariant))
