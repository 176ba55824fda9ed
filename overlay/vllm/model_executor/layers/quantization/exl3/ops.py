# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Python wrappers and fake implementations of the EXL3 CUDA ops
(`torch.ops._C.exl3_*`).

The full build compiles the kernels into `_C_stable_libtorch`, which the CUDA platform
imports at start-up. The quick development build ships them as the separate extension
`vllm._exl3_C` (its own `_C` fragment), imported here on first use. Nothing is loaded at
import time: vLLM imports every quantization package on every config resolution, also on
machines without a GPU.

Schemas (the C++ reads no environment; everything it needs is an argument)::

    exl3_linear(Tensor x, Tensor trellis, Tensor suh, Tensor svh, Tensor? bias,
                int[] shard_widths, int codebook, int[] plans, Tensor workspace) ->
                Tensor
    exl3_reconstruct(Tensor trellis, int codebook) -> Tensor
    exl3_plan(Tensor trellis, int shards, int codebook, bool bf16, int m, int[] plans,
              int workspace_floats) -> int[]
    exl3_time_plans(Tensor x, Tensor trellis, Tensor suh, Tensor svh, Tensor? bias,
                    int[] shard_widths, int codebook, int[] plans, Tensor workspace) ->
                    int[]

`exl3_linear`: y [m, n] (x's dtype) = x [m, k] (fp16/bf16) through S shards of one
trellis (int16 [k/16, n/16, 16 * bits]); suh fp16 [S, k] (or [k]), svh fp16 [n], bias
[n] in x's dtype or None, `shard_widths` the S output widths (multiples of 128, summing
to n), `codebook` 0 (3INST), 1 (MCG) or 2 (MUL1).

`plans` (int64 list) is the layer's plan table, built in Python at load time (plans.py):
a header of PLAN_HEADER_LEN ints, then PLAN_FIELDS ints per entry::

    header: [PLAN_VERSION, flags, basis, bm, split_k, wgmma, stream_k, spread,
             reconstruct_m, split_k_traffic_permille]
        flags: FLAG_DETERMINISTIC (no split-k or stream-k: run-to-run bit-identical),
               FLAG_BATCH_INVARIANT (one reduction order for every m: the mma.sync fused
               engine, split 1, no stream-k, no reconstruct path);
        basis .. reconstruct_m: VLLM_EXL3_PLAN's pins for the cost model (-1 / 0 = free;
               reconstruct_m: -1 = the model's threshold, 0 = never, r > 0 = buckets >=
               r);
        split_k_traffic_permille: the split-k cost model's traffic cap (250 = 0.25).
    entry:  [m_max, path, bm, split_k, wgmma, stream_blocks, early_release, spread]
        m_max: the entry serves m <= m_max not served by an earlier entry (ascending,
               powers of two: the token-count buckets); path: PATH_FUSED, PATH_ORIGINAL
               (reconstruct W, one cuBLAS GEMM), PATH_ROTATED (reconstruct Ŵ, cuBLAS
               between the transforms); bm: rows per block (mma.sync 16/32/64/128, wgmma
               64/128/256); stream_blocks > 0: the wgmma stream-k grid (bm >= 128, split
               1).

The op picks the entry for its own m at run time (so one CUDA graph or compiled graph
with a symbolic m still gets each bucket's plan); a bucket no entry covers goes to the
C++ cost model (deterministic, no timing), evaluated at the bucket's m. The table is
validated on every call (unknown path, BM tier not built, wgmma on a device without it,
split beyond k's chunks, entries against the flags) with an error naming the rule.

`workspace`: fp32, 1-D, on x's device, all zeros between calls (the split-k finish
kernel re-zeroes what it read); one per device from torch's caching allocator
(workspace.py). A plan whose split-k / stream-k partial sums (m x n floats) do not fit
runs with split 1 instead.

`exl3_plan` returns the plan `exl3_linear` would run for m rows on trellis's device
given `workspace_floats`: PLAN_FIELDS entry ints (m_max = the bucket) and then the
source (SOURCE_TABLE or SOURCE_COST_MODEL). Eager only, no kernel runs: load-time
logging and workspace sizing.

`exl3_time_plans` times every candidate plan for x's m bucket on the real buffers (eager
only: it refuses a capturing stream) and returns PLAN_FIELDS + 1 ints per candidate, the
last the mean time in nanoseconds: the opt-in tuner (VLLM_EXL3_TUNE=1,
scripts/bench/tune_plans.py).
"""

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch.library import register_fake
from vllm.logger import init_logger

from .format import TILE

logger = init_logger(__name__)

QUICK_BUILD_MODULE = "vllm._exl3_C"

# The plan table's layout (mirrored in
# csrc/libtorch_stable/quantization/exl3/exl3_kernels.h).
PLAN_VERSION = 1
PLAN_HEADER_LEN = 10
PLAN_FIELDS = 8
FLAG_DETERMINISTIC = 1
FLAG_BATCH_INVARIANT = 2
PATH_FUSED, PATH_ORIGINAL, PATH_ROTATED = 0, 1, 2
SOURCE_TABLE, SOURCE_COST_MODEL = 0, 1
DEFAULT_SPLIT_K_TRAFFIC_PERMILLE = 250


def _has_op(name: str) -> bool:
    return hasattr(torch.ops._C, name)


@functools.cache
def load_exl3_ops() -> tuple[bool, str | None]:
    """Make the ops available once; returns (available, why not)."""
    if not _has_op("exl3_linear"):
        try:
            importlib.import_module(QUICK_BUILD_MODULE)
        except ImportError as e:
            return False, (
                f"torch.ops._C.exl3_linear is not registered and "
                f"{QUICK_BUILD_MODULE} does not load ({e})"
            )
    if not _has_op("exl3_linear"):
        return False, f"{QUICK_BUILD_MODULE} loaded but registers no _C::exl3_linear"
    if not _has_op("exl3_plan"):
        return False, (
            "torch.ops._C.exl3_linear is an older build without exl3_plan "
            "(rebuild the kernels)"
        )
    register_missing_fakes(
        {"exl3_linear": exl3_linear_fake, "exl3_reconstruct": exl3_reconstruct_fake}
    )
    return True, None


def register_missing_fakes(fakes: Mapping[str, Callable]) -> None:
    """Register the fake implementation of each loaded `_C` op (name -> fake) that has
    no Meta kernel yet: output metadata for fake tensors and Dynamo, so the ops run
    inside the torch.compile graph. Eager-only ops (exl3_plan, exl3_time_plans) have
    none."""
    for name, fake in fakes.items():
        qualname = f"_C::{name}"
        if _has_op(name) and not torch._C._dispatch_has_kernel_for_dispatch_key(
            qualname, "Meta"
        ):
            register_fake(qualname)(fake)


def load_exl3_extra_ops(
    op: str, fakes: Mapping[str, Callable]
) -> tuple[bool, str | None]:
    """The extension (load_exl3_ops), then `op`, one of its ops beyond the dense
    linear's, and the fakes (name -> fake) of those of them it registers; returns
    (available, why not)."""
    ok, why_not = load_exl3_ops()
    if not ok:
        return ok, why_not
    if not _has_op(op):
        return False, (
            f"the EXL3 extension is loaded but registers no _C::{op} (an older build?)"
        )
    register_missing_fakes(fakes)
    return True, None


class Exl3LinearArgs(NamedTuple):
    """The arguments of `_C::exl3_linear` and of `_C::exl3_time_plans`, in schema
    order (see the module docstring)."""

    x: torch.Tensor
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bias: torch.Tensor | None
    shard_widths: list[int]
    codebook: int
    plans: list[int]
    workspace: torch.Tensor


def exl3_linear_fake(*args, **kwargs) -> torch.Tensor:
    """`_C::exl3_linear`'s output metadata; takes the op's arguments
    (Exl3LinearArgs)."""
    a = Exl3LinearArgs(*args, **kwargs)
    return a.x.new_empty((a.x.shape[0], a.svh.shape[0]))


def exl3_reconstruct_fake(trellis: torch.Tensor, codebook: int) -> torch.Tensor:
    return trellis.new_empty(
        (trellis.shape[0] * TILE, trellis.shape[1] * TILE), dtype=torch.float16
    )


def exl3_linear(args: Exl3LinearArgs) -> torch.Tensor:
    """y [m, n] = x [m, k] through S shards of one trellis (see the schema above)."""
    return torch.ops._C.exl3_linear(*args)


def exl3_reconstruct(trellis: torch.Tensor, codebook: int) -> torch.Tensor:
    """Ŵ fp16 [k, n], the rotated-basis weight (bit-identical to
    reference.decode_rotated)."""
    return torch.ops._C.exl3_reconstruct(trellis, codebook)


def exl3_plan(
    trellis: torch.Tensor,
    shards: int,
    codebook: int,
    bf16: bool,
    m: int,
    plans: list[int],
    workspace_floats: int,
) -> list[int]:
    """The plan exl3_linear runs for m rows: PLAN_FIELDS ints, then the source."""
    return list(
        torch.ops._C.exl3_plan(
            trellis, shards, codebook, bf16, m, plans, workspace_floats
        )
    )


def exl3_time_plans(args: Exl3LinearArgs) -> list[tuple[list[int], int]]:
    """(plan entry, mean ns) for every candidate plan of x's m bucket (eager only;
    `args.plans` is the header the candidates must suit)."""
    flat = list(torch.ops._C.exl3_time_plans(*args))
    row = PLAN_FIELDS + 1
    return [
        (flat[i : i + PLAN_FIELDS], flat[i + PLAN_FIELDS])
        for i in range(0, len(flat), row)
    ]
