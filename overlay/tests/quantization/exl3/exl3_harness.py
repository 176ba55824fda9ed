# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared pieces of the CPU integration tests: a gloo world, fixture tensors, configs
and the dense oracle (reference.reconstruct, the plain-PyTorch decode of the same
tensors).

Fixtures: tests/fixtures/qwen3-tiny/exl3-{4.0bpw,3.0bpw-mcg} are real ExLlamaV3 1.6.5
conversions (3inst and mcg codebooks); see tests/fixtures for their provenance.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers.quantization.exl3 import reference
from vllm.model_executor.layers.quantization.exl3.checkpoint import find_modules
from vllm.model_executor.layers.quantization.exl3.config import Exl3Config
from vllm.model_executor.layers.quantization.exl3.format import module_spec
from vllm_exl3.testing.fixtures import QWEN3_TINY as FIXTURES

CKPT_3INST = FIXTURES / "exl3-4.0bpw"  # 4 bpw decoder, 6 bpw head, 3inst codebook
CKPT_MCG = FIXTURES / "exl3-3.0bpw-mcg"  # 3 bpw decoder, 6 bpw head, mcg codebook

DTYPE_NAMES = {
    torch.int16: "I16",
    torch.int32: "I32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}


@contextlib.contextmanager
def gloo_world(
    world_size: int,
    rank: int,
    init_file: str,
    vllm_config: VllmConfig | None = None,
) -> Iterator[VllmConfig]:
    """A gloo world on the CPU, vLLM's distributed state for `world_size` ranks under
    `vllm_config` (default: a CPU device config alone; VllmConfig() fails without a
    GPU), split into that config's pipeline stages of tensor-parallel ranks."""
    if vllm_config is None:
        vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    pipeline_size = vllm_config.parallel_config.pipeline_parallel_size
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"file://{init_file}",
            backend="gloo",
        )
        initialize_model_parallel(world_size // pipeline_size, pipeline_size)
        try:
            yield vllm_config
        finally:
            cleanup_dist_env_and_memory()


@functools.cache
def _tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(path)


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """All tensors of a fixture checkpoint (cached; treat as read-only)."""
    return _tensors(str(ckpt / "model.safetensors"))


def module_tensors(ckpt: Path, prefix: str) -> dict[str, torch.Tensor]:
    return {
        k.rpartition(".")[2]: v
        for k, v in tensors(ckpt).items()
        if k.rpartition(".")[0] == prefix
    }


def config_for(ckpt: Path) -> Exl3Config:
    """What vLLM builds: from_config on config.json's block, then
    maybe_update_config.
    """
    block = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    config = Exl3Config.from_config(block)
    config.maybe_update_config(str(ckpt))
    return config


def headers_of(
    named: Mapping[str, torch.Tensor],
) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name: (tuple(t.shape), DTYPE_NAMES[t.dtype]) for name, t in named.items()}


def config_from_tensors(named: Mapping[str, torch.Tensor]) -> Exl3Config:
    """A config describing an in-memory 'checkpoint' (name -> tensor), headers only."""
    config = Exl3Config({"quant_method": "exl3"})
    config.set_checkpoint(*find_modules(headers_of(named)))
    return config


def codebook_of(named: Mapping[str, torch.Tensor], prefix: str) -> int:
    members = {
        k.rpartition(".")[2]: (tuple(v.shape), DTYPE_NAMES[v.dtype])
        for k, v in named.items()
        if k.rpartition(".")[0] == prefix
    }
    return int(module_spec(prefix, members).codebook)


def dense(named: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """W fp32 [k, n] of one module (y = x @ W), decoded by the reference."""
    suh = named.get(f"{prefix}.suh")
    svh = named.get(f"{prefix}.svh")
    from vllm.model_executor.layers.quantization.exl3.format import unpack_sign_bits

    if suh is None:
        suh = unpack_sign_bits(named[f"{prefix}.su"])
    if svh is None:
        svh = unpack_sign_bits(named[f"{prefix}.sv"])
    return reference.reconstruct(
        named[f"{prefix}.trellis"],
        suh,
        svh,
        codebook_of(named, prefix),
        dtype=torch.float32,
    )


def load_module(
    layer: torch.nn.Module,
    named: Mapping[str, torch.Tensor],
    prefix: str,
    shard_id: int | str | None = None,
) -> None:
    """Feed one checkpoint module's tensors to the layer's parameters, as a model's
    hand-written load_weights does (param.weight_loader(param, tensor[, shard_id]))."""
    for name, tensor in named.items():
        mod, _, suffix = name.rpartition(".")
        if mod != prefix or suffix == "bias":
            continue
        param = getattr(layer, suffix)
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)


def assert_matches(y: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """y (in its dtype) against the fp32 oracle: within the rounding of y's dtype."""
    eps = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}[y.dtype]
    scale = expected.abs().max().item()
    err = (y.float() - expected).abs().max().item()
    assert err <= 4 * eps * scale + 1e-6, (
        f"{what}: max |err| {err:.3g} vs scale {scale:.3g}"
    )


def checkpoint_copy(
    src: Path,
    dst: Path,
    *,
    weights: bool = True,
    storage: dict | None | bool = True,
    tokenizer: bool = False,
) -> Path:
    """A checkpoint directory assembled from fixture files; `storage` replaces
    quantization_config.json (False: no such file)."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    if weights:
        os.symlink(src / "model.safetensors", dst / "model.safetensors")
    if storage is True:
        shutil.copy(src / "quantization_config.json", dst / "quantization_config.json")
    elif storage:
        (dst / "quantization_config.json").write_text(json.dumps(storage))
    if tokenizer:
        for f in (FIXTURES / "tokenizer").iterdir():
            os.symlink(f, dst / f.name)
    return dst


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
