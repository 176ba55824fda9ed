# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Name resolution (exact, model mapper, wrapper segments dropped, fused expansion), the
deprecated CUDA_EXL3_* environment names, and the kernel choice."""

from __future__ import annotations

import logging

import pytest
import torch
from vllm.model_executor.layers.quantization.exl3 import ops
from vllm.model_executor.layers.quantization.exl3.env_compat import (
    adopt_deprecated_env_names,
)
from vllm.model_executor.layers.quantization.exl3.kernels import (
    Exl3KernelConfig,
    ReferenceExl3Kernel,
    choose_exl3_kernel,
)
from vllm.model_executor.layers.quantization.exl3.names import (
    ModuleNameResolver,
    shard_names,
    strip_wrappers,
)
from vllm.model_executor.models.utils import WeightsMapper

CKPT_MODULES = [
    "model.language_model.layers.0.self_attn.q_proj",
    "model.language_model.layers.0.self_attn.k_proj",
    "model.visual.blocks.0.attn.qkv",
    "lm_head",
]


def test_exact_first_then_wrappers_dropped():
    r = ModuleNameResolver(CKPT_MODULES)
    assert r.resolve("lm_head") == "lm_head"
    assert (
        r.resolve("model.visual.blocks.0.attn.qkv") == "model.visual.blocks.0.attn.qkv"
    )
    # vLLM nests the text model as language_model.model.*, the checkpoint as
    # model.language_model.*
    assert (
        r.resolve("language_model.model.layers.0.self_attn.q_proj") == CKPT_MODULES[0]
    )
    assert r.resolve("language_model.model.layers.0.self_attn.v_proj") is None
    assert strip_wrappers("language_model.model.layers.0.mlp") == "layers.0.mlp"


def test_ambiguous_stripped_name_is_not_used():
    r = ModuleNameResolver(["model.layers.0.o_proj", "language_model.layers.0.o_proj"])
    assert r.resolve("model.language_model.layers.0.o_proj") is None
    assert r.resolve("model.layers.0.o_proj") == "model.layers.0.o_proj"


def test_model_mapper_renames_checkpoint_modules():
    r = ModuleNameResolver(["transformer.h.0.attn.q_proj"])
    r.set_mapper(WeightsMapper(orig_to_new_prefix={"transformer.h.": "model.layers."}))
    assert r.resolve("model.layers.0.attn.q_proj") == "transformer.h.0.attn.q_proj"


def test_modules_under_a_prefix():
    r = ModuleNameResolver(
        ["model.layers.0.mlp.experts.7.up_proj", "model.layers.0.mlp.gate"]
    )
    assert r.modules_under("model.layers.0.mlp.experts") == [
        "model.layers.0.mlp.experts.7.up_proj"
    ]
    assert r.modules_under("language_model.model.layers.0.mlp.experts") == [
        "model.layers.0.mlp.experts.7.up_proj"
    ]
    assert r.modules_under("model.layers.1.mlp.experts") == []


def test_fused_names_expand_by_mapping_then_fallback():
    mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert shard_names("m.l.0.qkv_proj", mapping) == [
        "m.l.0.q_proj",
        "m.l.0.k_proj",
        "m.l.0.v_proj",
    ]
    # Not in the model's mapping (as in Qwen3-MoE without mlp_only_layers): built-in
    # table.
    assert shard_names("m.l.0.gate_up_proj", mapping) == [
        "m.l.0.gate_proj",
        "m.l.0.up_proj",
    ]
    assert shard_names("m.l.0.in_proj_qkvz", {}) == [
        "m.l.0.in_proj_qkv",
        "m.l.0.in_proj_z",
    ]
    assert shard_names("m.l.0.o_proj", mapping) == ["m.l.0.o_proj"]


def test_debug_names_logs_hits_and_misses(monkeypatch):
    monkeypatch.setenv("VLLM_EXL3_DEBUG_NAMES", "1")
    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger("vllm.model_executor.layers.quantization.exl3.names")
    handler = Capture()
    logger.addHandler(handler)
    try:
        r = ModuleNameResolver(CKPT_MODULES)
        r.resolve("language_model.model.layers.0.self_attn.q_proj")
        r.resolve("model.layers.0.mlp.down_proj")
    finally:
        logger.removeHandler(handler)
    assert any("segments dropped" in m and "q_proj" in m for m in messages)
    assert any("down_proj" in m and "no EXL3 checkpoint module" in m for m in messages)


def test_deprecated_env_names():
    env = {
        "CUDA_EXL3_FORCE_REFERENCE": "1",
        "CUDA_EXL3_BM": "64",
        "VLLM_EXL3_BM": "128",
    }
    assert adopt_deprecated_env_names(env) == [
        "VLLM_EXL3_FORCE_REFERENCE",
        "VLLM_EXL3_PLAN",
    ]
    assert env["VLLM_EXL3_FORCE_REFERENCE"] == "1"
    # The new spelling wins, and the old per-knob variable becomes a VLLM_EXL3_PLAN key.
    assert env["VLLM_EXL3_PLAN"] == "bm=128"
    assert "VLLM_EXL3_BM" not in env


def test_config_adopts_deprecated_names_into_vllm_envs(monkeypatch):
    import vllm.envs as envs
    from vllm.model_executor.layers.quantization.exl3.config import Exl3Config

    monkeypatch.delenv("VLLM_EXL3_DEBUG_NAMES", raising=False)
    monkeypatch.setenv("CUDA_EXL3_DEBUG_NAMES", "1")
    Exl3Config({"quant_method": "exl3"})
    assert envs.VLLM_EXL3_DEBUG_NAMES is True
    monkeypatch.delenv("VLLM_EXL3_DEBUG_NAMES")


def test_reference_kernel_on_cpu():
    kernel = choose_exl3_kernel(
        Exl3KernelConfig("l", torch.device("cpu"), torch.bfloat16)
    )
    assert isinstance(kernel, ReferenceExl3Kernel)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less refusal")
def test_no_kernel_for_cuda_weights_without_the_op():
    with pytest.raises(
        ValueError,
        match=r"CudaExl3Kernel: needs compute capability 80.*"
        r"ReferenceExl3Kernel: weights are on cuda",
    ):
        choose_exl3_kernel(Exl3KernelConfig("l", torch.device("cuda"), torch.bfloat16))


def test_force_reference(monkeypatch):
    monkeypatch.setenv("VLLM_EXL3_FORCE_REFERENCE", "1")
    kernel = choose_exl3_kernel(
        Exl3KernelConfig("l", torch.device("cuda"), torch.bfloat16)
    )
    assert isinstance(kernel, ReferenceExl3Kernel)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the report without the extension"
)
def test_ops_report_why_they_are_missing():
    ok, why = ops.load_exl3_ops()
    assert not ok and "vllm._exl3_C" in why
