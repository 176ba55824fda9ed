# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MoE op's wrapper, fake implementation and host-side checks without a GPU.

A spawned process defines `_C::exl3_moe` from the schema in csrc (so the two cannot
drift) with a CPU stand-in (the reference MoE kernel, ignoring the alignment), after
which `load_exl3_moe_op` finds it and registers the fake: fake tensors and torch.compile
get the output's shape and dtype from it, and the wrapper reaches the op. The CUDA
kernel class's host-side parts (rate table checks, block-size rule) are plain Python and
are checked here too.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
OPS_CPP = REPO / "csrc" / "quantization" / "exl3" / "exl3_moe_ops.cpp"
LINEAR_OPS_CPP = REPO / "csrc" / "quantization" / "exl3" / "exl3_ops.cpp"


def schemas(path: Path) -> list[str]:
    """Every op schema a csrc file defines (its m.def string literals, joined)."""
    blocks = re.findall(r'm\.def\(\s*((?:"[^"]*"\s*)+)\);', path.read_text())
    assert blocks, f"no m.def(...) in {path.name}"
    return ["".join(re.findall(r'"([^"]*)"', block)) for block in blocks]


def moe_schema() -> str:
    return schemas(OPS_CPP)[0]


def _layer(experts: int, h: int, i: int, bits: float):
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import Exl3MoEWeights

    g = torch.Generator().manual_seed(3)
    k2 = int(2 * bits)
    size13 = (h // 16) * (i // 16) * 8 * k2
    size2 = (i // 16) * (h // 16) * 8 * k2
    meta13 = torch.tensor(
        [[[(2 * e + r) * size13, k2] for r in (0, 1)] for e in range(experts)]
    )
    meta2 = torch.tensor([[e * size2, k2] for e in range(experts)])

    def scales(*shape: int) -> torch.Tensor:
        return (0.5 + torch.rand(shape, generator=g)).half()

    def words(n: int) -> torch.Tensor:
        return torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(
            torch.int16
        )

    return Exl3MoEWeights(
        words(2 * experts * size13),
        meta13,
        scales(experts, 2, h),
        scales(experts, 2 * i),
        words(experts * size2),
        meta2,
        scales(experts, i),
        scales(experts, h),
        experts,
        h,
        i,
    )


def _main(_: int) -> None:
    from vllm.model_executor.layers.quantization.exl3 import moe_ops
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        ReferenceExl3MoEKernel,
    )

    assert moe_ops.ops.load_exl3_ops.__wrapped__()[0] is False  # nothing registered yet
    w = _layer(4, 128, 128, 2)
    ref = ReferenceExl3MoEKernel()

    def stand_in(
        x,
        topk_weights,
        topk_ids,
        sorted_ids,
        expert_ids,
        post_pad,
        expert_map,
        w13_trellis,
        w13_meta,
        w13_suh,
        w13_svh,
        w2_trellis,
        w2_meta,
        w2_suh,
        w2_svh,
        block_size,
        w13_k2s,
        w2_k2s,
        global_num_experts,
        codebook,
        on_input,
        det,
    ):
        return ref.apply(
            x,
            topk_weights,
            topk_ids,
            w,
            activation="silu",
            apply_router_weight_on_input=on_input,
            expert_map=expert_map,
            global_num_experts=global_num_experts,
            codebook=codebook,
            deterministic=det,
        )

    lib = torch.library.Library("_C", "FRAGMENT")
    for schema in schemas(LINEAR_OPS_CPP):  # the dense ops the loader checks for first
        lib.define(schema)
    schema = moe_schema()
    lib.define(schema)
    lib.impl("exl3_moe", stand_in, "CPU")
    assert moe_ops.load_exl3_moe_op() == (True, None)

    # The fake takes the schema's arguments, by name and in order.
    names = re.findall(r"(?:Tensor\??|int\[\]|int|bool) (\w+)", schema)
    assert list(inspect.signature(moe_ops.exl3_moe_fake).parameters) == names

    m, top_k = 5, 2
    x = torch.randn(m, 128).to(torch.bfloat16)
    topk_ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [2, 0]], dtype=torch.int32)
    topk_w = torch.rand(m, top_k)
    sorted_ids = torch.arange(m * top_k, dtype=torch.int32)
    expert_ids = torch.zeros(1, dtype=torch.int32)
    post_pad = torch.tensor([16], dtype=torch.int32)
    args = (
        topk_w,
        topk_ids,
        sorted_ids,
        expert_ids,
        post_pad,
        None,
        w.w13_trellis,
        w.w13_meta,
        w.w13_suh,
        w.w13_svh,
        w.w2_trellis,
        w.w2_meta,
        w.w2_suh,
        w.w2_svh,
        16,
        [4],
        [4],
        4,
        1,
        False,
        True,
    )

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fx = torch.empty(7, 128, dtype=torch.float16)
        out = torch.ops._C.exl3_moe(fx, *args)
        assert out.shape == (7, 128) and out.dtype == torch.float16

    compiled = torch.compile(
        lambda t: moe_ops.exl3_moe(t, *args), backend="aot_eager", fullgraph=True
    )
    y = compiled(x)
    assert y.shape == (m, 128) and y.dtype == torch.bfloat16
    expected = ref.apply(
        x,
        topk_w,
        topk_ids,
        w,
        activation="silu",
        apply_router_weight_on_input=False,
        expert_map=None,
        global_num_experts=4,
        codebook=1,
        deterministic=True,
    )
    assert torch.equal(y, expected)


def test_moe_op_fake_and_wrapper() -> None:
    mp.spawn(_main, nprocs=1, join=True)


def test_rate_table_checks_name_the_entry() -> None:
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        CudaExl3MoEKernel,
    )

    kernel = CudaExl3MoEKernel()
    w = _layer(3, 128, 256, 3)
    assert kernel.rates(w, 1) == ([6], [6])
    bad = w.w13_meta.clone()
    bad[2, 1, 1] = 9
    with pytest.raises(ValueError, match=r"w13_meta\[2, 1\]: k2 = 9"):
        CudaExl3MoEKernel().rates(type(w)(**{**w.__dict__, "w13_meta": bad}), 1)
    bad = w.w2_meta.clone()
    bad[1, 0] += 4
    with pytest.raises(ValueError, match=r"w2_meta\[1, 0\].*unaligned or outside"):
        CudaExl3MoEKernel().rates(type(w)(**{**w.__dict__, "w2_meta": bad}), 1)
    bad = w.w2_meta.clone()
    bad[2, 0] += 8
    with pytest.raises(ValueError, match=r"w2_meta\[2, 0\].*outside w2_trellis"):
        CudaExl3MoEKernel().rates(type(w)(**{**w.__dict__, "w2_meta": bad}), 1)


def test_block_size_rule() -> None:
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        CudaExl3MoEKernel,
    )
    from vllm.model_executor.layers.quantization.exl3.moe_ops import BLOCK_SIZES

    rule = CudaExl3MoEKernel.block_size
    assert rule(1, 8, 128) == BLOCK_SIZES[0]  # decode: a 16-row block per routed pair
    assert rule(256, 8, 128) == 16
    assert rule(257, 8, 128) == 32
    assert rule(1024, 8, 128) == 64
    assert rule(4096, 8, 128) == BLOCK_SIZES[-1]
    assert rule(8192, 2, 16) == BLOCK_SIZES[-1]
