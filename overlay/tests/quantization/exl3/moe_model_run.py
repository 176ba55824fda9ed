# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A whole EXL3 MoE checkpoint through vLLM's own model loader on CPU, run for a few
tokens, and every MoE block of it checked against the oracle.

Stand-ins for what does not exist on a GPU-less machine, each doing the same math in
plain torch:
* the attention op: causal SDPA over one sequence (MHA; for MLA, constructed in place of
  vLLM's MLAAttention, kv_b_proj decompressing the latent);
* `ops.topk_softmax` / `ops.topk_sigmoid` (CUDA-only) behind vLLM's FusedTopKRouter.
Everything else (embedding, norms, RoPE, every EXL3 linear, vLLM's routers and
MoERunner, the EXL3 MoE method, shared experts, lm_head) is vLLM's.

The block check (`check_moe_blocks`) runs each block on random hidden states against
the oracle: the routing of each architecture written out in plain torch from the
block's own router logits (vLLM's gate module, unquantized, so both sides rank the same
numbers), the experts and shared experts decoded from the checkpoint by the reference
codec, summed in fp64.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from .exl3_harness import CPU_ATTENTION_BACKEND, CausalSdpa
from .moe_checkpoints import decoded_modules
from .moe_oracle import expert_mlp, moe_reference


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
    # A DSA model allocates its top-k index buffer on the platform's device type.
    if not current_platform.device_type:
        monkeypatch.setattr(current_platform, "device_type", "cpu")
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
    with restored_default_dtype():
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


def load_model(ckpt_dir, monkeypatch, dtype: str = "bfloat16", **model_config):
    """(model, vllm_config) of vLLM's loader at the TP size of the current vLLM
    world; `model_config`: further ModelConfig fields (e.g. language_model_only).
    """
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model_loader

    cpu_stand_ins(monkeypatch)
    model_config = ModelConfig(model=str(ckpt_dir), dtype=dtype, **model_config)
    assert model_config.quantization == "exl3"
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    with restored_default_dtype():
        model = get_model_loader(vllm_config.load_config).load_model(
            vllm_config=vllm_config, model_config=model_config
        )
    return model, vllm_config


@contextlib.contextmanager
def restored_default_dtype():
    """vLLM's set_default_torch_dtype does not restore torch's default dtype when
    loading raises (the tests of damaged checkpoints expect it to); a later test would
    build its tensors in the model's dtype."""
    default_dtype = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(default_dtype)


# Relative max error of an EXL3 linear against x @ W (+ b) in fp64 (x already in the
# model's dtype); a wrong shard, column or scale is off by O(1).
LINEAR_RTOL = 4e-3


def exl3_linear_calls(model, vllm_config, hidden: int, dtype, seed: int, tokens: int):
    """(vLLM layer name, layer, x, y) for every EXL3 linear of a loaded model on
    random x in `dtype`, then ("lm_head", None, x, logits) through compute_logits."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod

    gen = torch.Generator().manual_seed(seed)
    for name, layer in model.named_modules():
        if not isinstance(getattr(layer, "quant_method", None), Exl3LinearMethod):
            continue
        x = torch.randn(tokens, layer.input_size, generator=gen).to(dtype)
        with torch.no_grad():
            y = layer(x)
        yield name, layer, x, (y[0] if isinstance(y, tuple) else y)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    with set_current_vllm_config(vllm_config), torch.no_grad():
        logits = model.compute_logits(x)
    yield "lm_head", None, x, logits


def assert_linear_matches(y: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert y.shape == expected.shape, (what, y.shape, expected.shape)
    assert torch.isfinite(y).all(), what
    err = (y.double() - expected).abs().max().item()
    assert err <= LINEAR_RTOL * expected.abs().max().item(), f"{what}: {err:.3g}"


def record_unloaded(monkeypatch, model_cls) -> set[str]:
    """Parameters the model's load_weights leaves unwritten, filled in when it runs
    (vLLM tracks them only for unquantized models)."""
    unloaded: set[str] = set()
    original = model_cls.load_weights

    def load_weights(self, weights):
        wanted = {name for name, _ in self.named_parameters()}
        loaded = original(self, weights)
        unloaded.update(wanted - set(loaded))
        return loaded

    monkeypatch.setattr(model_cls, "load_weights", load_weights)
    return unloaded


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
            if hasattr(attn, "qk_head_dim") and not hasattr(attn, "mla_attn"):
                # DeepSeek's MHA form (VLLM_MLA_DISABLE=1): v padded to qk_head_dim.
                heads = attn.num_local_heads
                attn.attn = CausalSdpa(heads, heads, attn.qk_head_dim, attn.scaling)
            elif not hasattr(attn, "mla_attn"):
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


# Every MoE block of a model loaded by vLLM, run on random hidden states, against the
# oracle: the routing of each architecture written out in plain torch from the block's
# own router logits (vLLM's gate module, unquantized, so both sides rank the same
# numbers), the experts and shared experts decoded from the checkpoint by the reference
# codec, summed in fp64.

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


def moe_blocks(model, checkpoint_name=None) -> list[tuple[str, torch.nn.Module]]:
    """(checkpoint prefix, block) of every MoE block: the modules holding an `experts`
    runner. `checkpoint_name` maps a module name to its checkpoint prefix where the
    default rule (below) does not hold."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    out = []
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "experts", None), MoERunner):
            continue
        if checkpoint_name is not None:
            out.append((checkpoint_name(name), module))
            continue
        # An MTP draft nests its decoder layer as `mtp_block`; the checkpoint does
        # not.
        name = name.replace(".mtp_block", "")
        out.append((name if name.startswith("model.") else f"model.{name}", module))
    return out


# Model types routing DeepSeek-V3's way: sigmoid scores, the correction bias, group
# top-k.
SIGMOID_GROUP_ROUTED = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa")


def route(cfg: dict, logits: torch.Tensor, bias: torch.Tensor | None):
    """(weights fp64 [T, k], ids [T, k]) as the architecture routes, from router
    logits.
    """
    top_k = cfg["num_experts_per_tok"]
    logits = logits.double()
    if cfg["model_type"] in SIGMOID_GROUP_ROUTED:
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


def check_moe_blocks(
    ckpt: Path, model, vllm_config, seed: int = 0, checkpoint_name=None
) -> int:
    """Run every MoE block of `model` against the oracle; returns how many were
    checked. `checkpoint_name`: as for moe_blocks.
    """
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    cfg = json.loads((ckpt / "config.json").read_text())
    # A multimodal model's config keeps the text model's keys under text_config.
    cfg = cfg.get("text_config", cfg)
    named = checkpoint_tensors(ckpt)
    blocks = moe_blocks(model, checkpoint_name)
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
