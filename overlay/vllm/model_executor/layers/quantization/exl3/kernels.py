# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which implementation runs an EXL3 layer, chosen once per layer after loading.

Following vLLM's kernel-selection pattern (`model_executor/kernels/linear/`): the method
describes the layer, each kernel says whether it can run it here (`can_implement` ->
(ok, why not)) and how (`apply`). Candidates are tried in order;
`VLLM_EXL3_FORCE_REFERENCE=1` forces the reference. Also the split-k workspace the CUDA
kernel's layers share on a device.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import vllm.envs as envs
from vllm.logger import init_logger
from vllm.platforms import current_platform

from . import ops, reference

logger = init_logger(__name__)


# The split-k workspace of `_C::exl3_linear`: one fp32 buffer per device, from torch's
# caching allocator (as Marlin's `marlin_make_workspace_new`), so vLLM's memory
# profiling sees it.
#
# The op keeps it all zeros between calls (its finish kernel re-zeroes what it read), so
# every layer on the device shares it. It is sized at load time, as layers finish
# loading, to the most any of their plans needs (m_bucket x n floats for a split-k or
# stream-k bucket), capped; a call whose partial sums do not fit runs with split 1
# instead.

# Beyond this many bytes split-k is not worth its partial sums; plans needing more run
# split 1.
MAX_WORKSPACE_BYTES = 512 << 20
MAX_WORKSPACE_FLOATS = MAX_WORKSPACE_BYTES // 4


class Exl3Workspace:
    """The device's buffer; layers read `.tensor` at call time, so growing it while
    later layers load reaches the earlier ones too (nothing grows it after loading)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tensor = torch.zeros(0, dtype=torch.float32, device=device)

    def reserve(self, floats: int) -> None:
        floats = min(floats, MAX_WORKSPACE_FLOATS)
        if floats > self.tensor.numel():
            self.tensor = torch.zeros(floats, dtype=torch.float32, device=self.device)


_workspaces: dict[torch.device, Exl3Workspace] = {}


def workspace_for(device: torch.device) -> Exl3Workspace:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _workspaces:
        _workspaces[device] = Exl3Workspace(device)
    return _workspaces[device]


@dataclass(frozen=True)
class Exl3KernelConfig:
    prefix: str
    device: torch.device  # where the loaded weights live
    act_dtype: torch.dtype


@dataclass(frozen=True)
class Exl3Run:
    """One kernel call of a layer: a run of equal-bitrate shards (layout.py)."""

    key: str  # plan_table.layer_key
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    shard_widths: list[int]
    codebook: int


class Exl3Kernel(ABC):
    # Whether the kernel runs plans (plans.py) that are prepared and warmed up at load.
    uses_plans = False

    def prepare(self, runs: list[Exl3Run]) -> None:  # noqa: B027 - optional hook
        """Called once after loading with the layer's runs, in call order."""

    @classmethod
    @abstractmethod
    def can_implement(cls, c: Exl3KernelConfig) -> tuple[bool, str | None]:
        raise NotImplementedError

    @abstractmethod
    def apply(
        self,
        x: torch.Tensor,
        trellis: torch.Tensor,
        suh: torch.Tensor,
        svh: torch.Tensor,
        bias: torch.Tensor | None,
        shard_widths: list[int],
        codebook: int,
        run: int,
    ) -> torch.Tensor:
        """y [m, n] in x.dtype for contiguous x [m, k]: the layer's run number `run`
        (the arguments of `_C::exl3_linear` but its plans and workspace)."""
        raise NotImplementedError


def cuda_kernel_unsupported(
    device: torch.device, act_dtype: torch.dtype, min_capability: int
) -> str | None:
    """Why an EXL3 CUDA kernel cannot run weights on `device` with `act_dtype`
    activations, or None when it can (the dense and the MoE kernels share the rule)."""
    if device.type != "cuda":
        return f"weights are on {device}, not a CUDA device"
    capability = current_platform.get_device_capability()
    if capability is None or capability.to_int() < min_capability:
        return f"needs compute capability {min_capability}, have {capability}"
    if act_dtype not in (torch.float16, torch.bfloat16):
        return f"activations are {act_dtype}; the kernel takes fp16 or bf16"
    return None


class CudaExl3Kernel(Exl3Kernel):
    """The fused EXL3 GEMM (`torch.ops._C.exl3_linear`)."""

    # mma.sync m16n8k16 with fp16 inputs and cp.async both need Ampere.
    MIN_CAPABILITY = 80
    uses_plans = True

    def __init__(self) -> None:
        self.run_plans: list[list[int]] = []
        self.workspace: Exl3Workspace | None = None

    def prepare(self, runs: list[Exl3Run]) -> None:
        from .plans import layer_plans

        self.run_plans = [layer_plans(r.key, r.trellis.device) for r in runs]
        if runs:
            self.workspace = workspace_for(runs[0].trellis.device)

    @classmethod
    def can_implement(cls, c: Exl3KernelConfig) -> tuple[bool, str | None]:
        why_not = cuda_kernel_unsupported(c.device, c.act_dtype, cls.MIN_CAPABILITY)
        if why_not:
            return False, why_not
        return ops.load_exl3_ops()

    def apply(self, x, trellis, suh, svh, bias, shard_widths, codebook, run):
        if self.workspace is None:
            raise RuntimeError("EXL3: CudaExl3Kernel.apply before prepare()")
        return ops.exl3_linear(
            x,
            trellis,
            suh,
            svh,
            bias,
            shard_widths,
            codebook,
            self.run_plans[run],
            self.workspace.tensor,
        )


class ReferenceExl3Kernel(Exl3Kernel):
    """The plain-PyTorch codec (decodes the trellis on every call): CPU, tests,
    debugging."""

    @classmethod
    def can_implement(cls, c: Exl3KernelConfig) -> tuple[bool, str | None]:
        if c.device.type != "cpu":
            return False, (
                f"weights are on {c.device}: the reference would decode a dense "
                f"weight on every call (VLLM_EXL3_FORCE_REFERENCE=1 allows it)"
            )
        return True, None

    def apply(self, x, trellis, suh, svh, bias, shard_widths, codebook, run):
        y = reference.forward(
            x, trellis, suh, svh, codebook, shard_widths, bias, dtype=torch.float32
        )
        return y.to(x.dtype)


CANDIDATES: tuple[type[Exl3Kernel], ...] = (CudaExl3Kernel, ReferenceExl3Kernel)


def choose_exl3_kernel(c: Exl3KernelConfig) -> Exl3Kernel:
    if envs.VLLM_EXL3_FORCE_REFERENCE:
        logger.info_once("EXL3: VLLM_EXL3_FORCE_REFERENCE=1, using the reference codec")
        return ReferenceExl3Kernel()
    reasons = []
    for kernel in CANDIDATES:
        ok, why_not = kernel.can_implement(c)
        if ok:
            logger.debug("EXL3 %s: %s", c.prefix, kernel.__name__)
            return kernel()
        reasons.append(f"{kernel.__name__}: {why_not}")
    raise ValueError(
        f"EXL3 {c.prefix}: no kernel can run this layer: " + "; ".join(reasons)
    )
