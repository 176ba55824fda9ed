# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exl3Config: from_config + maybe_update_config on real checkpoints (tensors win over
quantization_config.json, modules missing from it recovered from the safetensors
headers), the per-layer method choice, and vLLM resolving "exl3" from config.json with
no extra flag."""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
from exl3_harness import (
    CKPT_3INST,
    CKPT_MCG,
    checkpoint_copy,
    config_for,
    config_from_tensors,
    tensors,
)
from vllm.model_executor.layers.quantization.exl3.config import Exl3Config
from vllm.model_executor.layers.quantization.exl3.format import Codebook

CONFIG_LOGGER = "vllm.model_executor.layers.quantization.exl3.config"
LAYERS, LINEARS_PER_LAYER = 4, 7


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def config_log():
    handler, logger = _Records(), logging.getLogger(CONFIG_LOGGER)
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


@pytest.mark.parametrize(
    "ckpt,bits,codebook",
    [(CKPT_3INST, 4, Codebook.THREE_INST), (CKPT_MCG, 3, Codebook.MCG)],
)
def test_fixture_is_described_from_its_tensors(ckpt, bits, codebook, config_log):
    config = config_for(ckpt)
    assert config.get_name() == "exl3"
    assert len(config.modules) == LAYERS * LINEARS_PER_LAYER + 1
    assert config.unsupported == {}
    for key, spec in config.modules.items():
        assert spec.codebook == codebook, key
        assert spec.bits == (6 if key == "lm_head" else bits), key
    head = config.modules["lm_head"]
    assert (head.in_features, head.out_features) == (256, 4096)
    assert not any("recovered" in m or "tensors decide" in m for m in config_log)
    # VllmConfig (and so the quant config) is pickled to the worker processes.
    assert pickle.loads(pickle.dumps(config)).modules == config.modules


def test_tensors_win_over_tensor_storage(tmp_path, config_log):
    storage = json.loads((CKPT_MCG / "quantization_config.json").read_text())
    entries = storage["tensor_storage"]
    k_proj = entries["model.layers.0.self_attn.k_proj"]
    k_proj["bits_per_weight"] = 5
    del k_proj["mcg_multiplier"]
    k_proj["mul1_multiplier"] = 2212286765
    del entries["model.layers.1.mlp.down_proj"]  # like an MTP head the JSON forgot
    entries["model.layers.9.mlp.up_proj"] = dict(entries["model.layers.0.mlp.up_proj"])
    ckpt = checkpoint_copy(CKPT_MCG, tmp_path / "ckpt", storage=storage)
    config = config_for(ckpt)
    spec = config.modules["model.layers.0.self_attn.k_proj"]
    assert (spec.bits, spec.codebook) == (3, Codebook.MCG)
    assert "model.layers.1.mlp.down_proj" in config.modules
    assert "model.layers.9.mlp.up_proj" not in config.modules
    text = "\n".join(config_log)
    assert (
        "model.layers.0.self_attn.k_proj: quantization_config.json says 5 bits, "
        "codebook "
        "mul1; its tensors say 3 bits, codebook mcg; the tensors decide"
    ) in text
    assert (
        "model.layers.1.mlp.down_proj: EXL3 in the tensors but missing from "
        "quantization_config.json's tensor_storage (1 modules"
    ) in text
    assert (
        "model.layers.9.mlp.up_proj: quantization_config.json lists it as EXL3" in text
    )


def test_headers_alone_describe_the_checkpoint(tmp_path):
    ckpt = checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", storage=False)
    assert config_for(ckpt).modules == config_for(CKPT_3INST).modules


def test_tensor_storage_alone_when_headers_are_unreadable(tmp_path, config_log):
    ckpt = checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", weights=False)
    assert config_for(ckpt).modules == config_for(CKPT_3INST).modules
    assert any("safetensors headers not readable" in m for m in config_log)


def test_block_from_quantization_config_json_carries_tensor_storage(tmp_path):
    """get_config_filenames path (config.json without a block): from_config receives
    quantization_config.json itself, tensor_storage included."""
    document = json.loads((CKPT_3INST / "quantization_config.json").read_text())
    config = Exl3Config.from_config(document)
    assert config.tensor_storage is not None
    config.maybe_update_config(str(CKPT_3INST))
    assert len(config.modules) == LAYERS * LINEARS_PER_LAYER + 1


def test_nothing_readable_is_an_error(tmp_path):
    ckpt = checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", weights=False, storage=False)
    with pytest.raises(ValueError, match="neither the safetensors headers nor"):
        config_for(ckpt)


def test_contract():
    config = Exl3Config({"quant_method": "exl3"})
    assert config.get_supported_act_dtypes() == [torch.bfloat16, torch.float16]
    assert Exl3Config.get_min_capability() == 80
    assert Exl3Config.get_config_filenames() == ["quantization_config.json"]
    assert config.packed_modules_mapping == {}
    with pytest.raises(ValueError, match="before maybe_update_config"):
        config.get_quant_method(torch.nn.Identity(), "x")


def test_non_linear_layers_get_no_method():
    assert (
        config_for(CKPT_MCG).get_quant_method(
            torch.nn.Identity(), "model.layers.0.attn"
        )
        is None
    )


def _expert_tensors() -> dict[str, torch.Tensor]:
    src = tensors(CKPT_MCG)
    return {
        k.replace("mlp.gate_proj", "mlp.experts.3.gate_proj"): v
        for k, v in src.items()
        if k.startswith("model.layers.0.mlp.gate_proj.")
    }


def test_exl3_moe_experts_fail_closed():
    """Routed experts with EXL3 modules get the EXL3 MoE method, which needs every
    expert: a checkpoint with one expert projection names the first missing one; a layer
    without EXL3 experts keeps vLLM's own method (None)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    experts = RoutedExperts.__new__(
        RoutedExperts
    )  # its type and these attributes matter here
    experts.moe_config = SimpleNamespace(
        num_logical_experts=8,
        hidden_dim=256,
        hidden_dim_unpadded=256,
        intermediate_size=768,
    )
    experts.ckpt_gate_proj_name, experts.ckpt_up_proj_name = "gate_proj", "up_proj"
    experts.ckpt_down_proj_name = "down_proj"
    config = config_from_tensors(_expert_tensors())
    with pytest.raises(
        Exl3LayoutError,
        match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj"
        r"\.trellis: missing tensor",
    ):
        config.get_quant_method(experts, "model.layers.0.mlp.experts")
    assert config.get_quant_method(experts, "model.layers.1.mlp.experts") is None


def test_quantized_token_embedding_fails_closed(world1):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    named = {
        "model.embed_tokens.trellis": torch.zeros(4096, 2 * 65, dtype=torch.int16),
        "model.embed_tokens.signs": torch.zeros(2, 256, dtype=torch.float16),
    }
    with pytest.raises(NotImplementedError, match="quantized token embedding"):
        VocabParallelEmbedding(
            4096,
            256,
            quant_config=config_from_tensors(named),
            prefix="model.embed_tokens",
        )


def test_vllm_resolves_exl3_from_config_json(tmp_path):
    """ModelConfig reads config.json's block and picks "exl3" (patch 0001 registers it);
    VllmConfig builds Exl3Config and calls maybe_update_config with the model directory.
    """
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    ckpt = checkpoint_copy(CKPT_MCG, tmp_path / "ckpt", tokenizer=True)
    model_config = ModelConfig(model=str(ckpt), dtype="bfloat16")
    assert model_config.quantization == "exl3"
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    assert isinstance(vllm_config.quant_config, Exl3Config)
    assert len(vllm_config.quant_config.modules) == LAYERS * LINEARS_PER_LAYER + 1
