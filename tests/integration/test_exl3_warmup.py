# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load-time warm-up (exl3/warmup.py) on vLLM's real layers: a kernel that runs plans is
called once per power-of-two token count up to the scheduler's budget, on zeros, once
per distinct layer configuration, with the layer's own shapes; the memory cap stops the
walk; kernels that do not tune (the reference) are never called."""

from __future__ import annotations

import pytest
from exl3_harness import CKPT_3INST, config_for, tensors
from test_exl3_linear import ATTN, HIDDEN, finish, load_qkv, qkv_layer
from vllm.model_executor.layers.quantization.exl3 import kernels, warmup
from vllm.model_executor.layers.quantization.exl3.linear import warm_up

pytestmark = pytest.mark.usefixtures("world1")


class RecordingKernel(kernels.ReferenceExl3Kernel):
    """The reference's arithmetic, declared as a plan-tuning kernel, recording each
    call."""

    uses_plans = True

    def __init__(self):
        self.calls: list[tuple[int, int, tuple[int, ...]]] = []

    def apply(self, x, trellis, suh, svh, bias, shard_widths, codebook, run):
        assert not x.any(), "warm-up inputs are zeros"
        self.calls.append((x.shape[0], x.shape[1], tuple(shard_widths)))
        return super().apply(x, trellis, suh, svh, bias, shard_widths, codebook, run)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(warmup, "_warmed", set())
    monkeypatch.setattr(warmup, "max_tokens", lambda: 40)


def loaded_qkv(prefix: str = f"{ATTN}.qkv_proj"):
    layer = qkv_layer(config_for(CKPT_3INST), prefix=prefix)
    load_qkv(layer, tensors(CKPT_3INST))
    finish(layer)
    return layer


def test_bucket_walk_covers_the_token_budget():
    assert warmup.warmup_m_values(1) == [1]
    assert warmup.warmup_m_values(8192) == [2**j for j in range(14)]
    assert warmup.warmup_m_values(5000)[-2:] == [4096, 8192]


def test_each_bucket_once_per_configuration(fresh):
    layer = loaded_qkv()
    kernel = RecordingKernel()
    warm_up(kernel, layer.quant_method.layout, layer)
    assert [m for m, _, _ in kernel.calls] == [1, 2, 4, 8, 16, 32, 64]
    assert {(k, widths) for _, k, widths in kernel.calls} == {(HIDDEN, (256, 128, 128))}
    # A second layer with the same configuration (another decoder layer) is not
    # re-tuned.
    other = loaded_qkv("model.layers.1.self_attn.qkv_proj")
    before = len(kernel.calls)
    warm_up(kernel, other.quant_method.layout, other)
    assert len(kernel.calls) == before


def test_memory_cap_stops_the_walk(fresh, monkeypatch):
    layer = loaded_qkv()
    kernel = RecordingKernel()
    n = layer.quant_method.layout.out_width
    # Room for m = 8 (8 rows x (k + n) x 4 bytes), not for 16.
    monkeypatch.setattr(warmup, "MAX_WARMUP_BYTES", 8 * (HIDDEN + n) * 4)
    warm_up(kernel, layer.quant_method.layout, layer)
    assert [m for m, _, _ in kernel.calls] == [1, 2, 4, 8]


def test_env_turns_it_off(fresh, monkeypatch):
    monkeypatch.setenv("VLLM_EXL3_WARMUP", "0")
    layer = loaded_qkv()
    kernel = RecordingKernel()
    warm_up(kernel, layer.quant_method.layout, layer)
    assert kernel.calls == []


def test_reference_kernel_is_not_warmed(fresh, monkeypatch):
    layer = loaded_qkv()
    called = []
    monkeypatch.setattr(
        kernels.ReferenceExl3Kernel, "apply", lambda *a, **k: called.append(1)
    )
    warm_up(kernels.ReferenceExl3Kernel(), layer.quant_method.layout, layer)
    assert not called


def test_budget_comes_from_the_scheduler_config(world1):
    # world1 runs under a real VllmConfig: the walk follows its max_num_batched_tokens.
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        assert warmup.max_tokens() == warmup.DEFAULT_MAX_TOKENS
    else:
        assert warmup.max_tokens() == config.scheduler_config.max_num_batched_tokens


@pytest.mark.slow
def test_whole_model_load_warms_each_configuration_once(tmp_path, monkeypatch, world1):
    """vLLM's real loader on the fixture: with a plan-tuning kernel selected, every
    distinct linear configuration (qkv, o, gate_up, down, lm_head) is warmed once over
    the whole bucket walk, not once per decoder layer, and the load completes."""
    from exl3_harness import checkpoint_copy
    from test_exl3_model import CPU_ATTENTION_BACKEND
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    calls: list[tuple[int, int, tuple[int, ...]]] = []

    class Tuning(RecordingKernel):
        def __init__(self):
            self.calls = calls

    monkeypatch.setattr(kernels, "CANDIDATES", (Tuning,))
    monkeypatch.setattr(warmup, "_warmed", set())
    monkeypatch.setattr(warmup, "max_tokens", lambda: 64)
    monkeypatch.setattr(
        current_platform,
        "get_attn_backend_cls",
        lambda *args, **kwargs: CPU_ATTENTION_BACKEND,
    )
    model_config = ModelConfig(
        model=str(checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", tokenizer=True)),
        dtype="bfloat16",
    )
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    model = get_model_loader(vllm_config.load_config).load_model(
        vllm_config=vllm_config, model_config=model_config
    )
    assert isinstance(model.lm_head.quant_method.kernel, Tuning)
    configs = {(k, widths) for _, k, widths in calls}
    walks = {c: [m for m, k, w in calls if (k, w) == c] for c in configs}
    assert all(ms == warmup.warmup_m_values(64) for ms in walks.values()), walks
    # The 4 decoder layers share their four configurations (o, qkv, gate_up, down); the
    # head (vocab 4096) adds one: 5 walks, not 4 x 4 + 1.
    assert set(walks) == {
        (256, (256,)),
        (256, (256, 128, 128)),
        (256, (768, 768)),
        (768, (256,)),
        (256, (4096,)),
    }, sorted(walks)
