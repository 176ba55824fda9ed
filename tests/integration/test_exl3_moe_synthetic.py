# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A synthetic EXL3 checkpoint of each MoE architecture both ExLlamaV3 1.6.5 and vLLM
0.26 run, written in ExLlamaV3's layout (tests/synthetic_checkpoint.py, names from its
architecture files), loaded through vLLM's own model loader, every MoE block checked
against the oracle (moe_blocks.py). Bitrates differ between experts and between gate, up
and down, so one layer's per-expert rate table is exercised on every architecture."""

from __future__ import annotations

import pytest
import synthetic_checkpoint as synth
from moe_blocks import check_moe_blocks
from moe_checkpoints import link_tokenizer
from moe_model_run import load_model

MODEL_DTYPE = "float16"
# Two decoder layers: one MoE layer at least in every preset (DeepSeek-V3 and GLM-4.5
# start with a dense one).
LAYERS = 2
# (preset, codebook, default bits, per-module overrides: first fnmatch pattern wins)
ARCHITECTURES = {
    "qwen3-moe": (
        "qwen3-moe-tiny",
        "mcg",
        4,
        {"*.experts.1.*": 2, "*.experts.2.down_proj": 5, "*.experts.3.up_proj": 3},
    ),
    "deepseek-v3": (
        "deepseek-v3-tiny",
        "3inst",
        3,
        {"*.experts.0.*": 4, "*.experts.5.gate_proj": 2, "*.experts.*.down_proj": 5},
    ),
    "glm4-moe": (
        "glm4-moe-tiny",
        "mul1",
        4,
        {"*.experts.2.*": 2.5, "*.experts.6.up_proj": 3.5, "*.experts.7.down_proj": 6},
    ),
    "mixtral": ("mixtral-tiny", "mcg", 3, {"*.experts.4.w2": 4, "*.experts.5.*": 2}),
    # Expert width 192: stored padded to 256 (svh = 0 on the padding), vLLM's width
    # rounded up.
    "qwen3-moe-padded": (
        {**synth.PRESETS["qwen3-moe-tiny"], "moe_intermediate_size": 192},
        "3inst",
        3,
        {"*.experts.6.*": 4},
    ),
    "qwen3-next": (
        "qwen3-next-tiny",
        "mul1",
        4,
        {"*.experts.3.*": 1.5, "*.experts.4.gate_proj": 8},
    ),
}


def write(arch: str, out, **kwargs):
    preset, codebook, bits, overrides = ARCHITECTURES[arch]
    synth.write_checkpoint(
        preset,
        out,
        bits=bits,
        codebook=codebook,
        bits_overrides=overrides,
        mtp=False,
        seed=7,
        layers=LAYERS,
        **kwargs,
    )
    link_tokenizer(out)
    return out


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_synthetic_architecture(arch, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod

    ckpt = write(arch, tmp_path / arch)
    model, vllm_config = load_model(ckpt, monkeypatch, MODEL_DTYPE)
    methods = [
        m.quant_method for n, m in model.named_modules() if n.endswith("routed_experts")
    ]
    assert methods and all(isinstance(q, Exl3MoEMethod) for q in methods)
    assert all(q.width % 128 == 0 for q in methods), [q.width for q in methods]
    # The per-expert rate table holds every rate the overrides asked for (k2 = 2 *
    # bits).
    _, _, bits, overrides = ARCHITECTURES[arch]
    k2 = set()
    for name, module in model.named_modules():
        if name.endswith("routed_experts"):
            k2 |= set(module.w13_meta[..., 1].flatten().tolist())
            k2 |= set(module.w2_meta[:, 1].tolist())
    assert k2 == {int(2 * b) for b in (bits, *overrides.values())}, sorted(k2)
    assert check_moe_blocks(ckpt, model, vllm_config) >= 1


def test_mla_kv_b_proj_stored_as_exl3(tmp_path, monkeypatch, world1):
    """A DeepSeek-V3 checkpoint whose kv_b_proj is EXL3 (ExLlamaV3 keeps it fp16,
    another writer may not): loaded as EXL3 and reconstructed once into the dense weight
    MLA absorbs; the model equals the same checkpoint with that weight stored as fp16.
    """
    import json

    import torch
    from moe_model_run import run_logits
    from safetensors.torch import load_file, save_file
    from test_exl3_moe_model import token_ids
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.exl3 import reference
    from vllm.model_executor.layers.quantization.exl3.dequantized import (
        Exl3DequantizedLinearMethod,
    )

    exl3_dir, dense_dir = (
        write("deepseek-v3", tmp_path / d) for d in ("exl3", "dense")
    )
    named = load_file(str(exl3_dir / "model.safetensors"))
    dense_named = dict(named)
    storage_path = exl3_dir / "quantization_config.json"
    document = json.loads(storage_path.read_text())
    gen = torch.Generator().manual_seed(11)
    decoded = {}
    for name in [k for k in named if k.endswith("kv_b_proj.weight")]:
        module = name.rpartition(".")[0]
        out, inp = named.pop(name).shape
        slot = synth.LinearSlot(module, inp, out, "column", module)
        tensors = synth._exl3_tensors(
            slot, 4, synth.CODEBOOK_NAMES["3inst"], False, gen
        )
        named.update(tensors)
        w = reference.reconstruct(
            tensors[f"{module}.trellis"],
            tensors[f"{module}.suh"],
            tensors[f"{module}.svh"],
            0,
        )[:inp, :out].t()
        decoded[module] = w
        dense_named[name] = w.half().contiguous()
        document["tensor_storage"][module] = {
            "stored_tensors": synth._storage_entry(tensors),
            "quant_format": "exl3",
            "bits_per_weight": 4,
        }
    assert len(decoded) == 2
    save_file(named, str(exl3_dir / "model.safetensors"), metadata={"format": "pt"})
    storage_path.write_text(json.dumps(document))
    save_file(
        dense_named, str(dense_dir / "model.safetensors"), metadata={"format": "pt"}
    )

    ids = token_ids(12)
    model, vllm_config = load_model(exl3_dir, monkeypatch, MODEL_DTYPE)
    for module, w in decoded.items():
        layer = model.get_submodule(module)
        assert isinstance(layer.quant_method, Exl3DequantizedLinearMethod)
        assert {n for n, _ in layer.named_parameters()} == {"weight"}
        err = (layer.weight.double() - w.double()).abs().max().item()
        assert err <= 2**-10 * w.abs().max().item(), f"{module}: {err}"
    got = run_logits(model, vllm_config, ids)
    model, vllm_config = load_model(dense_dir, monkeypatch, MODEL_DTYPE)
    kv_b = model.get_submodule(next(iter(decoded)))
    assert type(kv_b.quant_method).__name__ == "Exl3PaddedUnquantizedLinearMethod"
    assert isinstance(kv_b.quant_method, UnquantizedLinearMethod)
    want = run_logits(model, vllm_config, ids)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 8 * 2**-10 * want.abs().max().item()
