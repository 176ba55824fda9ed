# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MTP draft layers of an EXL3 checkpoint (DeepSeek-V3 and GLM-4.5 layouts: enorm,
hnorm, an EXL3 eh_proj, a whole decoder layer with EXL3 attention and MoE,
shared_head.norm; the MTP head is not stored, vLLM's proposer shares the target's) load
through vLLM's MTP model classes with the target's own quant config: target and draft
built from one VllmConfig, their layers distinct, the draft's eh_proj and MoE block
equal to the checkpoint decoded by the reference."""

from __future__ import annotations

import pytest
import synthetic_checkpoint as synth
import torch
from moe_blocks import check_moe_blocks
from moe_checkpoints import decoded_modules, link_tokenizer
from moe_model_run import load_target_and_draft
from test_exl3_moe_synthetic import ARCHITECTURES, LAYERS, MODEL_DTYPE

MTP_BITS = 5  # the draft layers at their own rate (the converter's mtp_bits)


@pytest.mark.parametrize("arch", ["deepseek-v3", "glm4-moe"])
def test_mtp_draft_loads_exl3_layers(arch, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod

    preset, codebook, bits, _ = ARCHITECTURES[arch]
    cfg = synth.load_config(preset)
    cfg["num_nextn_predict_layers"] = 1
    ckpt = tmp_path / arch
    written = synth.write_checkpoint(
        cfg,
        ckpt,
        bits=bits,
        codebook=codebook,
        mtp_bits=MTP_BITS,
        layers=LAYERS,
        seed=9,
    )
    link_tokenizer(ckpt)
    mtp = f"model.layers.{LAYERS}"
    assert written[f"{mtp}.eh_proj"][0] == MTP_BITS
    assert written[f"{mtp}.mlp.experts.0.down_proj"][0] == MTP_BITS

    target, draft, vllm_config = load_target_and_draft(ckpt, monkeypatch, MODEL_DTYPE)
    layer = draft.model.layers[str(LAYERS)]
    assert isinstance(layer.eh_proj.quant_method, Exl3LinearMethod)
    draft_moe = layer.mtp_block.mlp.experts.routed_experts
    assert isinstance(draft_moe.quant_method, Exl3MoEMethod)
    assert set(draft_moe.w13_meta[..., 1].flatten().tolist()) == {2 * MTP_BITS}
    # One quant config, no collision: the draft's MoE layer is registered next to the
    # target's under its own name.
    names = vllm_config.compilation_config.static_forward_context
    assert f"{mtp}.mlp.experts" in names and "model.layers.1.mlp.experts" in names
    assert draft_moe is not target.model.layers[1].mlp.experts.routed_experts

    x = torch.randn(
        6, 2 * cfg["hidden_size"], generator=torch.Generator().manual_seed(4)
    )
    with torch.no_grad():
        y = layer.eh_proj(x.to(getattr(torch, MODEL_DTYPE)))
    w = decoded_modules(ckpt, (f"{mtp}.eh_proj",))[f"{mtp}.eh_proj"]
    expected = x.double() @ w.double()
    err = (y.double() - expected).abs().max().item()
    assert err <= 4e-3 * expected.abs().max().item(), f"eh_proj: max |err| {err:.3g}"
    assert check_moe_blocks(ckpt, draft, vllm_config) == 1
