# SPDX-License-Identifier: Apache-2.0
"""scripts/bench/graph_timeline.py turns a profiled graph replay into each kernel's start and end
relative to its op's input transform. The H200 records of ab_session11 §5 rest on that
bookkeeping: kernel names as the profiler reports them map to their roles, ops split at each
transform, and only the middle ops (steady state) are averaged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import graph_timeline  # noqa: E402

# Kernel names as torch's profiler printed them on the H200 (graph_kernels.py, ab_session11).
T = "void vllm_exl3::exl3_input_transform_kernel<__nv_bfloat16>(__nv_bfloat16 const*, ...)"
G = "void vllm_exl3::exl3_gemm_kernel<8, 1, 1, false, false>(vllm_exl3::GemmParams)"
F = "void vllm_exl3::exl3_splitk_finish_kernel<__nv_bfloat16>(float*, __half const*, ...)"


def test_roles_from_profiler_names():
    assert [graph_timeline.role(n) for n in (T, G, F)] == ["T", "G", "F"]
    assert graph_timeline.role("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_NN") is None


def ops(n: int, period: float, slow_first: float = 0.0) -> list[tuple[str, float, float]]:
    """n back-to-back ops of the measured 4096x4096 m = 1 shape (ab_session11 §5); the first
    op's GEMM runs `slow_first` µs longer (a warm-up outlier the middle-half mean must drop)."""
    spans, t = [], 100.0
    for i in range(n):
        extra = slow_first if i == 0 else 0.0
        spans += [("T", t, t + 1.71), ("G", t + 0.56, t + 7.99 + extra),
                  ("F", t + 2.66, t + 8.83 + extra)]
        t += period + extra
    return sorted(spans, key=lambda s: s[1])


def test_offsets_are_per_op_from_its_transform_and_skip_the_edges():
    tl = graph_timeline.op_timeline(ops(16, 8.91, slow_first=50.0))
    assert tl["T start"] == 0.0
    assert tl["G start"] == pytest.approx(0.56)
    assert tl["G end"] == pytest.approx(7.99)
    assert tl["F end"] == pytest.approx(8.83)
    assert tl["next T start"] == pytest.approx(8.91)


def test_an_op_without_a_finish_kernel_still_counts():
    # Split 1: the GEMM runs the epilogue itself; no finish kernel in the graph.
    spans = [s for s in ops(8, 9.5) if s[0] != "F"]
    tl = graph_timeline.op_timeline(spans)
    assert "F start" not in tl
    assert tl["next T start"] == pytest.approx(9.5)
