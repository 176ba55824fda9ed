# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MoE layer in plain torch from decoded weights, and vLLM's FusedMoE built and
loaded the way a model does: the two sides of the layer-level CPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over experts, top-k, optionally
    renormalised. The signature of vLLM's custom_routing_function."""
    probs = torch.softmax(gating_output.float(), dim=-1)
    weights, ids = probs.topk(topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.float(), ids.to(torch.int32)


def expert_mlp(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """down(SiLU(gate x) * up x) with decoded [k, n] weights (y = x @ W), fp64."""
    x = x.double()
    return (F.silu(x @ gate.double()) * (x @ up.double())) @ down.double()


def moe_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    dense: dict[str, torch.Tensor],
    experts_prefix: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    width: int | None = None,
    local: set[int] | None = None,
) -> torch.Tensor:
    """sum over each token's top-k of weight * expert(x), fp64; `width`, when given,
    keeps the expert columns [0, width) only (unpadded); `local` restricts to those
    experts."""
    out = torch.zeros(
        x.shape[0],
        dense[f"{experts_prefix}.0.{names[2]}"].shape[1],
        dtype=torch.float64,
    )
    for e in torch.unique(ids).tolist():
        if local is not None and e not in local:
            continue
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        g, u, d = (dense[f"{experts_prefix}.{e}.{n}"] for n in names)
        if width is not None:
            g, u, d = g[:, :width], u[:, :width], d[:width]
        out[rows] += weights[rows, slots, None].double() * expert_mlp(x[rows], g, u, d)
    return out
