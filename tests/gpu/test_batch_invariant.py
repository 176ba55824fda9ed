# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Batch invariance of `_C::exl3_linear` (vLLM's VLLM_BATCH_INVARIANT=1 sets the table's
FLAG_BATCH_INVARIANT): each row's output is bit-identical whether computed alone or
inside a call of 2..4096 rows, for every bitrate and codebook, bf16 and fp16, with and
without bias."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import exl3_oracle as vk  # noqa: E402

try:
    vk.load_extension()
except (
    ImportError,
    OSError,
    RuntimeError,
) as e:  # pragma: no cover - depends on the host
    pytest.skip(f"EXL3 extension not available: {e}", allow_module_level=True)

# Row counts crossing every BM tier and bucket boundary up to 4096.
M_VALUES = (
    2,
    3,
    15,
    16,
    17,
    31,
    33,
    63,
    64,
    65,
    100,
    127,
    128,
    129,
    255,
    256,
    257,
    511,
    512,
    513,
    1000,
    1024,
    1025,
    2047,
    2048,
    2049,
    4095,
    4096,
)
K = 512
WIDTHS = [256, 128]
INVARIANT = vk.header(batch_invariant=1)


@pytest.mark.parametrize("bits, codebook", vk.combos())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_do_not_depend_on_the_batch(
    bits: float, codebook: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator(device="cuda")
    gen.seed()
    layer = vk.random_layer(gen, K, WIDTHS, bits, codebook)
    x = torch.randn(max(M_VALUES), K, generator=gen, device="cuda").to(dtype)
    bias = (
        torch.randn(layer.n, generator=gen, device="cuda").to(dtype)
        if bits % 2
        else None
    )

    def op(rows: torch.Tensor) -> torch.Tensor:
        return vk.exl3_op(
            rows,
            layer.trellis,
            layer.suh,
            layer.svh,
            bias,
            layer.widths,
            layer.codebook,
            plans=INVARIANT,
        )

    alone = torch.cat([op(x[i : i + 1]) for i in range(x.shape[0])])
    assert bool(torch.isfinite(alone).all()), "non-finite output"
    for m in M_VALUES:
        y = op(x[:m])
        diff = (y != alone[:m]).any(dim=1).nonzero().flatten()
        assert diff.numel() == 0, (
            f"bits {bits} cb {codebook} {dtype} m = {m}: rows "
            f"{diff[:8].tolist()} differ from the same rows alone"
        )


def test_invariant_mode_refuses_other_plans() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = vk.random_layer(gen, K, [256], 4.0, 1)
    x = torch.randn(8, K, generator=gen, device="cuda").to(torch.bfloat16)
    split_entry = [8, 0, 16, 2, 0, 0, 1, 0]
    with pytest.raises(RuntimeError, match="batch-invariant mode admits only"):
        vk.exl3_op(
            x,
            layer.trellis,
            layer.suh,
            layer.svh,
            None,
            layer.widths,
            1,
            plans=INVARIANT + split_entry,
        )
    # The cost model keeps to the invariant engine whatever the pins ask for.
    for m in (1, 64, 4096):
        plan = torch.ops._C.exl3_plan(
            layer.trellis,
            1,
            1,
            True,
            m,
            vk.header(batch_invariant=1, reconstruct_m=1, wgmma=1, split_k=4),
            1 << 30,
        )
        assert plan[1] == 0 and plan[3] == 1 and plan[4] == 0 and plan[5] == 0, (
            m,
            plan,
        )
