# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What runs an EXL3 MoE layer's routed experts: a backend chosen once per layer, in the
form of vLLM's fused_moe oracles (`fused_moe/oracle/`): an enum of backends
(`Exl3MoEBackend`) in priority order, each backend's kernel class saying whether it can
run the layer (`can_implement` -> (ok, why not)), and `select_exl3_moe_backend`
returning the first that can and why; `VLLM_EXL3_FORCE_REFERENCE=1` forces the
reference. What each call of the CUDA kernel runs (path, block, splits, engine) is
moe_plans.py's choice.

The weights are the parameters moe.py registers, bundled as `Exl3MoEWeights`: every
(expert, role) trellis is a contiguous block of a flat int16 buffer, located by a
per-expert `meta` table of (offset, k2), so experts and roles may carry different
bitrates.
"""

import enum
from abc import abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import vllm.envs as envs
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.moe_align_block_size import (
    moe_align_block_size,
)

from . import moe_ops, reference
from .capability import (
    MIN_CAPABILITY,
    Exl3KernelCandidate,
    cuda_kernel_unsupported,
    first_capable,
)
from .format import TILE, VALID_BITS, Codebook
from .moe_plans import (
    MOE_THRESHOLDS,
    NO_OVERRIDES,
    Exl3MoECall,
    Exl3MoECallShape,
    Exl3MoEOverrides,
    Exl3MoEPath,
    Exl3MoEThresholds,
    select_moe_call,
)

logger = init_logger(__name__)

# meta[..., 1] holds k2 = 2 * bits (an integer for every EXL3 rate, 1.5 / 2.5 / 3.5
# included).
K2_PER_BIT = 2
# Every EXL3 bitrate as k2.
VALID_K2 = frozenset(int(K2_PER_BIT * bits) for bits in VALID_BITS)
# Trellis blocks start on 16-byte boundaries (cp.async), i.e. every 8 int16 elements.
TRELLIS_OFFSET_ALIGN = 8
# Roles in checkpoint order; the w13 tables hold gate (0) and up (1), w2 down.
GATE, UP, DOWN = 0, 1, 2
# The activations the experts support (gated SiLU, as every EXL3 MoE architecture uses).
SUPPORTED_ACTIVATIONS = ("silu",)
# Gate, up and down: the three weights of an expert.
EXPERT_WEIGHTS = 3


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
    """One loaded EXL3 MoE layer as the kernels see it."""

    prefix: str
    device: torch.device  # where the loaded weights live
    act_dtype: torch.dtype
    activation: str
    codebook: int
    # Every distinct (bits) of the layer's experts and roles, for kernels with a rate
    # subset.
    bits: tuple[float, ...]


class Exl3MoEApplyArgs(NamedTuple):
    """What a call gives besides the tokens, their routing and the weights
    (Exl3MoEKernel.apply's keywords)."""

    apply_router_weight_on_input: bool
    expert_map: torch.Tensor | None  # global -> local expert id, -1 on another rank
    global_num_experts: int
    codebook: int
    deterministic: bool


def tile_words(k2: int) -> int:
    """int16 words of one 16x16 trellis tile at k2 = 2 * bits."""
    return TILE * k2 // K2_PER_BIT


def block_words(rows: int, cols: int, k2: int) -> int:
    """int16 words of one [rows/16, cols/16, 16K] trellis block (K = k2 / 2)."""
    return (rows // TILE) * (cols // TILE) * tile_words(k2)


def trellis_block(
    flat: torch.Tensor, offset: int, k2: int, rows: int, cols: int
) -> torch.Tensor:
    """The [rows/16, cols/16, 16K] trellis stored at `offset` of a flat buffer."""
    size = block_words(rows, cols, k2)
    return flat[offset : offset + size].view(rows // TILE, cols // TILE, tile_words(k2))


class Exl3MoEKernel(Exl3KernelCandidate):
    """One EXL3 MoE layer's routed experts (the kernel classes of Exl3MoEBackend)."""

    def prepare(self, w: "Exl3MoEWeights", act_dtype: torch.dtype) -> None:  # noqa: B027
        """Once, after loading: reserve what apply needs beyond the weights."""

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
        scaling and shared experts are applied by vLLM outside. An activation the
        experts do not run is refused before any weight is read."""
        why_not = activation_unsupported(activation)
        if why_not is not None:
            raise ValueError(f"EXL3 MoE: unsupported {why_not}")
        return self.run_experts(
            x,
            topk_weights,
            topk_ids,
            w,
            Exl3MoEApplyArgs(
                apply_router_weight_on_input,
                expert_map,
                global_num_experts,
                codebook,
                deterministic,
            ),
        )

    @abstractmethod
    def run_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w: Exl3MoEWeights,
        a: Exl3MoEApplyArgs,
    ) -> torch.Tensor:
        """What apply computes, the activation checked."""
        raise NotImplementedError


class ReferenceExl3MoEKernel(Exl3MoEKernel):
    """Plain PyTorch, fp32 accumulation, the trellises decoded by reference.py on every
    call (no decoded-weight cache that could hide a loading bug): CPU, tests, debugging.

    Deterministic by construction: each token's top-k contributions are added in top-k
    slot order, experts in index order."""

    @classmethod
    def get_min_capability(cls) -> int:
        # Plain PyTorch: no device feature needed.
        return 0

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

    def run_experts(self, x, topk_weights, topk_ids, w, a):
        h, i_p = w.hidden, w.width
        m, top_k = topk_ids.shape
        ids = topk_ids.long()
        if a.expert_map is not None:
            # Out-of-range global ids (never produced by vLLM's routers) map to no
            # expert.
            valid = (ids >= 0) & (ids < a.global_num_experts)
            ids = torch.where(
                valid,
                a.expert_map.long()[ids.clamp(0, a.global_num_experts - 1)],
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
            if a.apply_router_weight_on_input:
                xe = xe * topk_weights[rows, slots, None].float()
            (g_off, g_k2), (u_off, u_k2) = meta13[e]
            gate = self._project(
                xe,
                trellis_block(w.w13_trellis, g_off, g_k2, h, i_p),
                w.w13_suh[e, GATE],
                w.w13_svh[e, :i_p],
                a.codebook,
            )
            up = self._project(
                xe,
                trellis_block(w.w13_trellis, u_off, u_k2, h, i_p),
                w.w13_suh[e, UP],
                w.w13_svh[e, i_p:],
                a.codebook,
            )
            d_off, d_k2 = meta2[e]
            y = self._project(
                F.silu(gate) * up,
                trellis_block(w.w2_trellis, d_off, d_k2, i_p, h),
                w.w2_suh[e],
                w.w2_svh[e],
                a.codebook,
            )
            if not a.apply_router_weight_on_input:
                y = y * topk_weights[rows, slots, None].float()
            contributions[rows, slots] = y
        out = contributions[:, 0]
        for s in range(1, top_k):
            out = out + contributions[:, s]
        return out.to(x.dtype)


class CudaExl3MoEKernel(Exl3MoEKernel):
    """The grouped trellis GEMM (`torch.ops._C.exl3_moe`) over vLLM's
    `moe_align_block_size`, or at a few tokens over the pairs layout, or at many over
    the reconstruct path (moe_plans.py chooses per call).

    Each aligned row block belongs to one expert and is one tile of the dense EXL3 GEMM
    on that expert's trellis; gate and up run in one launch, SwiGLU is fused into the
    down projection's input transform, and the routing weights into its epilogue. One
    launch per distinct bitrate serves layers whose experts (and roles) differ in
    bitrate. On Hopper the 64- and 128-row blocks run on wgmma.
    """

    def __init__(
        self,
        overrides: Exl3MoEOverrides = NO_OVERRIDES,
        thresholds: Exl3MoEThresholds = MOE_THRESHOLDS,
    ) -> None:
        """`overrides`, `thresholds`: choices fixed for every call and the numbers the
        rules compare against (moe_plans.py); tests and benchmarks pass their own."""
        self.overrides = overrides
        self.thresholds = thresholds
        # (w13_meta, w2_meta) data pointers -> the distinct k2 of each, read once per
        # layer.
        self._rates: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        # Whether the reconstruct scratch holds this layer's experts (prepare: not
        # under batch invariance, nor past the scratch cap).
        self.reconstruct_ready = False

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @classmethod
    def can_implement(cls, c: Exl3MoEKernelConfig) -> tuple[bool, str | None]:
        why_not = activation_unsupported(c.activation) or cuda_kernel_unsupported(
            c.device, c.act_dtype, cls.get_min_capability()
        )
        if why_not:
            return False, why_not
        return moe_ops.load_exl3_moe_op()

    def prepare(self, w: Exl3MoEWeights, act_dtype: torch.dtype) -> None:
        if envs.VLLM_BATCH_INVARIANT:
            # One reduction order for every batch size: the grouped GEMM only.
            return
        need = reconstruct_scratch_bytes(w, act_dtype)
        cap = int(
            torch.cuda.get_device_properties(w.w13_trellis.device).total_memory
            * self.thresholds.reconstruct_scratch_max_fraction
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
        self.reconstruct_ready = True

    def choose(
        self,
        tokens: int,
        top_k: int,
        global_num_experts: int,
        w: Exl3MoEWeights,
        rates: tuple[list[int], list[int]],
        device: torch.device,
    ) -> Exl3MoECall:
        """What a call of `tokens` x top-k routed pairs runs (moe_plans.select_moe_call,
        under this kernel's overrides and thresholds)."""
        shape = Exl3MoECallShape(
            tokens,
            top_k,
            global_num_experts,
            w.num_experts,
            w.hidden,
            w.width,
            (max(rates[0]), max(rates[1])),
        )
        return select_moe_call(
            shape,
            device,
            reconstruct_ready=self.reconstruct_ready,
            batch_invariant=bool(envs.VLLM_BATCH_INVARIANT),
            overrides=self.overrides,
            thresholds=self.thresholds,
        )

    def _reconstructed_forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w: Exl3MoEWeights,
        rates: tuple[list[int], list[int]],
        a: Exl3MoEApplyArgs,
        expert_map: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every local expert reconstructed into the shared scratch (x's dtype), then
        vLLM's own fused MoE on it; the scratch is rewritten by the next layer."""
        # vLLM defines fused_experts only where Triton is installed (fused_moe's
        # __init__); this path runs only on CUDA, where it is.
        from vllm.model_executor.layers.fused_moe import fused_experts

        w1, w2 = reconstruct_scratch(w, x.dtype)
        moe_ops.exl3_moe_reconstruct(
            moe_ops.Exl3MoEReconstructArgs(
                w.w13_trellis,
                w.w13_meta,
                w.w13_suh,
                w.w13_svh,
                rates[0],
                a.codebook,
                w1,
            )
        )
        moe_ops.exl3_moe_reconstruct(
            moe_ops.Exl3MoEReconstructArgs(
                w.w2_trellis,
                w.w2_meta.unsqueeze(1),
                w.w2_suh.unsqueeze(1),
                w.w2_svh,
                rates[1],
                a.codebook,
                w2,
            )
        )
        return fused_experts(
            x.contiguous(),
            w1,
            w2,
            topk_weights.float(),
            topk_ids,
            apply_router_weight_on_input=a.apply_router_weight_on_input,
            global_num_experts=a.global_num_experts,
            expert_map=expert_map,
        )

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

    def run_experts(self, x, topk_weights, topk_ids, w, a):
        rates13, rates2 = self.rates(w, a.codebook)
        m, top_k = topk_ids.shape
        expert_map = a.expert_map
        if expert_map is not None and expert_map.dtype != torch.int32:
            expert_map = expert_map.to(torch.int32)
        call = self.choose(
            m, top_k, a.global_num_experts, w, (rates13, rates2), x.device
        )
        if call.path is Exl3MoEPath.RECONSTRUCT:
            return self._reconstructed_forward(
                x, topk_weights, topk_ids, w, (rates13, rates2), a, expert_map
            )
        if call.path is Exl3MoEPath.PAIRS:
            # The op lays the pairs out itself (its input transform writes the arrays).
            sorted_ids = expert_ids = post_pad = None
        else:
            # Non-local experts are left out of the alignment altogether (no -1 blocks
            # to skip).
            sorted_ids, expert_ids, post_pad = moe_align_block_size(
                topk_ids,
                call.block,
                a.global_num_experts,
                expert_map,
                ignore_invalid_experts=True,
            )
        floats = moe_ops.split_workspace_floats(
            m, top_k, w.hidden, w.width, *call.splits
        )
        workspace = (
            torch.empty(floats, dtype=torch.float32, device=x.device)
            if floats
            else None
        )
        return moe_ops.exl3_moe(
            moe_ops.Exl3MoEArgs(
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
                call.block,
                rates13,
                rates2,
                a.global_num_experts,
                a.codebook,
                a.apply_router_weight_on_input,
                a.deterministic,
                *call.splits,
                workspace,
                call.wgmma,
            )
        )


# The large-batch path's scratch.
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
            size = block_words(rows, cols, k2)
            if offset < 0 or offset % TRELLIS_OFFSET_ALIGN or offset + size > numel:
                raise ValueError(
                    f"{where}: the trellis block [{offset}, {offset + size}) is "
                    f"unaligned or outside {name}_trellis ({numel} elements)"
                )
    return sorted({int(k2) for roles in meta.tolist() for _, k2 in roles})


class Exl3MoEBackend(enum.Enum):
    """The implementations of an EXL3 MoE layer's experts, in priority order."""

    CUDA = "cuda"  # the grouped trellis GEMM op: CudaExl3MoEKernel
    REFERENCE = "reference"  # PyTorch, every expert decoded per call


def backend_to_kernel_cls(backend: Exl3MoEBackend) -> type[Exl3MoEKernel]:
    """The kernel class of a backend."""
    if backend is Exl3MoEBackend.CUDA:
        return CudaExl3MoEKernel
    return ReferenceExl3MoEKernel


def select_exl3_moe_backend(c: Exl3MoEKernelConfig) -> tuple[Exl3MoEBackend, str]:
    """The backend that runs the layer, and why: the first in priority order whose
    kernel can run it (a ValueError naming each one's reason when none can); the
    reference under VLLM_EXL3_FORCE_REFERENCE=1."""
    if envs.VLLM_EXL3_FORCE_REFERENCE:
        logger.info_once(
            "EXL3: VLLM_EXL3_FORCE_REFERENCE=1, using the reference MoE codec"
        )
        return Exl3MoEBackend.REFERENCE, "VLLM_EXL3_FORCE_REFERENCE=1"
    backends = list(Exl3MoEBackend)
    kernel, passed_over = first_capable(
        [backend_to_kernel_cls(b) for b in backends],
        c,
        f"EXL3 {c.prefix}: no MoE kernel can run this layer",
    )
    backend = next(b for b in backends if backend_to_kernel_cls(b) is kernel)
    return backend, "; ".join(passed_over) or "the first in priority order"
