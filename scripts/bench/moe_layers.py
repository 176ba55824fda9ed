# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Random EXL3 MoE layers in the kernel contract's layout, their float64 reference, and
a plain-torch expert alignment, for the GPU tests of torch.ops._C.exl3_moe and
bench_moe.py.

Layout (MOE contract): every (expert, role) trellis is a contiguous block of a flat
int16 buffer at meta[e, r, 0] with k2 = meta[e, r, 1] = 2 * bits; gate/up share w13_*,
down is w2_*. The reference decodes each expert with the overlay codec
(reference.reconstruct, float64), routes, applies SiLU(gate) * up, the down projection
and the routing weights, and sums each token's top-k in float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm_exl3.codec import reference

TILE = 16
# Trellis blocks start on 16-byte boundaries: every 8 int16 elements.
OFFSET_ALIGN = 8
GATE, UP = 0, 1


@dataclass
class MoeLayer:
    w13_trellis: torch.Tensor
    w13_meta: torch.Tensor
    w13_suh: torch.Tensor
    w13_svh: torch.Tensor
    w2_trellis: torch.Tensor
    w2_meta: torch.Tensor
    w2_suh: torch.Tensor
    w2_svh: torch.Tensor
    codebook: int
    hidden: int
    width: int

    @property
    def experts(self) -> int:
        return self.w13_meta.shape[0]

    # The distinct k2 of gate/up and of down (the host copy the op takes as int[]).
    k2s: tuple[list[int], list[int]]
    meta13_host: list
    meta2_host: list

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.w13_trellis,
            self.w13_meta,
            self.w13_suh,
            self.w13_svh,
            self.w2_trellis,
            self.w2_meta,
            self.w2_suh,
            self.w2_svh,
        ]

    def block(
        self, e: int, role: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(trellis [k/16, n/16, 16K], suh [k], svh [n]) of expert e's gate (0), up (1)
        or down (2)."""
        h, i = self.hidden, self.width
        if role == 2:
            (offset, k2), flat, rows, cols = self.meta2_host[e], self.w2_trellis, i, h
            suh, svh = self.w2_suh[e], self.w2_svh[e]
        else:
            (offset, k2), flat, rows, cols = (
                self.meta13_host[e][role],
                self.w13_trellis,
                h,
                i,
            )
            suh, svh = self.w13_suh[e, role], self.w13_svh[e, role * i : (role + 1) * i]
        words = 8 * k2
        size = (rows // TILE) * (cols // TILE) * words
        t = flat[offset : offset + size].view(rows // TILE, cols // TILE, words)
        return t, suh, svh


def signed_scales(
    gen: torch.Generator, shape: Sequence[int], device: str
) -> torch.Tensor:
    mag = 0.5 + torch.rand(shape, generator=gen, device=device)
    sign = torch.where(torch.rand(shape, generator=gen, device=device) < 0.5, -1.0, 1.0)
    return (mag * sign).half()


def _pick(gen: torch.Generator, choices: Sequence[float], count: int) -> list[float]:
    idx = torch.randint(0, len(choices), (count,), generator=gen, device=gen.device)
    return [choices[j] for j in idx.tolist()]


def random_moe_layer(
    gen: torch.Generator,
    experts: int,
    hidden: int,
    width: int,
    bits: Sequence[float],
    codebook: int,
    device: str = "cuda",
    gap: bool = True,
) -> MoeLayer:
    """Every (expert, role) draws its bitrate from `bits`; `gap` leaves a few unused
    aligned words between blocks, so an offset taken from the wrong entry reads the
    wrong data."""
    roles13 = _pick(gen, bits, 2 * experts)
    roles2 = _pick(gen, bits, experts)
    meta13 = torch.zeros(experts, 2, 2, dtype=torch.int64)
    meta2 = torch.zeros(experts, 2, dtype=torch.int64)
    pad = OFFSET_ALIGN if gap else 0

    def size(b: float, rows: int, cols: int) -> int:
        return (rows // TILE) * (cols // TILE) * int(16 * b)

    t13 = 0
    for e in range(experts):
        for r in (GATE, UP):
            b = roles13[2 * e + r]
            meta13[e, r] = torch.tensor([t13, int(2 * b)])
            t13 += -(-size(b, hidden, width) // OFFSET_ALIGN) * OFFSET_ALIGN + pad
    t2 = 0
    for e in range(experts):
        b = roles2[e]
        meta2[e] = torch.tensor([t2, int(2 * b)])
        t2 += -(-size(b, width, hidden) // OFFSET_ALIGN) * OFFSET_ALIGN + pad

    def words(n: int) -> torch.Tensor:
        return torch.randint(
            -32768, 32768, (n,), generator=gen, device=device, dtype=torch.int32
        ).to(torch.int16)

    return MoeLayer(
        w13_trellis=words(t13),
        w13_meta=meta13.to(device),
        w13_suh=signed_scales(gen, (experts, 2, hidden), device),
        w13_svh=signed_scales(gen, (experts, 2 * width), device),
        w2_trellis=words(t2),
        w2_meta=meta2.to(device),
        w2_suh=signed_scales(gen, (experts, width), device),
        w2_svh=signed_scales(gen, (experts, hidden), device),
        codebook=codebook,
        hidden=hidden,
        width=width,
        k2s=(
            sorted(set(meta13[:, :, 1].flatten().tolist())),
            sorted(set(meta2[:, 1].tolist())),
        ),
        meta13_host=meta13.tolist(),
        meta2_host=meta2.tolist(),
    )


def random_routing(
    gen: torch.Generator,
    tokens: int,
    top_k: int,
    global_experts: int,
    device: str = "cuda",
    ids_dtype: torch.dtype = torch.int32,
    only: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [M, k], topk_ids [M, k]): distinct experts per token, uniform
    (or all tokens to expert `only` in slot 0, the rest uniform)."""
    scores = torch.rand(tokens, global_experts, generator=gen, device=device)
    if only is not None:
        scores[:, only] = 2.0
    ids = scores.topk(top_k, dim=1).indices
    w = torch.rand(tokens, top_k, generator=gen, device=device) + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    return w.float(), ids.to(ids_dtype)


def align(
    topk_ids: torch.Tensor,
    block: int,
    global_experts: int,
    expert_map: torch.Tensor | None = None,
    drop_nonlocal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_block_size's outputs in plain torch (same buffer sizes and sentinels).

    drop_nonlocal: like vLLM's ignore_invalid_experts=True (non-local pairs are not
    placed); else they are placed in blocks whose expert id is -1, like its default with
    an expert_map.
    """
    device = topk_ids.device
    flat = topk_ids.flatten().long().cpu()
    numel = flat.numel()
    valid = (flat >= 0) & (flat < global_experts)
    glob = torch.where(valid, flat, torch.full_like(flat, -1))
    if expert_map is not None:
        emap = expert_map.long().cpu()
        local = torch.where(valid, emap[glob.clamp(min=0)], torch.full_like(flat, -1))
    else:
        local = glob
    key = local if drop_nonlocal else glob
    padded = numel + global_experts * (block - 1)
    if numel < global_experts:
        padded = min(numel * block, padded)
    sorted_ids = torch.full((padded,), numel, dtype=torch.int32)
    blocks = torch.full((math.ceil(padded / block),), -1, dtype=torch.int32)
    pos = 0
    for e in range(global_experts):
        idx = torch.nonzero(key == e).flatten()
        if idx.numel() == 0:
            continue
        sorted_ids[pos : pos + idx.numel()] = idx.to(torch.int32)
        span = -(-idx.numel() // block) * block
        lid = e if drop_nonlocal else (int(emap[e]) if expert_map is not None else e)
        blocks[pos // block : (pos + span) // block] = lid
        pos += span
    return (
        sorted_ids.to(device),
        blocks.to(device),
        torch.tensor([pos], dtype=torch.int32, device=device),
    )


def reference_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer: MoeLayer,
    expert_map: torch.Tensor | None,
    global_experts: int,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """float64 [M, h]: each token's sum over its local top-k of w * down(SiLU(gate) *
    up)."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < global_experts)
    if expert_map is not None:
        local = torch.where(
            valid,
            expert_map.long()[ids.clamp(0, global_experts - 1)],
            torch.full_like(ids, -1),
        )
    else:
        local = torch.where(valid, ids, torch.full_like(ids, -1))
    out = torch.zeros(x.shape[0], layer.hidden, dtype=torch.float64, device=x.device)
    xd = x.double()
    for e in torch.unique(local).tolist():
        if e < 0:
            continue
        rows, slots = torch.nonzero(local == e, as_tuple=True)
        w = [
            reference.reconstruct(
                *layer.block(e, r), layer.codebook, dtype=torch.float64
            )
            for r in (0, 1, 2)
        ]
        xe = xd[rows]
        rw = topk_weights[rows, slots].double()[:, None]
        if weight_on_input:
            xe = xe * rw
        g, u = xe @ w[0], xe @ w[1]
        y = (torch.nn.functional.silu(g) * u) @ w[2]
        if not weight_on_input:
            y = y * rw
        out.index_add_(0, rows, y)
    return out


def run_op(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer: MoeLayer,
    block: int,
    global_experts: int,
    expert_map: torch.Tensor | None = None,
    deterministic: bool = True,
    weight_on_input: bool = False,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    splits: tuple[int, int] = (1, 1),
    workspace: torch.Tensor | None = None,
    wgmma: int = -1,
    pairs: bool = False,
) -> torch.Tensor:
    """torch.ops._C.exl3_moe with the plain-torch alignment (or the one given) and
    the given k-splits (gate/up, down); their workspace NaN-filled unless given, so a
    partial sum read before it was written shows. wgmma: the op's engine argument (-1
    the op's choice, 0 mma.sync, 1 wgmma). pairs: the op's pairs layout instead (no
    alignment passed; `block` rows per routed pair)."""
    if pairs:
        assert aligned is None, "the pairs layout takes no alignment"
        sorted_ids = expert_ids = post_pad = None
    else:
        sorted_ids, expert_ids, post_pad = aligned or align(
            topk_ids, block, global_experts, expert_map
        )
    if workspace is None and splits != (1, 1):
        m, top_k = topk_ids.shape
        floats = split_workspace_floats(m, top_k, layer.hidden, layer.width, *splits)
        workspace = torch.full(
            (floats,), float("nan"), dtype=torch.float32, device=x.device
        )
    k13, k2 = layer.k2s
    return torch.ops._C.exl3_moe(
        x,
        topk_weights,
        topk_ids,
        sorted_ids,
        expert_ids,
        post_pad,
        expert_map,
        *layer.tensors(),
        block,
        k13,
        k2,
        global_experts,
        layer.codebook,
        weight_on_input,
        deterministic,
        *splits,
        workspace,
        wgmma,
    )


def split_workspace_floats(
    tokens: int, top_k: int, hidden: int, width: int, gate_up: int, down: int
) -> int:
    """The op's split-k workspace in float32 elements: gate/up's partial rows
    [splits][2][pairs][width], then down's [splits][pairs][hidden]; none for an unsplit
    GEMM."""
    pairs = tokens * top_k
    return (gate_up * 2 * pairs * width if gate_up > 1 else 0) + (
        down * pairs * hidden if down > 1 else 0
    )
