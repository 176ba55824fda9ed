# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What runs an EXL3 linear after loading: a kernel class, chosen once per layer.

vLLM's mixed-precision kernel contract (`model_executor/kernels/linear/mixed_precision/
MPLinearKernel.py`): the method describes the layer (`Exl3KernelConfig`); a kernel class
says whether it can run it here (`get_min_capability`, `can_implement` -> (ok, why
not)), prepares once after loading (`process_weights_after_loading`) and runs it
(`apply_weights(layer, x, bias)`). `choose_exl3_linear_kernel` tries the candidates in
order, as vLLM's `choose_mp_linear_kernel` does; `VLLM_EXL3_FORCE_REFERENCE=1` forces
the reference.

`apply_weights` is one path for every kernel: pad x to the allocated k, one GEMM per run
of equal-bitrate shards over the shards' 128-aligned windows (`run_gemm`, what each
kernel implements), then, only if some shard keeps part of its window, one gather of the
kept columns.
"""

from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import vllm.envs as envs
from vllm.logger import init_logger

from . import ops, reference
from .capability import (
    MIN_CAPABILITY,
    Exl3KernelCandidate,
    cuda_kernel_unsupported,
    first_capable,
)
from .layout import Exl3Layout
from .plan_table import layer_key
from .plans import (
    Exl3Run,
    layer_plans,
    resolve_runs,
    tune_run,
    warm_up_layer,
)
from .weights import OUT_INDEX
from .workspace import Exl3Workspace, workspace_for

logger = init_logger(__name__)


@dataclass(frozen=True)
class Exl3KernelConfig:
    """One loaded EXL3 linear as the kernels see it (vLLM's MPLinearLayerConfig)."""

    layout: Exl3Layout  # its shards and runs on this rank
    device: torch.device  # where the loaded weights live
    act_dtype: torch.dtype

    @property
    def prefix(self) -> str:
        return self.layout.prefix


class Exl3Kernel(Exl3KernelCandidate):
    """One EXL3 linear's kernel: `run_gemm`, the GEMM of one run, is each kernel's
    own; the rest is shared."""

    def __init__(self, c: Exl3KernelConfig) -> None:
        self.config = c
        layout = c.layout
        # The plan-table key of each run (plans.layer_key), in call order.
        self.keys = [
            layer_key(
                layout.k_alloc,
                run.cols,
                run.bits,
                int(run.codebook),
                len(run.shard_widths),
                c.act_dtype,
            )
            for run in layout.runs
        ]

    @abstractmethod
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Once, after the layer's weights are final (Exl3LayerWeights.finish)."""
        raise NotImplementedError

    @abstractmethod
    def run_gemm(
        self, x: torch.Tensor, index: int, run: Exl3Run, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """y [m, n] in x.dtype for contiguous x [m, k_alloc]: the layer's run number
        `index` (bias, when given, is the run's whole output's)."""
        raise NotImplementedError

    def runs(self, layer: torch.nn.Module) -> list[Exl3Run]:
        """The layer's runs in call order, as views of its parameters."""
        layout = self.config.layout
        return [
            Exl3Run(
                key,
                layout.run_trellis(layer.trellis, run),
                layer.suh[run.first : run.stop],
                layer.svh[run.col : run.col + run.cols],
                list(run.shard_widths),
                int(run.codebook),
            )
            for key, run in zip(self.keys, layout.runs)
        ]

    def apply_weights(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y = x @ W (+ bias) for the layer's shards on this rank, in x.dtype."""
        layout = self.config.layout
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if layout.k_alloc != layout.k_width:
            x2 = F.pad(x2, (0, layout.k_alloc - layout.k_width))
        x2 = x2.contiguous()
        fuse_bias = (
            bias is not None and len(layout.runs) == 1 and layout.identity_output
        )
        ys = [
            self.run_gemm(x2, i, run, bias if fuse_bias else None)
            for i, run in enumerate(self.runs(layer))
        ]
        if not ys:
            y = x2.new_zeros((x2.shape[0], 0))
        else:
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if not layout.identity_output:
            # One gather of m x out_width elements, a copy of the output: small next to
            # the GEMM that produced it, and a single shape-static op for torch.compile
            # and CUDA graphs.
            y = y.index_select(1, getattr(layer, OUT_INDEX))
        if bias is not None and not fuse_bias:
            y = y + bias
        return y.reshape(*lead, layout.out_width)

    def warm_up(self, layer: torch.nn.Module) -> None:
        """Run the layer once per token-count bucket on zeros, once per distinct
        configuration in this process (plans.warm_up_layer)."""
        c, layout = self.config, self.config.layout
        key = (
            str(c.device),
            c.act_dtype,
            layout.k_alloc,
            tuple((r.bits, int(r.codebook), r.shard_widths) for r in layout.runs),
        )
        warm_up_layer(
            key,
            layout.k_width,
            layout.out_width,
            c.act_dtype,
            c.device,
            lambda x: self.apply_weights(layer, x),
        )


class CudaExl3Kernel(Exl3Kernel):
    """The fused EXL3 GEMM (`torch.ops._C.exl3_linear`), with the layer's plans and
    the device's split-k workspace."""

    def __init__(self, c: Exl3KernelConfig) -> None:
        super().__init__(c)
        self.run_plans: list[list[int]] = []
        self.workspace: Exl3Workspace | None = None

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @classmethod
    def can_implement(cls, c: Exl3KernelConfig) -> tuple[bool, str | None]:
        why_not = cuda_kernel_unsupported(
            c.device, c.act_dtype, cls.get_min_capability()
        )
        if why_not:
            return False, why_not
        return ops.load_exl3_ops()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Each run's plans (timed first under VLLM_EXL3_TUNE=1), the workspace sized
        for them, then the warm-up (plans.py)."""
        dtype = self.config.act_dtype
        runs = self.runs(layer)
        if envs.VLLM_EXL3_TUNE:
            for run in runs:
                tune_run(run, dtype)
        self.run_plans = [layer_plans(r.key, self.config.device) for r in runs]
        self.workspace = workspace_for(self.config.device)
        resolve_runs(runs, self.run_plans, dtype)
        self.warm_up(layer)

    def run_gemm(self, x, index, run, bias):
        if self.workspace is None:
            raise RuntimeError(
                f"EXL3 {self.config.prefix}: CudaExl3Kernel.apply_weights before "
                "process_weights_after_loading"
            )
        return ops.exl3_linear(
            ops.Exl3LinearArgs(
                x,
                run.trellis,
                run.suh,
                run.svh,
                bias,
                run.shard_widths,
                run.codebook,
                self.run_plans[index],
                self.workspace.tensor,
            )
        )


class ReferenceExl3Kernel(Exl3Kernel):
    """The plain-PyTorch codec (decodes the trellis on every call): CPU, tests,
    debugging."""

    @classmethod
    def get_min_capability(cls) -> int:
        # Plain PyTorch: no device feature needed.
        return 0

    @classmethod
    def can_implement(cls, c: Exl3KernelConfig) -> tuple[bool, str | None]:
        if c.device.type != "cpu":
            return False, (
                f"weights are on {c.device}: the reference would decode a dense "
                f"weight on every call (VLLM_EXL3_FORCE_REFERENCE=1 allows it)"
            )
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing to prepare: every call decodes from the layer's parameters."""

    def run_gemm(self, x, index, run, bias):
        y = reference.forward(
            x,
            run.trellis,
            run.suh,
            run.svh,
            run.codebook,
            run.shard_widths,
            bias,
            dtype=torch.float32,
        )
        return y.to(x.dtype)


# In priority order.
CANDIDATES: tuple[type[Exl3Kernel], ...] = (CudaExl3Kernel, ReferenceExl3Kernel)


def choose_exl3_linear_kernel(c: Exl3KernelConfig) -> type[Exl3Kernel]:
    """The first of CANDIDATES that can run the layer (a ValueError with every
    candidate's reason when none can); the reference under
    VLLM_EXL3_FORCE_REFERENCE=1."""
    if envs.VLLM_EXL3_FORCE_REFERENCE:
        logger.info_once("EXL3: VLLM_EXL3_FORCE_REFERENCE=1, using the reference codec")
        return ReferenceExl3Kernel
    kernel, passed_over = first_capable(
        CANDIDATES, c, f"EXL3 {c.prefix}: no kernel can run this layer"
    )
    logger.debug(
        "EXL3 %s: %s (%s)",
        c.prefix,
        kernel.__name__,
        "; ".join(passed_over) or "the first candidate",
    )
    return kernel


def init_exl3_linear_kernel(layout: Exl3Layout, layer: torch.nn.Module) -> Exl3Kernel:
    """The kernel chosen for a loaded layer, prepared for its first call."""
    c = Exl3KernelConfig(layout, layer.trellis.device, layer.params_dtype)
    kernel = choose_exl3_linear_kernel(c)(c)
    kernel.process_weights_after_loading(layer)
    return kernel
