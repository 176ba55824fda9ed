# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which tensor-parallel splits an EXL3 linear allows, and what each rank then computes.

Pure arithmetic on sizes (no vLLM), shared by the loader (layout.py) and the checkpoint
tools (`vllm-exl3 inspect`), so both apply one rule:

* Column-parallel (a shard's n divided over ranks): always possible. The output Hadamard
  mixes the 128 columns of a block, so a rank whose columns start or end inside a block
  computes the whole 128-aligned range of blocks covering them (its window) and keeps
  only its own columns; the columns it drops are redundant work, never a different
  answer.
* Row-parallel (k divided over ranks): x itself is split there, and the input Hadamard
  of a block needs all 128 of its features on one rank, so each rank's k must be a
  multiple of 128. There is no way around this one.
"""

from dataclasses import dataclass

from .format import HADAMARD_SIZE, round_up


@dataclass(frozen=True)
class ColumnWindow:
    """The columns a rank computes for one shard, in the shard's (checkpoint) column
    space."""

    first: int  # first computed column, a multiple of 128
    alloc: int  # computed columns, a multiple of 128
    keep: int  # offset of the rank's own columns inside the window
    width: int  # the rank's own columns (what vLLM receives)

    @property
    def partial(self) -> bool:
        """The rank owns only part of a block it computes (it drops some computed
        columns)."""
        return self.alloc != self.width


def column_window(start: int, width: int) -> ColumnWindow:
    """The 128-aligned block range covering columns [start, start + width)."""
    first = start // HADAMARD_SIZE * HADAMARD_SIZE
    return ColumnWindow(
        first, round_up(start + width, HADAMARD_SIZE) - first, start - first, width
    )


def rank_column_window(
    width: int, tp_rank: int, replicas: int = 1, offset: int = 0
) -> ColumnWindow:
    """Window of a column-parallel rank owning `width` columns of a shard that starts at
    column `offset` of its checkpoint module; `replicas` consecutive ranks share one
    slice (vLLM's num_kv_head_replicas when tp > num_kv_heads)."""
    return column_window(offset + tp_rank // replicas * width, width)


def row_split_error(k_per_rank: int, tp_size: int) -> str | None:
    """Why a row-parallel split of k into `k_per_rank` per rank cannot work, or None."""
    if tp_size > 1 and k_per_rank % HADAMARD_SIZE:
        return (
            f"row-parallel input slice of {k_per_rank} features is not a multiple of "
            f"{HADAMARD_SIZE}; x is split across ranks there and each input Hadamard "
            "block "
            f"needs all its {HADAMARD_SIZE} features on one rank "
            f"({k_per_rank * tp_size} input features / TP {tp_size})"
        )
    return None
