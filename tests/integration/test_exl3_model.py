# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The whole fixture checkpoint through vLLM's own model loader on CPU: ModelConfig
resolves "exl3" from config.json, DefaultModelLoader builds Qwen3ForCausalLM with
Exl3Config and streams the safetensors through the model's load_weights,
process_weights_after_loading picks the reference kernel. The loaded model's logits are
compared with transformers' Qwen3 running the same weights decoded to dense by the
reference.

vLLM's attention kernels do not exist on a GPU-less machine, so the attention op itself
is replaced by causal SDPA (the backend class is only needed to construct the layers);
everything else (embedding, norms, RoPE, every EXL3 linear, lm_head, logits processor)
is vLLM's.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from exl3_harness import CKPT_3INST, CKPT_MCG, FIXTURES, checkpoint_copy, dense, tensors
from torch import nn

CPU_ATTENTION_BACKEND = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
TOKENS = 96


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


def token_ids() -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(FIXTURES / "tokenizer" / "tokenizer.json"))
    text = (FIXTURES / "val.txt").read_text()[:4000]
    return torch.tensor(tok.encode(text).ids[:TOKENS])


def vllm_logits(
    ckpt_dir, ids: torch.Tensor, monkeypatch, dtype: str = "bfloat16"
) -> tuple[torch.Tensor, nn.Module]:
    """Logits of vLLM's model for one sequence, at the TP size of the current vLLM
    world."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        current_platform,
        "get_attn_backend_cls",
        lambda *args, **kwargs: CPU_ATTENTION_BACKEND,
    )
    model_config = ModelConfig(model=str(ckpt_dir), dtype=dtype)
    assert model_config.quantization == "exl3"
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    model = get_model_loader(vllm_config.load_config).load_model(
        vllm_config=vllm_config, model_config=model_config
    )
    # On CPU vLLM compiles the native SiluAndMul with inductor (~10 s per process);
    # eager runs the same math.
    with (
        set_current_vllm_config(vllm_config),
        torch.no_grad(),
        torch.compiler.set_stance("force_eager"),
    ):
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.attn = CausalSdpa(
                attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
            )
        positions = torch.arange(len(ids))
        hidden, residual = model.model.embed_input_ids(ids), None
        for layer in model.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = model.model.norm(hidden, residual)
        return model.compute_logits(hidden).float(), model


def transformers_logits(ckpt, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' Qwen3 with every EXL3 linear replaced by its reference-decoded
    weight."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("quantization_config")
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    named = tensors(ckpt)
    state = {}
    for name in model.state_dict():
        module = name.rpartition(".")[0]
        if f"{module}.trellis" in named:
            state[name] = dense(named, module).t()
        else:
            state[name] = named[name].float()
    model.load_state_dict(state)
    model.to(dtype)
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", [CKPT_3INST, CKPT_MCG], ids=["3inst-4bpw", "mcg-3bpw"])
def test_whole_model_logits_match_transformers(ckpt, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod
    from vllm.model_executor.layers.quantization.exl3.lm_head import Exl3LMHeadMethod

    ids = token_ids()
    got, model = vllm_logits(
        checkpoint_copy(ckpt, tmp_path / "ckpt", tokenizer=True), ids, monkeypatch
    )
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * 4  # qkv, o, gate_up, down per layer
    assert all(isinstance(m.quant_method, Exl3LinearMethod) for m in linears)
    assert isinstance(model.lm_head.quant_method, Exl3LMHeadMethod)
    assert got.shape == (TOKENS, 4096)

    exact = transformers_logits(ckpt, ids, torch.float32)
    bf16 = transformers_logits(ckpt, ids, torch.bfloat16)
    err = (got - exact).abs().max().item()
    bf16_err = (bf16 - exact).abs().max().item()
    # vLLM runs in bf16: its distance to the fp32 truth must be that of a bf16 run.
    assert err <= 2 * bf16_err, (
        f"max |logit err| {err:.4f}, transformers bf16 {bf16_err:.4f}"
    )
    agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    bf16_agree = (bf16.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= bf16_agree - 0.03, (
        f"top-1 agreement {agree:.3f} vs bf16 {bf16_agree:.3f}"
    )
