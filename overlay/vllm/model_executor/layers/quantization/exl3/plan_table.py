# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the per-device plan tables under `configs/` are keyed by, and which token-count
buckets they hold: the terms plans.py reads them in and scripts/bench/tune_plans.py
writes them in. Imports no vLLM (only torch for the dtype's name), so the tuning tool
can name the keys and buckets of a table on a host without vLLM.

A key names one kernel *run* of a layer (layout.py: consecutive shards of one bitrate
and codebook, one `_C::exl3_linear` call) by every input the plan can depend on. Each
field stays because it can change which plan is fastest, read from the op's sources:

* k, n: the grid (tiles of 128 columns per block, k-splits of 64-deep stages) and the
  split-k cost model's traffic terms (exl3_plan.cpp `grid_fill`, `split_model`).
* bits: the trellis bytes per weight, i.e. the weight traffic the split model weighs
  partial sums against, and the decode work per tile.
* codebook: the cost model sizes grids by each GEMM instantiation's resident blocks per
  SM (`gemm_blocks_per_sm(cb, tier)`: one instantiation per bitrate, codebook and tier,
  whose register and shared-memory use can differ), and the timer measures the decode,
  whose instruction count differs per codebook (3INST, MCG, MUL1). A codebook-free key
  would hand one codebook's timings to another. (The H200 table is consistent with it
  without proving it: for the same 256x4096 6-bit layer at 4-8 rows it holds split 2
  under 3INST and split 1 under MCG, on a layer small enough for timing noise to
  decide.)
* shards: the input transform writes one rotated copy of x per shard (its own `suh`
  row), so the number of shards changes the work around the GEMM that the timer times.
* dtype: the activation and output format of the transforms and the epilogue the timer
  times.
"""

import torch


def layer_key(
    k: int, n: int, bits: float, codebook: int, shards: int, dtype: torch.dtype
) -> str:
    """The table key of a run of `shards` shards with k input features and n output
    columns in all (both as allocated: multiples of 128)."""
    return (
        f"k={k},n={n},bits={bits:g},codebook={codebook},shards={shards},"
        f"dtype={str(dtype).removeprefix('torch.')}"
    )


def warmup_m_values(max_tokens: int) -> list[int]:
    """The token-count buckets (powers of two) up to the one covering max_tokens."""
    values, m = [], 1
    while True:
        values.append(m)
        if m >= max_tokens:
            return values
        m *= 2
