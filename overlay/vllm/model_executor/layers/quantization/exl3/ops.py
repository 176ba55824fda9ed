# SPDX-License-Identifier: Apache-2.0
"""Python wrappers and fake implementations of the EXL3 CUDA ops (`torch.ops._C.exl3_*`).

The full build compiles the kernels into `_C_stable_libtorch`, which the CUDA platform imports at
start-up. The quick development build ships them as the separate extension `vllm._exl3_C` (its
own `_C` fragment), imported here on first use. Nothing is loaded at import time: vLLM imports
every quantization package on every config resolution, also on machines without a GPU.
"""

import functools
import importlib

import torch
from torch.library import register_fake

from vllm.logger import init_logger

from .format import TILE

logger = init_logger(__name__)

QUICK_BUILD_MODULE = "vllm._exl3_C"
OPS = ("exl3_linear", "exl3_reconstruct")


def _has_op(name: str) -> bool:
    return hasattr(torch.ops._C, name)


@functools.cache
def load_exl3_ops() -> tuple[bool, str | None]:
    """Make the ops available once; returns (available, why not)."""
    if not _has_op("exl3_linear"):
        try:
            importlib.import_module(QUICK_BUILD_MODULE)
        except ImportError as e:
            return False, (f"torch.ops._C.exl3_linear is not registered and "
                           f"{QUICK_BUILD_MODULE} does not load ({e})")
    if not _has_op("exl3_linear"):
        return False, f"{QUICK_BUILD_MODULE} loaded but registers no _C::exl3_linear"
    _register_fakes()
    return True, None


def _needs_fake(name: str) -> bool:
    qualname = f"_C::{name}"
    return _has_op(name) and not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")


def _register_fakes() -> None:
    # Dense EXL3 linears run inside the torch.compile graph, so Dynamo needs output metadata.
    if _needs_fake("exl3_linear"):

        @register_fake("_C::exl3_linear")
        def _exl3_linear_fake(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor,
                              svh: torch.Tensor, bias: torch.Tensor | None,
                              shard_widths: list[int], codebook: int) -> torch.Tensor:
            return x.new_empty((x.shape[0], svh.shape[0]))

    if _needs_fake("exl3_reconstruct"):

        @register_fake("_C::exl3_reconstruct")
        def _exl3_reconstruct_fake(trellis: torch.Tensor, codebook: int) -> torch.Tensor:
            return trellis.new_empty((trellis.shape[0] * TILE, trellis.shape[1] * TILE),
                                     dtype=torch.float16)


def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                bias: torch.Tensor | None, shard_widths: list[int], codebook: int) -> torch.Tensor:
    """y [m, n] = x [m, k] through S shards of one trellis (see the op's schema)."""
    return torch.ops._C.exl3_linear(x, trellis, suh, svh, bias, shard_widths, codebook)


def exl3_reconstruct(trellis: torch.Tensor, codebook: int) -> torch.Tensor:
    """Ŵ fp16 [k, n], the rotated-basis weight (bit-identical to reference.decode_rotated)."""
    return torch.ops._C.exl3_reconstruct(trellis, codebook)
