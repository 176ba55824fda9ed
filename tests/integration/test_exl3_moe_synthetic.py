# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A synthetic EXL3 checkpoint of each MoE architecture both ExLlamaV3 1.6.5 and vLLM 0.26 run,
written in ExLlamaV3's layout (tests/synthetic_checkpoint.py, names from its architecture
files), loaded through vLLM's own model loader, every MoE block checked against the oracle
(moe_blocks.py). Bitrates differ between experts and between gate, up and down, so one layer's
per-expert rate table is exercised on every architecture."""

from __future__ import annotations

import pytest

from moe_blocks import check_moe_blocks
from moe_checkpoints import link_tokenizer
from moe_model_run import load_model

import synthetic_checkpoint as synth

MODEL_DTYPE = "float16"
# Two decoder layers: one MoE layer at least in every preset (DeepSeek-V3 and GLM-4.5 start with a
# dense one).
LAYERS = 2
# (preset, codebook, default bits, per-module overrides: first fnmatch pattern wins)
ARCHITECTURES = {
    "qwen3-moe": ("qwen3-moe-tiny", "mcg", 4,
                  {"*.experts.1.*": 2, "*.experts.2.down_proj": 5, "*.experts.3.up_proj": 3}),
    "deepseek-v3": ("deepseek-v3-tiny", "3inst", 3,
                    {"*.experts.0.*": 4, "*.experts.5.gate_proj": 2, "*.experts.*.down_proj": 5}),
    "glm4-moe": ("glm4-moe-tiny", "mul1", 4,
                 {"*.experts.2.*": 2.5, "*.experts.6.up_proj": 3.5, "*.experts.7.down_proj": 6}),
    "mixtral": ("mixtral-tiny", "mcg", 3, {"*.experts.4.w2": 4, "*.experts.5.*": 2}),
}


def write(arch: str, out, **kwargs):
    preset, codebook, bits, overrides = ARCHITECTURES[arch]
    synth.write_checkpoint(preset, out, bits=bits, codebook=codebook,
                           bits_overrides=overrides, mtp=False, seed=7, layers=LAYERS,
                           **kwargs)
    link_tokenizer(out)
    return out


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_synthetic_architecture(arch, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod

    ckpt = write(arch, tmp_path / arch)
    model, vllm_config = load_model(ckpt, monkeypatch, MODEL_DTYPE)
    methods = [m.quant_method for n, m in model.named_modules()
               if n.endswith("routed_experts")]
    assert methods and all(isinstance(q, Exl3MoEMethod) for q in methods)
    # The per-expert rate table holds every rate the overrides asked for (k2 = 2 * bits).
    _, _, bits, overrides = ARCHITECTURES[arch]
    k2 = set()
    for name, module in model.named_modules():
        if name.endswith("routed_experts"):
            k2 |= set(module.w13_meta[..., 1].flatten().tolist())
            k2 |= set(module.w2_meta[:, 1].tolist())
    assert k2 == {int(2 * b) for b in (bits, *overrides.values())}, sorted(k2)
    assert check_moe_blocks(ckpt, model, vllm_config) >= 1
