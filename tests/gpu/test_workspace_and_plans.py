# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The op's memory and plans on a GPU: the split-k workspace is a torch allocation (it
shows in torch.cuda.memory_allocated, and the op allocates nothing outside torch's
allocator), the plan table's errors, and two fresh processes resolve identical plans for
every layer of the 4.0bpw fixture at every token-count bucket (plan_log.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

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


def non_torch_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def test_workspace_is_a_torch_allocation() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = vk.random_layer(gen, 1024, [16384], 4.0, 1)
    split = vk.header(bm=128, split_k=2, reconstruct_m=0)
    m = 4096
    x = torch.randn(m, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ws = torch.zeros(m * layer.n, dtype=torch.float32, device="cuda")  # 256 MiB
    assert torch.cuda.memory_allocated() - before >= m * layer.n * 4
    # The op runs split-k through it and leaves it all zeros; outside torch's allocator
    # the process gains nothing (the cuBLAS path's workspace is torch's too).
    torch.ops._C.exl3_linear(
        x[:1], layer.trellis, layer.suh, layer.svh, None, layer.widths, 1, split, ws
    )  # context and first launches
    torch.ops._C.exl3_linear(
        x[:1],
        layer.trellis,
        layer.suh,
        layer.svh,
        None,
        layer.widths,
        1,
        vk.header(reconstruct_m=1),
        ws,
    )
    torch.cuda.synchronize()
    base = non_torch_bytes()
    plan = torch.ops._C.exl3_plan(layer.trellis, 1, 1, True, m, split, ws.numel())
    assert plan[3] == 2, plan
    y = torch.ops._C.exl3_linear(
        x, layer.trellis, layer.suh, layer.svh, None, layer.widths, 1, split, ws
    )
    y2 = torch.ops._C.exl3_linear(
        x,
        layer.trellis,
        layer.suh,
        layer.svh,
        None,
        layer.widths,
        1,
        vk.header(reconstruct_m=1),
        ws,
    )
    torch.cuda.synchronize()
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(y2).all())
    assert not ws.any(), "the finish kernel must leave the workspace zeroed"
    grown = non_torch_bytes() - base
    assert grown < 8 << 20, f"{grown >> 20} MiB allocated outside torch's allocator"


def test_too_small_workspace_runs_split_one() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    layer = vk.random_layer(gen, 1024, [1280], 4.0, 1)
    split = vk.header(bm=16, split_k=4, reconstruct_m=0)
    x = torch.randn(16, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    small = torch.zeros(16 * layer.n - 1, dtype=torch.float32, device="cuda")
    assert (
        torch.ops._C.exl3_plan(layer.trellis, 1, 1, True, 16, split, small.numel())[3]
        == 1
    )
    y = torch.ops._C.exl3_linear(
        x, layer.trellis, layer.suh, layer.svh, None, layer.widths, 1, split, small
    )
    ok, rel, mx = vk.within(y, vk.reference_y(x, layer, None))
    assert ok, (rel, mx)


@pytest.mark.parametrize(
    "plans, message",
    [
        ([2, 0, -1, 0, 0, -1, -1, -1, -1, 250], "plans version 2"),
        ([1, 8, -1, 0, 0, -1, -1, -1, -1, 250], "unknown plan flags"),
        ([1, 0, -1, 0, 0, -1, -1, -1, -1], "the header alone"),
        (vk.FREE_HEADER + [16, 3, 16, 1, 0, 0, 1, 0], "unknown path 3"),
        (vk.FREE_HEADER + [16, 0, 48, 1, 0, 0, 1, 0], "is not an mma.sync tier"),
        (vk.FREE_HEADER + [16, 0, 16, 64, 0, 0, 1, 0], "split_k 64 is outside"),
        (vk.FREE_HEADER + [16, 0, 64, 1, 0, 12, 1, 0], "stream-k is built only"),
        (vk.FREE_HEADER + [16, 0, 16, 1, 0, 0, 1], "not a multiple of 8"),
        (
            vk.FREE_HEADER + [16, 0, 16, 1, 0, 0, 1, 0, 8, 0, 16, 1, 0, 0, 1, 0],
            "above the previous",
        ),
        (vk.header(deterministic=1) + [16, 0, 16, 2, 0, 0, 1, 0], "deterministic mode"),
    ],
)
def test_plan_table_errors(plans: list[int], message: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    layer = vk.random_layer(gen, 1024, [256], 4.0, 1)
    x = torch.randn(4, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        vk.exl3_op(
            x, layer.trellis, layer.suh, layer.svh, None, layer.widths, 1, plans=plans
        )


def test_wgmma_entry_needs_the_engine() -> None:
    if vk.wgmma_engine():
        pytest.skip("this device has the wgmma engine")
    gen = torch.Generator(device="cuda").manual_seed(3)
    layer = vk.random_layer(gen, 1024, [256], 4.0, 1)
    x = torch.randn(64, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="sm_90a build"):
        vk.exl3_op(
            x,
            layer.trellis,
            layer.suh,
            layer.svh,
            None,
            layer.widths,
            1,
            plans=vk.FREE_HEADER + [64, 0, 64, 1, 1, 0, 1, 0],
        )


def test_two_processes_log_identical_plans(tmp_path) -> None:
    logs = []
    for i in range(2):
        r = subprocess.run(
            [sys.executable, str(HERE / "plan_log.py")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        logs.append(r.stdout)
        (tmp_path / f"plans_{i}.log").write_text(r.stdout)
    lines = logs[0].splitlines()
    assert len(lines) > 100, logs[0][-2000:]
    assert logs[0] == logs[1], "two fresh processes resolved different plans"
