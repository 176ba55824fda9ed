# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each real fixture MoE conversion (its leading layers, tests/fixtures/moe) through
vLLM's own model loader on CPU: Qwen3MoeForCausalLM and DeepseekV3ForCausalLM (MLA with
EXL3 q_a/q_b/kv_a (192 outputs padded to 256)/o, kv_b as stored fp16, a dense first
layer, sigmoid routing with the correction bias, a shared expert) built with Exl3Config,
the weights streamed through the models' load_weights, then a forward of a few tokens
compared with transformers' own model class running the same checkpoint decoded to dense
by the reference codec (moe_checkpoints.py)."""

from __future__ import annotations

import pytest
import torch
from moe_checkpoints import FIXTURE_SUBSETS, TOKENIZER, assemble, transformers_model
from moe_model_run import vllm_logits

TOKENS = 32
# fp16, the finer of the two activation dtypes EXL3 accepts: in bf16 a near-tie in the
# router logits can pick another expert for one token on one side only (seen: one token
# of 32, +0.4).
MODEL_DTYPE = "float16"
REPO_VAL = TOKENIZER.parent / "val.txt"


def token_ids(count: int = TOKENS) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    return torch.tensor(tok.encode(REPO_VAL.read_text()[:2000]).ids[:count])


def reference_logits(ckpt, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    model = transformers_model(ckpt, dtype)
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def check_against_transformers(ckpt, got: torch.Tensor, ids: torch.Tensor) -> None:
    """vLLM runs in fp16: its distance to the fp32 truth must be that of an fp16 run."""
    exact = reference_logits(ckpt, ids, torch.float32)
    half = reference_logits(ckpt, ids, getattr(torch, MODEL_DTYPE))
    err = (got - exact).abs().max().item()
    half_err = (half - exact).abs().max().item()
    assert err <= 2 * half_err, (
        f"max |logit err| {err:.4f}, transformers fp16 {half_err:.4f}"
    )
    agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"top-1 agreement with the fp32 truth {agree:.3f}"


@pytest.mark.parametrize("name", list(FIXTURE_SUBSETS))
def test_fixture_model_matches_transformers(name, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod

    ckpt = assemble(name, tmp_path / "ckpt")
    ids = token_ids()
    got, model = vllm_logits(ckpt, ids, monkeypatch, dtype=MODEL_DTYPE)
    moe_methods = [
        m.quant_method for n, m in model.named_modules() if n.endswith("routed_experts")
    ]
    assert moe_methods and all(isinstance(q, Exl3MoEMethod) for q in moe_methods)
    exl3_linears = [
        n
        for n, m in model.named_modules()
        if isinstance(m, LinearBase) and isinstance(m.quant_method, Exl3LinearMethod)
    ]
    if name.startswith("dsv3"):
        # MLA (fused q_a + kv_a, q_b, o), the dense layer's MLP, the shared expert.
        assert any(n.endswith("fused_qkv_a_proj") for n in exl3_linears), exl3_linears
        assert any(n.endswith("shared_experts.down_proj") for n in exl3_linears)
        kv_b = model.model.layers[1].self_attn.kv_b_proj
        assert not isinstance(kv_b.quant_method, Exl3LinearMethod)
    assert got.shape == (TOKENS, 4096)
    assert torch.isfinite(got).all()
    check_against_transformers(ckpt, got, ids)
