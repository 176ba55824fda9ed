# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every MoE block of a model loaded by vLLM, run on random hidden states, against the
oracle: the routing of each architecture written out in plain torch from the block's own
router logits (vLLM's gate module, unquantized, so both sides rank the same numbers),
the experts and shared experts decoded from the checkpoint by the reference codec,
summed in fp64."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from moe_checkpoints import decoded_modules
from moe_oracle import expert_mlp, moe_reference
from safetensors.torch import load_file

# Relative max error of the fp16 model's block output against the fp64 oracle: fp16
# inputs and outputs (2^-11 each) plus fp16 intermediates in the shared expert; a wrong
# expert, a misplaced block or a wrong routing weight is off by O(1).
BLOCK_RTOL = 4e-3
TOKENS = 20


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    named = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        named.update(load_file(str(f)))
    return named


def moe_blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """(checkpoint prefix, block) of every MoE block: the modules holding an `experts`
    runner."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    out = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "experts", None), MoERunner):
            # An MTP draft nests its decoder layer as `mtp_block`; the checkpoint does
            # not.
            name = name.replace(".mtp_block", "")
            out.append((name if name.startswith("model.") else f"model.{name}", module))
    return out


def route(cfg: dict, logits: torch.Tensor, bias: torch.Tensor | None):
    """(weights fp64 [T, k], ids [T, k]) as the architecture routes, from router
    logits.
    """
    top_k = cfg["num_experts_per_tok"]
    logits = logits.double()
    if cfg["model_type"] in ("deepseek_v3", "glm4_moe"):
        scores = logits.sigmoid()
        biased = scores + bias.double()
        t, groups = logits.shape[0], cfg["n_group"]
        group_scores = biased.view(t, groups, -1).topk(2, dim=-1)[0].sum(-1)
        kept = torch.zeros_like(group_scores).scatter_(
            1, group_scores.topk(cfg["topk_group"], dim=-1)[1], 1.0
        )
        mask = kept.repeat_interleave(logits.shape[1] // groups, dim=1).bool()
        ids = biased.masked_fill(~mask, float("-inf")).topk(top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if cfg.get("norm_topk_prob", True):
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * cfg.get("routed_scaling_factor", 1.0), ids
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    if cfg["model_type"] == "mixtral" or cfg.get("norm_topk_prob", False):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def block_oracle(
    cfg: dict,
    named: dict,
    dense: dict,
    prefix: str,
    x: torch.Tensor,
    logits: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The block's output as vLLM defines it for x's dtype."""
    weights, ids = route(cfg, logits, bias)
    scale = cfg.get("routed_scaling_factor", 1.0) if "n_group" in cfg else 1.0
    if x.dtype == torch.float16 and cfg.get("n_shared_experts"):
        # vLLM's fp16 overflow guard (MoERunner.apply_routed_output_transform): with
        # shared experts the block returns routed + shared / factor, i.e. the output /
        # factor, and the decoder layers carry the residual scaled the same way.
        weights = weights / scale
    mixtral = cfg["model_type"] == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    width = cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]
    out = moe_reference(x, weights, ids, dense, f"{prefix}.experts", names, width=width)
    if cfg.get("n_shared_experts"):
        s = f"{prefix}.shared_experts"
        w = width * cfg["n_shared_experts"]
        shared = expert_mlp(
            x,
            dense[f"{s}.gate_proj"][:, :w],
            dense[f"{s}.up_proj"][:, :w],
            dense[f"{s}.down_proj"][:w],
        )
        out += shared / scale if x.dtype == torch.float16 else shared
    if cfg.get("shared_expert_intermediate_size"):
        s = f"{prefix}.shared_expert"
        w = cfg["shared_expert_intermediate_size"]
        gate = torch.sigmoid(
            x.double() @ named[f"{prefix}.shared_expert_gate.weight"].double().t()
        )
        out += gate * expert_mlp(
            x,
            dense[f"{s}.gate_proj"][:, :w],
            dense[f"{s}.up_proj"][:, :w],
            dense[f"{s}.down_proj"][:w],
        )
    return out


def check_moe_blocks(ckpt: Path, model, vllm_config, seed: int = 0) -> int:
    """Run every MoE block of `model` against the oracle; returns how many were
    checked.
    """
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    cfg = json.loads((ckpt / "config.json").read_text())
    named = checkpoint_tensors(ckpt)
    blocks = moe_blocks(model)
    dense = decoded_modules(ckpt, tuple(f"{prefix}." for prefix, _ in blocks))
    dtype = vllm_config.model_config.dtype
    gen = torch.Generator().manual_seed(seed)
    for prefix, block in blocks:
        x = torch.randn(TOKENS, cfg["hidden_size"], generator=gen).to(dtype)
        with (
            set_current_vllm_config(vllm_config),
            set_forward_context(None, vllm_config),
            torch.no_grad(),
            torch.compiler.set_stance("force_eager"),
        ):
            logits = block.gate(x.to(block.gate.weight.dtype))
            logits = logits[0] if isinstance(logits, tuple) else logits
            y = block(x)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            stored = named[f"{prefix}.gate.e_score_correction_bias"]
            assert torch.allclose(bias.double(), stored.double(), rtol=1e-3), prefix
        expected = block_oracle(cfg, named, dense, prefix, x, logits, bias)
        err = (y.double() - expected).abs().max().item()
        scale = expected.abs().max().item()
        assert torch.isfinite(y).all() and scale > 0, prefix
        assert err <= BLOCK_RTOL * scale, (
            f"{prefix}: max |err| {err:.3g}, scale {scale:.3g}"
        )
    return len(blocks)
