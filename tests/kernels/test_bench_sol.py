# SPDX-License-Identifier: Apache-2.0
"""The benchmark's speed-of-light decode term (scripts/bench/bench_linear.py): a k loop is bound
by its total instructions against the issue rate and by its busiest integer pipe against one
pipe's rate, whichever is slower; the H200 record of 2026-11-30 (sass_loop and ceilings of the
same run) gives the numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import bench_linear  # noqa: E402

# 4-bit MCG k loop at BM = 16 (sass_loop_h200_76c291d_2026-11-30.json) and that run's ceilings.
LOOP = {"per_stage": 198.75, "per_weight": 6.2109375,
        "by_pipe": {"alu": 90.25, "fma": 76.75, "lsu": 19.0, "tensor": 8.0}}
CEIL = {"copy_bytes_per_s": 3.98e12, "bf16_flops": 7.43e14, "mma_flops": 6.33e14,
        "int_instr_per_s": 1.604e13, "issue_instr_per_s": 132 * 4 * 32 * 1.98e9}


def test_decode_term_takes_the_slower_of_issue_and_the_busiest_pipe():
    s = bench_linear.decode_s_per_weight(LOOP, CEIL)
    issue = 6.2109375 / CEIL["issue_instr_per_s"]
    alu = 90.25 / 32 / CEIL["int_instr_per_s"]
    assert s == pytest.approx(max(issue, alu))
    # An ALU-heavy mix of the same length is bound by the pipe, not by issue.
    heavy = {**LOOP, "by_pipe": {"alu": 150.0, "fma": 20.0}}
    assert bench_linear.decode_s_per_weight(heavy, CEIL) == pytest.approx(
        150.0 / 32 / CEIL["int_instr_per_s"])
    assert bench_linear.decode_s_per_weight(None, CEIL) is None


def test_sol_of_the_small_m_shape_is_the_decode_and_stays_below_the_measured_time():
    # 5120 x 12288, m = 1: measured 24.1 us in that run (bench_ours); the bound must be lower.
    sol = bench_linear.sol_us(5120, 12288, 1, 4.0, CEIL, LOOP)
    assert 5120 * 12288 * bench_linear.decode_s_per_weight(LOOP, CEIL) * 1e6 == pytest.approx(sol)
    assert sol < 24.1
    # Without the loop counts only bytes and matrix work remain.
    assert bench_linear.sol_us(5120, 12288, 1, 4.0, CEIL, None) < sol


def test_the_ratio_to_bf16_uses_the_faster_of_the_two_bf16_timings():
    rows = [{"m": 1, "ours_us": 30.0, "bf16_us": 40.0, "ratio_bf16": 0.75},
            {"m": 4096, "ours_us": 1100.0, "bf16_us": 950.0, "ratio_bf16": 1.158}]
    bench_linear.rebase_on_second_bf16(rows, {1: 41.0, 4096: 900.0})
    assert rows[0]["bf16_us"] == 40.0 and rows[0]["ratio_bf16"] == 0.75
    assert rows[1]["bf16_us"] == 900.0 and rows[1]["ratio_bf16"] == pytest.approx(1100 / 900, 1e-3)
    assert (rows[1]["bf16_first_us"], rows[1]["bf16_second_us"]) == (950.0, 900.0)
