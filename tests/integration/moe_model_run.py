# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A whole EXL3 MoE checkpoint through vLLM's own model loader on CPU, run for a few
tokens.

Stand-ins for what does not exist on a GPU-less machine, each doing the same math in
plain torch:
* the attention op: causal SDPA over one sequence (MHA; for MLA, constructed in place of
  vLLM's MLAAttention, kv_b_proj decompressing the latent);
* `ops.topk_softmax` / `ops.topk_sigmoid` (CUDA-only) behind vLLM's FusedTopKRouter.
  Everything else (embedding, norms, RoPE, every EXL3 linear, vLLM's routers and
  MoERunner, the
EXL3 MoE method, shared experts, lm_head) is vLLM's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CPU_ATTENTION_BACKEND = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


class CausalSdpa(nn.Module):
    """Stands in for vLLM's Attention op: q/k/v [T, heads * head_dim] of one
    sequence.
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scale = (
            heads,
            kv_heads,
            head_dim,
            scale,
        )

    def forward(self, q, k, v):
        t = q.shape[0]
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)
        k, v = (
            z.view(t, self.kv_heads, self.head_dim)
            .transpose(0, 1)
            .repeat_interleave(self.heads // self.kv_heads, 0)
            for z in (k, v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(0, 1).reshape(t, self.heads * self.head_dim)


class CausalMla(nn.Module):
    """Stands in for vLLM's MLAAttention (constructed in its place): q [T, H, nope +
    rope], the normed latent kv_c [T, kv_rank] and the roped k_pe [T, 1, rope] -> [T, H
    * v], the latent decompressed by kv_b_proj."""

    def __init__(
        self,
        num_heads: int,
        scale: float,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_b_proj: nn.Module,
        **unused,
    ):
        super().__init__()
        self.kv_b_proj = kv_b_proj
        self.heads, self.nope, self.v_dim, self.scale = (
            num_heads,
            qk_nope_head_dim,
            v_head_dim,
            scale,
        )

    def forward(self, q, kv_c_normed, k_pe, output_shape=None):
        t = q.shape[0]
        kv = self.kv_b_proj(kv_c_normed)[0].view(t, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(t, self.heads, k_pe.shape[-1])], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.scale,
        )
        return out.transpose(0, 1).reshape(t, self.heads * self.v_dim)


def _topk_writer(score):
    """A pure-torch `vllm_topk_softmax` / `vllm_topk_sigmoid`: fills the output
    buffers.
    """

    def topk(
        topk_weights,
        topk_indices,
        token_expert_indices,
        gating_output,
        renormalize=False,
    ):
        scores = score(gating_output.float())
        weights, ids = scores.topk(topk_weights.shape[1], dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        topk_weights.copy_(weights)
        topk_indices.copy_(ids.to(topk_indices.dtype))
        return topk_weights, topk_indices

    return topk


def patch_cpu_routing(monkeypatch) -> None:
    from vllm.model_executor.layers.fused_moe.router import fused_topk_router

    monkeypatch.setattr(
        fused_topk_router,
        "vllm_topk_softmax",
        _topk_writer(lambda g: torch.softmax(g, dim=-1)),
    )
    monkeypatch.setattr(
        fused_topk_router, "vllm_topk_sigmoid", _topk_writer(torch.sigmoid)
    )


def cpu_stand_ins(monkeypatch) -> None:
    from vllm.model_executor.layers import mla
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        current_platform,
        "get_attn_backend_cls",
        lambda *args, **kwargs: CPU_ATTENTION_BACKEND,
    )
    # vLLM's MLA backends need CUDA even to be constructed.
    monkeypatch.setattr(mla, "MLAAttention", CausalMla)
    # Read when Gated DeltaNet layers are constructed; a GPU-less platform has none.
    if current_platform.current_device is None:
        monkeypatch.setattr(
            current_platform, "current_device", lambda: torch.device("cpu")
        )
    patch_cpu_routing(monkeypatch)


def load_target_and_draft(ckpt_dir, monkeypatch, dtype: str = "float16"):
    """(target, draft, vllm_config): the model and its MTP draft (vLLM's
    SpeculativeConfig for method "mtp"), both built with the one quant config of the
    VllmConfig."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.model_executor.model_loader import get_model_loader

    cpu_stand_ins(monkeypatch)
    model_config = ModelConfig(model=str(ckpt_dir), dtype=dtype)
    speculative = SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=1,
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        speculative_config=speculative,
        device_config=DeviceConfig("cpu"),
    )
    loader = get_model_loader(vllm_config.load_config)
    target = loader.load_model(vllm_config=vllm_config, model_config=model_config)
    draft = loader.load_model(
        vllm_config=vllm_config, model_config=speculative.draft_model_config
    )
    return target, draft, vllm_config


def load_model(ckpt_dir, monkeypatch, dtype: str = "bfloat16"):
    """(model, vllm_config) of vLLM's loader at the TP size of the current vLLM
    world.
    """
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model_loader

    cpu_stand_ins(monkeypatch)
    model_config = ModelConfig(model=str(ckpt_dir), dtype=dtype)
    assert model_config.quantization == "exl3"
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    model = get_model_loader(vllm_config.load_config).load_model(
        vllm_config=vllm_config, model_config=model_config
    )
    return model, vllm_config


def run_logits(model, vllm_config, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a loaded model for one sequence, the attention ops replaced by
    stand-ins."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with (
        set_current_vllm_config(vllm_config),
        set_forward_context(None, vllm_config),
        torch.no_grad(),
        torch.compiler.set_stance("force_eager"),
    ):
        for layer in model.model.layers:
            attn = layer.self_attn
            if not hasattr(attn, "mla_attn"):
                attn.attn = CausalSdpa(
                    attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
                )
        positions = torch.arange(len(ids))
        hidden, residual = model.model.embed_input_ids(ids), None
        for layer in model.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = model.model.norm(hidden, residual)
        return model.compute_logits(hidden).float()


def vllm_logits(
    ckpt_dir, ids: torch.Tensor, monkeypatch, dtype: str = "bfloat16"
) -> tuple[torch.Tensor, nn.Module]:
    """Logits of vLLM's model for one sequence, at the TP size of the current vLLM
    world."""
    model, vllm_config = load_model(ckpt_dir, monkeypatch, dtype)
    return run_logits(model, vllm_config, ids), model
