# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Python wrapper and fake implementation of the EXL3 MoE CUDA op
(`torch.ops._C.exl3_moe`).

The op runs one layer's routed experts over vLLM's expert alignment
(`moe_align_block_size`): routed-row input transform, the gate/up grouped GEMM, SwiGLU
into the down projection's input transform, the down grouped GEMM with the routing
weights, and the top-k combine. It is built into the same extension as the dense ops
(ops.py loads it); nothing is loaded at import time.

With `sorted_ids`, `expert_ids` and `num_tokens_post_pad` all None the op runs the
pairs layout instead of vLLM's alignment: row block b (`PAIRS_BLOCK_SIZE` rows) serves
routed pair b = token * top_k + k alone, its expert topk_ids.flat[b] (through
expert_map), and the input transform writes those arrays itself, so the alignment's
launches go (the few-token path; moe_plans.py `select_moe_path` decides).

`gate_up_splits` / `down_splits` cut the two grouped GEMMs' k (the caller's rule,
moe_plans.py `moe_splits`); their fp32 partial sums go to `workspace`
(`split_workspace_floats` elements, None when both are 1) and are summed in a fixed
order by the SwiGLU transform and the combine.

`wgmma` picks the grouped GEMMs' math engine: -1 lets the op choose (Hopper's wgmma on
sm_90a for the unsplit 64- and 128-row blocks, mma.sync otherwise), 0 is mma.sync
always, 1 is wgmma always (an error on any other device or block size).

`exl3_moe_reconstruct` writes every (expert, role) weight of one weight set (w13: gate
and up, or w2: down) in the original basis and transposed, into a caller-owned buffer
laid out as vLLM's fused-MoE weights: the large-batch path.
"""

from typing import NamedTuple

import torch

from . import ops

OP = "exl3_moe"
RECONSTRUCT_OP = "exl3_moe_reconstruct"
# Row-block sizes the grouped GEMM is built for (16 * its m16 tiers, exl3_moe.h
# kMoeTiers).
BLOCK_SIZES = (16, 32, 64, 128)
# The pairs layout's block: one live row each, so the smallest tier (the fewest padding
# rows, and a tier built with split-k).
PAIRS_BLOCK_SIZE = BLOCK_SIZES[0]
# The block sizes built with split-k (exl3_moe.h kMoeSplitMaxTier): the decode tiers.
SPLIT_BLOCK_SIZES = (16, 32)
# The block sizes also built on Hopper's wgmma (exl3_moe.h kMoeWgmmaTiers), unsplit.
WGMMA_BLOCK_SIZES = (64, 128)
# The op's `wgmma` argument.
WGMMA_AUTO, WGMMA_NEVER, WGMMA_FORCE = -1, 0, 1
# k per grouped-GEMM pipeline stage: a k-split owns whole stages.
STAGE_K = 64
# Gate and up: the two roles of the w13 GEMM.
GATE_UP_ROLES = 2


def load_exl3_moe_op() -> tuple[bool, str | None]:
    """Make the ops available once; returns (available, why not)."""
    return ops.load_exl3_extra_ops(
        OP, {OP: exl3_moe_fake, RECONSTRUCT_OP: exl3_moe_reconstruct_fake}
    )


class Exl3MoEArgs(NamedTuple):
    """The arguments of `_C::exl3_moe`, in schema order (see the module docstring)."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    sorted_ids: torch.Tensor | None  # the alignment; all three None: the pairs layout
    expert_ids: torch.Tensor | None
    num_tokens_post_pad: torch.Tensor | None
    expert_map: torch.Tensor | None
    w13_trellis: torch.Tensor
    w13_meta: torch.Tensor
    w13_suh: torch.Tensor
    w13_svh: torch.Tensor
    w2_trellis: torch.Tensor
    w2_meta: torch.Tensor
    w2_suh: torch.Tensor
    w2_svh: torch.Tensor
    block_size: int
    w13_k2s: list[int]
    w2_k2s: list[int]
    global_num_experts: int
    codebook: int
    apply_router_weight_on_input: bool
    deterministic: bool
    gate_up_splits: int
    down_splits: int
    workspace: torch.Tensor | None
    wgmma: int


class Exl3MoEReconstructArgs(NamedTuple):
    """The arguments of `_C::exl3_moe_reconstruct`, in schema order: one weight set
    (w13 or w2) and the caller's output buffer."""

    trellis: torch.Tensor
    meta: torch.Tensor  # int64 [E, roles, 2]
    suh: torch.Tensor  # [E, roles, k]
    svh: torch.Tensor  # [E, roles * n]
    k2s: list[int]  # the distinct 2 * bits of meta
    codebook: int
    out: torch.Tensor  # [E, roles * n, k], bf16 or fp16


def exl3_moe_fake(*args, **kwargs) -> torch.Tensor:
    """`_C::exl3_moe`'s output metadata; takes the op's arguments (Exl3MoEArgs)."""
    x = Exl3MoEArgs(*args, **kwargs).x
    return x.new_empty((x.shape[0], x.shape[1]))


def exl3_moe_reconstruct_fake(*args, **kwargs) -> None:
    """`_C::exl3_moe_reconstruct` (Exl3MoEReconstructArgs) writes `out` in place and
    returns nothing."""
    return None


def exl3_moe(args: Exl3MoEArgs) -> torch.Tensor:
    """y [M, h] in x.dtype: the routed experts' weighted sum per token (see the module
    doc)."""
    return torch.ops._C.exl3_moe(*args)


def split_workspace_floats(
    tokens: int,
    top_k: int,
    hidden: int,
    width: int,
    gate_up_splits: int,
    down_splits: int,
) -> int:
    """float32 elements of the op's partial sums: gate/up's [splits][2][pairs][width],
    then down's [splits][pairs][hidden]; an unsplit GEMM (1) takes none."""
    pairs = tokens * top_k
    gate_up = (
        gate_up_splits * GATE_UP_ROLES * pairs * width if gate_up_splits > 1 else 0
    )
    down = down_splits * pairs * hidden if down_splits > 1 else 0
    return gate_up + down


def exl3_moe_reconstruct(args: Exl3MoEReconstructArgs) -> None:
    """args.out [E, roles * n, k] (bf16 or fp16) = each (expert, role)'s W^T,
    W = diag(suh) Ĥ Ŵ Ĥ diag(svh)."""
    torch.ops._C.exl3_moe_reconstruct(*args)
