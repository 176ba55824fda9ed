# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Python wrapper and fake implementation of the quantized token embedding's CUDA op
(`torch.ops._C.exl3_embedding`,
csrc/libtorch_stable/quantization/exl3/exl3_embedding_ops.cpp).

Schema::

    exl3_embedding(Tensor ids, Tensor trellis, Tensor signs, int hidden,
                   ScalarType dtype) -> Tensor

out [n, hidden] in `dtype` (float32, float16 or bfloat16) = the rows `ids` (int32 or
int64 [n], on trellis' device) of the table (trellis int16 [rows, groups * (1 + 16 *
bits)], signs fp16 [groups, 256]; docs/design/exl3_format.md §8), each decoded on the
fly from its rings; the values are embedding_reference.decode_rows' fp32, rounded once
to `dtype`. An id outside [0, rows) stops the kernel with a message naming it (a
device-side error, as torch's own embedding raises). Built into the same extension as
the dense ops (ops.py loads it); nothing is loaded at import time.
"""

import torch

from . import ops

OP = "exl3_embedding"


def load_exl3_embedding_op() -> tuple[bool, str | None]:
    """Make the op available once (its fake too: the lookup runs inside the
    torch.compile graph); returns (available, why not)."""
    return ops.load_exl3_extra_ops(OP, {OP: exl3_embedding_fake})


def exl3_embedding_fake(
    ids: torch.Tensor,
    trellis: torch.Tensor,
    signs: torch.Tensor,
    hidden: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    return trellis.new_empty((ids.shape[0], hidden), dtype=dtype)


def exl3_embedding(
    ids: torch.Tensor,
    trellis: torch.Tensor,
    signs: torch.Tensor,
    hidden: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """out [n, hidden] = rows `ids` [n] of the quantized table (see the schema)."""
    return torch.ops._C.exl3_embedding(ids, trellis, signs, hidden, dtype)
