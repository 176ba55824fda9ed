# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which implementation looks up a quantized token embedding, chosen once per layer
after loading, in the shape of the linear's selection (kernels.py): each kernel says
whether it can run here (`can_implement` -> (ok, why not)) and how (`apply`); the
candidates are tried in order and `VLLM_EXL3_FORCE_REFERENCE=1` forces the reference.

Both decode only the looked-up rows; neither ever holds the table decoded.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import vllm.envs as envs
from vllm.logger import init_logger

from . import embedding_ops, embedding_reference

logger = init_logger(__name__)

# The dtypes the CUDA gather writes.
CUDA_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Exl3EmbeddingKernelConfig:
    prefix: str
    device: torch.device  # where the loaded table lives
    out_dtype: torch.dtype


class Exl3EmbeddingKernel(ABC):
    def __init__(self, c: Exl3EmbeddingKernelConfig):
        self.config = c

    @classmethod
    @abstractmethod
    def can_implement(cls, c: Exl3EmbeddingKernelConfig) -> tuple[bool, str | None]:
        raise NotImplementedError

    @abstractmethod
    def apply(
        self,
        ids: torch.Tensor,
        trellis: torch.Tensor,
        signs: torch.Tensor,
        hidden: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """[*ids.shape, hidden] in `dtype`: the table rows `ids`, decoded."""
        raise NotImplementedError


class CudaExl3EmbeddingKernel(Exl3EmbeddingKernel):
    """The row gather `torch.ops._C.exl3_embedding`: one warp per looked-up group."""

    @classmethod
    def can_implement(cls, c: Exl3EmbeddingKernelConfig) -> tuple[bool, str | None]:
        if c.device.type != "cuda":
            return False, f"the table is on {c.device}, not a CUDA device"
        if c.out_dtype not in CUDA_OUT_DTYPES:
            return False, f"it writes float32, float16 or bfloat16, not {c.out_dtype}"
        return embedding_ops.load_exl3_embedding_op()

    def apply(self, ids, trellis, signs, hidden, dtype):
        flat = embedding_ops.exl3_embedding(
            ids.reshape(-1), trellis, signs, hidden, dtype
        )
        return flat.view(*ids.shape, hidden)


class ReferenceExl3EmbeddingKernel(Exl3EmbeddingKernel):
    """The plain-PyTorch decode of the looked-up rows (embedding_reference.py): CPU,
    tests, debugging. It checks the ids on the host, which on a GPU synchronizes every
    lookup and breaks CUDA-graph capture (VLLM_EXL3_FORCE_REFERENCE=1 allows it)."""

    @classmethod
    def can_implement(cls, c: Exl3EmbeddingKernelConfig) -> tuple[bool, str | None]:
        if c.device.type != "cpu":
            return False, (
                f"the table is on {c.device}: the reference checks every lookup's ids "
                "on the host (VLLM_EXL3_FORCE_REFERENCE=1 allows it)"
            )
        return True, None

    def apply(self, ids, trellis, signs, hidden, dtype):
        rows = embedding_reference.decode_rows(
            trellis, signs, ids, hidden, self.config.prefix
        )
        return rows.to(dtype)


CANDIDATES: tuple[type[Exl3EmbeddingKernel], ...] = (
    CudaExl3EmbeddingKernel,
    ReferenceExl3EmbeddingKernel,
)


def choose_exl3_embedding_kernel(c: Exl3EmbeddingKernelConfig) -> Exl3EmbeddingKernel:
    if envs.VLLM_EXL3_FORCE_REFERENCE:
        logger.info_once("EXL3: VLLM_EXL3_FORCE_REFERENCE=1, using the reference codec")
        return ReferenceExl3EmbeddingKernel(c)
    reasons = []
    for kernel in CANDIDATES:
        ok, why_not = kernel.can_implement(c)
        if ok:
            logger.debug("EXL3 %s: %s", c.prefix, kernel.__name__)
            return kernel(c)
        reasons.append(f"{kernel.__name__}: {why_not}")
    raise ValueError(
        f"EXL3 {c.prefix}: no kernel can look up this embedding: " + "; ".join(reasons)
    )
