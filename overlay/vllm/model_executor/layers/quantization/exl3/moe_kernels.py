# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which implementation runs an EXL3 MoE layer's routed experts, chosen once per layer.

Same pattern as kernels.py: `Exl3MoEMethod` describes the layer (`Exl3MoEKernelConfig`),
each candidate says whether it can run it here, the first that can is used;
`VLLM_EXL3_FORCE_REFERENCE=1` forces the reference. The weights are the parameters
moe.py registers, bundled as `Exl3MoEWeights`: every (expert, role) trellis is a
contiguous block of a flat int16 buffer, located by a per-expert `meta` table of
(offset, k2), so experts and roles may carry different bitrates.
"""

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import vllm.envs as envs
from vllm.logger import init_logger

from . import reference
from .format import TILE, Codebook

logger = init_logger(__name__)

# meta[..., 1] holds k2 = 2 * bits (an integer for every EXL3 rate, 1.5 / 2.5 / 3.5
# included).
K2_PER_BIT = 2
# Roles inside the w13 tables.
GATE, UP = 0, 1
# The activations the experts support (gated SiLU, as every EXL3 MoE architecture uses).
SUPPORTED_ACTIVATIONS = ("silu",)


def activation_unsupported(activation: str) -> str | None:
    """Why the experts cannot run `activation`, or None."""
    if activation in SUPPORTED_ACTIVATIONS:
        return None
    return f"activation {activation!r} (supported: {SUPPORTED_ACTIVATIONS})"


@dataclass(frozen=True)
class Exl3MoEWeights:
    """The eight tensors of one layer's local experts (see the module docstring)."""

    w13_trellis: torch.Tensor  # int16 [T13]
    w13_meta: torch.Tensor  # int64 [E, 2, 2]: (offset, k2) of gate, up
    w13_suh: torch.Tensor  # fp16 [E, 2, h]
    w13_svh: torch.Tensor  # fp16 [E, 2 * i_p]: gate columns, then up columns
    w2_trellis: torch.Tensor  # int16 [T2]
    w2_meta: torch.Tensor  # int64 [E, 2]: (offset, k2) of down
    w2_suh: torch.Tensor  # fp16 [E, i_p]
    w2_svh: torch.Tensor  # fp16 [E, h]
    num_experts: int  # E, local
    hidden: int  # h
    width: int  # i_p, the per-rank expert width


@dataclass(frozen=True)
class Exl3MoEKernelConfig:
    prefix: str
    device: torch.device  # where the loaded weights live
    act_dtype: torch.dtype
    activation: str
    codebook: int
    # Every distinct (bits) of the layer's experts and roles, for kernels with a rate
    # subset.
    bits: tuple[float, ...]


def trellis_block(
    flat: torch.Tensor, offset: int, k2: int, rows: int, cols: int
) -> torch.Tensor:
    """The [rows/16, cols/16, 16K] trellis stored at `offset` of a flat buffer (K = k2 /
    2)."""
    words = TILE * k2 // K2_PER_BIT
    size = (rows // TILE) * (cols // TILE) * words
    return flat[offset : offset + size].view(rows // TILE, cols // TILE, words)


class Exl3MoEKernel(ABC):
    @classmethod
    @abstractmethod
    def can_implement(cls, c: Exl3MoEKernelConfig) -> tuple[bool, str | None]:
        raise NotImplementedError

    def prepare(self, w: "Exl3MoEWeights", act_dtype: torch.dtype) -> None:  # noqa: B027
        """Once, after loading: reserve what apply needs beyond the weights."""

    @abstractmethod
    def apply(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w: Exl3MoEWeights,
        *,
        activation: str,
        apply_router_weight_on_input: bool,
        expert_map: torch.Tensor | None,
        global_num_experts: int,
        codebook: int,
        deterministic: bool,
    ) -> torch.Tensor:
        """out [M, h] in x.dtype: for each token, the sum over its top-k of routing
        weight * down(SiLU(gate(x)) * up(x)) for the experts local to this rank
        (expert_map: global -> local, -1 = elsewhere, contributes nothing); routed
        scaling and shared experts are applied by vLLM outside."""
        raise NotImplementedError


class ReferenceExl3MoEKernel(Exl3MoEKernel):
    """Plain PyTorch, fp32 accumulation, the trellises decoded by reference.py on every
    call (no decoded-weight cache that could hide a loading bug): CPU, tests, debugging.

    Deterministic by construction: each token's top-k contributions are added in top-k
    slot order, experts in index order."""

    @classmethod
    def can_implement(cls, c: Exl3MoEKernelConfig) -> tuple[bool, str | None]:
        why_not = activation_unsupported(c.activation)
        if why_not is not None:
            return False, why_not
        if c.device.type != "cpu":
            return False, (
                f"weights are on {c.device}: the reference would decode every "
                f"expert on every call (VLLM_EXL3_FORCE_REFERENCE=1 allows it)"
            )
        return True, None

    @staticmethod
    def _project(
        x: torch.Tensor,
        trellis: torch.Tensor,
        suh: torch.Tensor,
        svh: torch.Tensor,
        codebook: int,
    ) -> torch.Tensor:
        return reference.forward(x, trellis, suh, svh, codebook, dtype=torch.float32)

    def apply(
        self,
        x,
        topk_weights,
        topk_ids,
        w,
        *,
        activation,
        apply_router_weight_on_input,
        expert_map,
        global_num_experts,
        codebook,
        deterministic,
    ):
        why_not = activation_unsupported(activation)
        if why_not is not None:
            raise ValueError(f"EXL3 MoE: unsupported {why_not}")
        h, i_p = w.hidden, w.width
        m, top_k = topk_ids.shape
        ids = topk_ids.long()
        if expert_map is not None:
            # Out-of-range global ids (never produced by vLLM's routers) map to no
            # expert.
            valid = (ids >= 0) & (ids < global_num_experts)
            ids = torch.where(
                valid,
                expert_map.long()[ids.clamp(0, global_num_experts - 1)],
                torch.full_like(ids, -1),
            )
        meta13 = w.w13_meta.cpu().tolist()
        meta2 = w.w2_meta.cpu().tolist()
        xf = x.float()
        # contributions[token, slot]: filled per expert, then summed over slots in
        # order.
        contributions = torch.zeros((m, top_k, h), dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            if e < 0:
                continue
            if e >= w.num_experts:
                raise ValueError(
                    f"EXL3 MoE: local expert id {e} >= {w.num_experts} local experts"
                )
            rows, slots = torch.nonzero(ids == e, as_tuple=True)
            xe = xf[rows]
            if apply_router_weight_on_input:
                xe = xe * topk_weights[rows, slots, None].float()
            (g_off, g_k2), (u_off, u_k2) = meta13[e]
            gate = self._project(
                xe,
                trellis_block(w.w13_trellis, g_off, g_k2, h, i_p),
                w.w13_suh[e, GATE],
                w.w13_svh[e, :i_p],
                codebook,
            )
            up = self._project(
                xe,
                trellis_block(w.w13_trellis, u_off, u_k2, h, i_p),
                w.w13_suh[e, UP],
                w.w13_svh[e, i_p:],
                codebook,
            )
            d_off, d_k2 = meta2[e]
            y = self._project(
                F.silu(gate) * up,
                trellis_block(w.w2_trellis, d_off, d_k2, i_p, h),
                w.w2_suh[e],
                w.w2_svh[e],
                codebook,
            )
            if not apply_router_weight_on_input:
                y = y * topk_weights[rows, slots, None].float()
            contributions[rows, slots] = y
        out = contributions[:, 0]
        for s in range(1, top_k):
            out = out + contributions[:, s]
        return out.to(x.dtype)


class CudaExl3MoEKernel(Exl3MoEKernel):
    """The grouped trellis GEMM (`torch.ops._C.exl3_moe`) over vLLM's
    `moe_align_block_size`, or at a few tokens over the pairs layout (uses_pairs).

    Each aligned row block belongs to one expert and is one tile of the dense EXL3 GEMM
    on that expert's trellis; gate and up run in one launch, SwiGLU is fused into the
    down projection's input transform, and the routing weights into its epilogue. One
    launch per distinct bitrate serves layers whose experts (and roles) differ in
    bitrate. On Hopper the 64- and 128-row blocks run on wgmma (wgmma_mode).
    """

    # mma.sync m16n8k16 with fp16 inputs and cp.async both need Ampere.
    MIN_CAPABILITY = 80
    # Block size: the smallest tier holding an expert's average row count. A block
    # decodes its expert's trellis columns once for all its rows, and decoding (not the
    # padded rows' MMAs) bounds the GEMM at these row counts, so fewer, fuller blocks
    # win as soon as experts see more than 16 rows; at decode sizes 16-row blocks waste
    # the fewest rows.

    def __init__(self) -> None:
        # (w13_meta, w2_meta) data pointers -> the distinct k2 of each, read once per
        # layer.
        self._rates: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        # Rows per expert from which apply reconstructs (None: never, the layer's
        # experts do not fit the scratch or batch invariance is on); set by prepare.
        self.reconstruct_min_rows: float | None = None
        # (gate_up_splits, down_splits) for every call of the decode tiers instead of
        # moe_splits' choice, each capped at its k's stages (tests and benchmarks:
        # (1, 1) is the unsplit kernel); None: the rule.
        self.force_splits: tuple[int, int] | None = None
        # The grouped GEMMs' math engine for every call instead of the rule's (tests
        # and benchmarks): True = Hopper's wgmma (an error where the op cannot run
        # it), False = mma.sync; None: the rule (wgmma_mode).
        self.force_wgmma: bool | None = None
        # The grouped GEMM's row layout for every call instead of uses_pairs' choice
        # (tests and benchmarks): True = the pairs layout, False = vLLM's alignment;
        # None: the rule.
        self.force_pairs: bool | None = None

    def prepare(self, w: Exl3MoEWeights, act_dtype: torch.dtype) -> None:
        if envs.VLLM_BATCH_INVARIANT:
            # One reduction order for every batch size: the grouped GEMM only.
            return
        need = reconstruct_scratch_bytes(w, act_dtype)
        cap = int(
            torch.cuda.get_device_properties(w.w13_trellis.device).total_memory
            * RECONSTRUCT_SCRATCH_MAX_FRACTION
        )
        if need > cap:
            logger.info_once(
                "EXL3 MoE: %d local experts need %.2f GiB as %s, above the "
                "reconstruct scratch cap (%.2f GiB): the grouped GEMM serves "
                "every batch size",
                w.num_experts,
                need / 2**30,
                act_dtype,
                cap / 2**30,
            )
            return
        reserve_reconstruct_scratch(w.w13_trellis.device, need)
        self.reconstruct_min_rows = RECONSTRUCT_MIN_ROWS_PER_EXPERT

    def uses_reconstruct(
        self, tokens: int, top_k: int, global_num_experts: int
    ) -> bool:
        return self.reconstruct_min_rows is not None and (
            tokens * top_k >= self.reconstruct_min_rows * max(global_num_experts, 1)
        )

    def _reconstructed_forward(
        self,
        x,
        topk_weights,
        topk_ids,
        w: Exl3MoEWeights,
        rates: tuple[list[int], list[int]],
        *,
        apply_router_weight_on_input,
        expert_map,
        global_num_experts,
        codebook,
    ) -> torch.Tensor:
        """Every local expert reconstructed into the shared scratch (x's dtype), then
        vLLM's own fused MoE on it; the scratch is rewritten by the next layer."""
        from vllm.model_executor.layers.fused_moe import fused_experts

        from . import moe_ops

        w1, w2 = reconstruct_scratch(w, x.dtype)
        moe_ops.exl3_moe_reconstruct(
            w.w13_trellis, w.w13_meta, w.w13_suh, w.w13_svh, rates[0], codebook, w1
        )
        moe_ops.exl3_moe_reconstruct(
            w.w2_trellis,
            w.w2_meta.unsqueeze(1),
            w.w2_suh.unsqueeze(1),
            w.w2_svh,
            rates[1],
            codebook,
            w2,
        )
        return fused_experts(
            x.contiguous(),
            w1,
            w2,
            topk_weights.float(),
            topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input,
            global_num_experts=global_num_experts,
            expert_map=expert_map,
        )

    @classmethod
    def can_implement(cls, c: Exl3MoEKernelConfig) -> tuple[bool, str | None]:
        why_not = activation_unsupported(c.activation)
        if why_not is not None:
            return False, why_not
        from .kernels import cuda_kernel_unsupported

        why_not = cuda_kernel_unsupported(c.device, c.act_dtype, cls.MIN_CAPABILITY)
        if why_not:
            return False, why_not
        from . import moe_ops

        return moe_ops.load_exl3_moe_op()

    def uses_pairs(self, tokens: int, top_k: int, global_num_experts: int) -> bool:
        """Whether the call runs the pairs layout (a row block per routed pair, no
        alignment launches; pairs_layout) rather than vLLM's alignment.

        Under VLLM_BATCH_INVARIANT too: a row's sums do not depend on the layout. Both
        run each routed row in a 16-row mma.sync block (batch invariance keeps wgmma
        off, and the block-size rule gives 16 rows up to 16 rows per expert), whose rows
        are independent and whose k loop and epilogue are the row's own; the combine
        sums a token's top-k in the same order either way."""
        if self.force_pairs is not None:
            return self.force_pairs
        return pairs_layout(tokens, top_k, global_num_experts)

    @classmethod
    def block_size(cls, tokens: int, top_k: int, global_num_experts: int) -> int:
        from .moe_ops import BLOCK_SIZES

        rows = tokens * top_k / max(global_num_experts, 1)
        return next((b for b in BLOCK_SIZES if b >= rows), BLOCK_SIZES[-1])

    def splits(
        self,
        tokens: int,
        top_k: int,
        global_num_experts: int,
        w: Exl3MoEWeights,
        block: int,
        rates: tuple[list[int], list[int]],
        device: torch.device,
        pairs: bool = False,
    ) -> tuple[int, int]:
        """The op's (gate_up_splits, down_splits) for one call (see moe_splits);
        `pairs`: the call runs the pairs layout."""
        from .moe_ops import SPLIT_BLOCK_SIZES, STAGE_K

        if block not in SPLIT_BLOCK_SIZES:
            return 1, 1
        if self.force_splits is not None:
            s13, s2 = self.force_splits
            return (
                max(1, min(s13, w.hidden // STAGE_K)),
                max(1, min(s2, w.width // STAGE_K)),
            )
        if envs.VLLM_BATCH_INVARIANT:
            # A split changes the order of a row's sums with the batch size.
            return 1, 1
        return moe_splits(
            tokens,
            top_k,
            global_num_experts,
            w.num_experts,
            w.hidden,
            w.width,
            block,
            (max(rates[0]), max(rates[1])),
            split_device(device),
            pairs=pairs,
        )

    def wgmma_mode(self) -> int:
        """The op's `wgmma` argument: the op's own choice (wgmma on sm_90a for the
        unsplit 64- and 128-row blocks), except under batch invariance, where every
        batch size must sum a row in the same order and the decode tiers have only
        mma.sync."""
        from .moe_ops import WGMMA_AUTO, WGMMA_FORCE, WGMMA_NEVER

        if self.force_wgmma is not None:
            return WGMMA_FORCE if self.force_wgmma else WGMMA_NEVER
        if envs.VLLM_BATCH_INVARIANT:
            return WGMMA_NEVER
        return WGMMA_AUTO

    def rates(self, w: Exl3MoEWeights, codebook: int) -> tuple[list[int], list[int]]:
        """The distinct k2 of gate/up and of down, checked against the trellis buffers.

        Read from the device tables once per layer (a host sync: vLLM's first forward
        runs eagerly before any CUDA-graph capture)."""
        key = (w.w13_meta.data_ptr(), w.w2_meta.data_ptr())
        found = self._rates.get(key)
        if found is None:
            if w.w13_meta.is_cuda and torch.cuda.is_current_stream_capturing():
                # No host read now: every rate (a launch per rate absent from the layer
                # only costs its empty grid); the op's device checks still guard the
                # table.
                logger.warning_once(
                    "EXL3 MoE: bitrate table first read during CUDA-graph "
                    "capture; launching for every rate"
                )
                every = [
                    k2
                    for k2 in sorted(VALID_K2)
                    if k2 % 2 == 0 or codebook == Codebook.MUL1
                ]
                return every, every
            found = (
                _checked_rates(
                    "w13", w.w13_meta.cpu(), w.w13_trellis.numel(), (w.hidden, w.width)
                ),
                _checked_rates(
                    "w2",
                    w.w2_meta.cpu().unsqueeze(1),
                    w.w2_trellis.numel(),
                    (w.width, w.hidden),
                ),
            )
            self._rates[key] = found
        return found

    def apply(
        self,
        x,
        topk_weights,
        topk_ids,
        w,
        *,
        activation,
        apply_router_weight_on_input,
        expert_map,
        global_num_experts,
        codebook,
        deterministic,
    ):
        why_not = activation_unsupported(activation)
        if why_not is not None:
            raise ValueError(f"EXL3 MoE: unsupported {why_not}")
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import (
            moe_align_block_size,
        )

        from . import moe_ops

        rates13, rates2 = self.rates(w, codebook)
        m, top_k = topk_ids.shape
        if expert_map is not None and expert_map.dtype != torch.int32:
            expert_map = expert_map.to(torch.int32)
        if self.uses_reconstruct(m, top_k, global_num_experts):
            return self._reconstructed_forward(
                x,
                topk_weights,
                topk_ids,
                w,
                (rates13, rates2),
                apply_router_weight_on_input=apply_router_weight_on_input,
                expert_map=expert_map,
                global_num_experts=global_num_experts,
                codebook=codebook,
            )
        pairs = self.uses_pairs(m, top_k, global_num_experts)
        if pairs:
            # The op lays the pairs out itself (its input transform writes the arrays).
            block = moe_ops.PAIRS_BLOCK_SIZE
            sorted_ids = expert_ids = post_pad = None
        else:
            block = self.block_size(m, top_k, global_num_experts)
            # Non-local experts are left out of the alignment altogether (no -1 blocks
            # to skip).
            sorted_ids, expert_ids, post_pad = moe_align_block_size(
                topk_ids,
                block,
                global_num_experts,
                expert_map,
                ignore_invalid_experts=True,
            )
        splits = self.splits(
            m, top_k, global_num_experts, w, block, (rates13, rates2), x.device, pairs
        )
        floats = moe_ops.split_workspace_floats(m, top_k, w.hidden, w.width, *splits)
        workspace = (
            torch.empty(floats, dtype=torch.float32, device=x.device)
            if floats
            else None
        )
        return moe_ops.exl3_moe(
            x.contiguous(),
            topk_weights.float().contiguous(),
            topk_ids.contiguous(),
            sorted_ids,
            expert_ids,
            post_pad,
            expert_map,
            w.w13_trellis,
            w.w13_meta,
            w.w13_suh,
            w.w13_svh,
            w.w2_trellis,
            w.w2_meta,
            w.w2_suh,
            w.w2_svh,
            block,
            rates13,
            rates2,
            global_num_experts,
            codebook,
            apply_router_weight_on_input,
            deterministic,
            *splits,
            workspace,
            self.wgmma_mode(),
        )


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
# A k-split shorter than this many 64-deep stages costs more (pipeline fill, its fp32
# partial rows and their sum) than spreading the trellis over more SMs gains: the H200
# bench lost with 16-stage splits and gained with 21-stage ones (design notes, "MoE
# grouped GEMM: the few-token path").
SPLIT_MIN_STAGES = 20
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


def gemm_splits(tiles: int, k: int, slots: int) -> int:
    """k-splits of one grouped GEMM of `tiles` blocks over k: as many as fit one wave of
    the resident slots (a second, partial wave would cost a whole split's time), each
    at least SPLIT_MIN_STAGES stages deep; 1 once the blocks fill half the slots."""
    from .moe_ops import STAGE_K

    if tiles <= 0:
        return 1
    return max(1, min(slots // tiles, k // STAGE_K // SPLIT_MIN_STAGES))


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
) -> tuple[int, int]:
    """(gate_up_splits, down_splits) of the op for one call: a pure function of
    host-known shapes (k2s: the largest 2 * bits of gate/up and of down, which set the
    shared memory) and the device, so every replay of a captured graph and every
    process runs the same splits. Only the decode tiers are built with split-k.
    `pairs`: the call runs the pairs layout (its row blocks are counted)."""
    from .moe_ops import GATE_UP_ROLES, SPLIT_BLOCK_SIZES

    if block not in SPLIT_BLOCK_SIZES:
        return 1, 1
    blocks = expected_row_blocks(
        tokens, top_k, global_experts, local_experts, block, pairs
    )
    slots13 = dev.sms * resident_blocks(block, k2s[0], dev)
    slots2 = dev.sms * resident_blocks(block, k2s[1], dev)
    return (
        gemm_splits(blocks * GATE_UP_ROLES * width // BLOCK_N, hidden, slots13),
        gemm_splits(blocks * hidden // BLOCK_N, width, slots2),
    )


# The pairs layout (few tokens): every routed pair (token, k) its own 16-row block of
# the grouped GEMM, its expert read from the routing by the op's input transform, which
# also writes the arrays the GEMMs and transforms consume; vLLM's alignment (a memset
# and two kernels, 4.9 µs of GPU time plus their launch gaps on an H200 for
# Qwen3-30B-A3B at one token, torch.profiler) is not launched. Its cost: pairs of one
# batch that share an expert no longer share a block, so that expert's trellis is read
# once per pair. A uniform routing of P pairs over E experts reaches
# E (1 - (1 - 1/E)^P) ~ P - P^2 / (2E) distinct experts, so the pairs layout reads about
# P / (2E) more trellis than the aligned one, and its first gate/up launch gives up the
# prefetch overlap with the input transform. Measured (design notes, "MoE grouped GEMM:
# the few-token path"; bench_moe.py rows exl3_pairs and exl3_aligned on four layer
# shapes): faster or level at every point up to P = E / 8, mixed at E / 4 (faster for
# Qwen3-30B-A3B and Qwen3-235B-A22B, not for GLM-4.5-Air), slower everywhere from E / 2.
# So up to an eighth of a routed pair per expert (top-8 of 128 experts: 2 tokens; of
# 256, DeepSeek-V3: 4), where the excess read is at most 6.5 %.
PAIRS_MAX_PAIRS_PER_EXPERT = 0.125


def pairs_layout(tokens: int, top_k: int, global_experts: int) -> bool:
    """Whether a call of `tokens` x top-k routed pairs runs the pairs layout: a pure
    function of host-known shapes, like moe_splits."""
    return 0 < tokens * top_k <= PAIRS_MAX_PAIRS_PER_EXPERT * max(global_experts, 1)


# The large-batch path: from this many routed rows per expert (tokens * top_k / global
# experts) the local experts are reconstructed to the activation dtype and run through
# vLLM's own fused MoE. The reconstruct writes every local expert's weights once per
# call (Qwen3-30B-A3B: 1.2 GB per layer), which pays only once each expert's rows fill
# several of the grouped GEMM's 128-row blocks, each of which decodes the expert's whole
# trellis again. Three 128-row blocks: between the H200 crossings of the two paths
# (bench_moe.py rows exl3 and exl3_reconstruct, 4 bits; design notes: MoE large-batch
# path), about 290 rows for Qwen3-30B-A3B and 380 for GLM-4.5-Air.
RECONSTRUCT_MIN_ROWS_PER_EXPERT = 384
# The reconstruct scratch (one per device, shared by every layer, reserved at load so
# vLLM's memory profiling counts it) takes at most this fraction of device memory: a
# layer whose local experts need more keeps the grouped GEMM at every batch size
# (DeepSeek-V3 at TP=1: 22.5 GB; Qwen3-235B-A22B: 4.8 GB, 3.4 % of an H200).
RECONSTRUCT_SCRATCH_MAX_FRACTION = 0.05
# Gate, up and down: the three weights of an expert.
EXPERT_WEIGHTS = 3

_reconstruct_scratch: dict[torch.device, torch.Tensor] = {}


def reconstruct_scratch_bytes(w: Exl3MoEWeights, dtype: torch.dtype) -> int:
    """Bytes of every local expert's gate, up and down in `dtype`."""
    return EXPERT_WEIGHTS * w.num_experts * w.hidden * w.width * dtype.itemsize


def reserve_reconstruct_scratch(device: torch.device, nbytes: int) -> None:
    """Grow the device's shared scratch to at least nbytes (load time, before vLLM's
    memory profiling), from torch's caching allocator."""
    current = _reconstruct_scratch.get(device)
    if current is None or current.numel() < nbytes:
        _reconstruct_scratch.pop(device, None)
        del current
        _reconstruct_scratch[device] = torch.empty(
            nbytes, dtype=torch.uint8, device=device
        )


def reconstruct_scratch(
    w: Exl3MoEWeights, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [E, 2 i, h], w2 [E, h, i]) in `dtype`, views of the device's scratch."""
    e, h, i = w.num_experts, w.hidden, w.width
    buf = _reconstruct_scratch.get(w.w13_trellis.device)
    if buf is None or buf.numel() < reconstruct_scratch_bytes(w, dtype):
        raise RuntimeError(
            f"EXL3 MoE: the reconstruct scratch on {w.w13_trellis.device} was not "
            f"reserved for {e} experts of {h} x {i} (prepare() not called?)"
        )
    flat = buf.view(dtype)
    n1 = e * 2 * i * h
    return (
        flat[:n1].view(e, 2 * i, h),
        flat[n1 : n1 + e * h * i].view(e, h, i),
    )


# Every EXL3 bitrate as k2 = 2 * bits: 1..8 bits and MUL1's 1.5 / 2.5 / 3.5.
VALID_K2 = frozenset(range(2, 17, 2)) | {3, 5, 7}
# Trellis blocks start on 16-byte boundaries (cp.async), i.e. every 8 int16 elements.
TRELLIS_OFFSET_ALIGN = 8


def _checked_rates(
    name: str, meta: torch.Tensor, numel: int, shape: tuple[int, int]
) -> list[int]:
    """meta [E, roles, 2] (host copy): every block a valid rate, aligned, inside the
    buffer."""
    rows, cols = shape
    for e, roles in enumerate(meta.tolist()):
        for r, (offset, k2) in enumerate(roles):
            where = f"EXL3 MoE {name}_meta[{e}, {r}]"
            if k2 not in VALID_K2:
                raise ValueError(f"{where}: k2 = {k2} is not 2 * an EXL3 bitrate")
            size = (rows // TILE) * (cols // TILE) * TILE * k2 // K2_PER_BIT
            if offset < 0 or offset % TRELLIS_OFFSET_ALIGN or offset + size > numel:
                raise ValueError(
                    f"{where}: the trellis block [{offset}, {offset + size}) is "
                    f"unaligned or outside {name}_trellis ({numel} elements)"
                )
    return sorted({int(k2) for roles in meta.tolist() for _, k2 in roles})


CANDIDATES: tuple[type[Exl3MoEKernel], ...] = (
    CudaExl3MoEKernel,
    ReferenceExl3MoEKernel,
)


def choose_exl3_moe_kernel(c: Exl3MoEKernelConfig) -> Exl3MoEKernel:
    if envs.VLLM_EXL3_FORCE_REFERENCE:
        logger.info_once(
            "EXL3: VLLM_EXL3_FORCE_REFERENCE=1, using the reference MoE codec"
        )
        return ReferenceExl3MoEKernel()
    reasons = []
    for kernel in CANDIDATES:
        ok, why_not = kernel.can_implement(c)
        if ok:
            logger.debug("EXL3 %s: %s", c.prefix, kernel.__name__)
            return kernel()
        reasons.append(f"{kernel.__name__}: {why_not}")
    raise ValueError(
        f"EXL3 {c.prefix}: no MoE kernel can run this layer: " + "; ".join(reasons)
    )
