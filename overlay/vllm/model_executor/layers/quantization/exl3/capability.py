# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether an EXL3 kernel can run here: the device rule the dense and the MoE CUDA
kernels share, and the first-capable choice both kernel selections make (as vLLM's
`choose_mp_linear_kernel` does: candidates in priority order, each saying why not).
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from vllm.platforms import current_platform

# The EXL3 CUDA kernels' floor: tensor-core mma.sync m16n8k16 with fp16 operands and
# cp.async, both Ampere (sm_80) features.
MIN_CAPABILITY = 80
# The activation dtypes the kernels take (their fragments hold fp16 or bf16).
KERNEL_ACT_DTYPES = (torch.float16, torch.bfloat16)


class Exl3KernelCandidate(ABC):
    """A kernel class as a selection sees it (vLLM's MPLinearKernel contract): the
    compute capability it needs, and whether it can run a layer here, why not if not.
    """

    @classmethod
    @abstractmethod
    def get_min_capability(cls) -> int:
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def can_implement(cls, c: Any) -> tuple[bool, str | None]:
        raise NotImplementedError


K = TypeVar("K", bound=Exl3KernelCandidate)


def cuda_kernel_unsupported(
    device: torch.device, act_dtype: torch.dtype, min_capability: int
) -> str | None:
    """Why an EXL3 CUDA kernel cannot run weights on `device` with `act_dtype`
    activations, or None when it can."""
    if device.type != "cuda":
        return f"weights are on {device}, not a CUDA device"
    capability = current_platform.get_device_capability()
    if capability is None or capability.to_int() < min_capability:
        return f"needs compute capability {min_capability}, have {capability}"
    if act_dtype not in KERNEL_ACT_DTYPES:
        return f"activations are {act_dtype}; the kernel takes fp16 or bf16"
    return None


def first_capable(
    candidates: Sequence[type[K]], c: Any, failure: str
) -> tuple[type[K], list[str]]:
    """The first of `candidates` (in priority order) whose `can_implement(c)` holds,
    and why each one before it could not ("Name: reason"). When none can, a ValueError
    `failure` followed by every candidate's reason."""
    passed_over = []
    for kernel in candidates:
        ok, why_not = kernel.can_implement(c)
        if ok:
            return kernel, passed_over
        passed_over.append(f"{kernel.__name__}: {why_not}")
    raise ValueError(f"{failure}: " + "; ".join(passed_over))
