# SPDX-License-Identifier: Apache-2.0
"""scripts/bench/sass_loop.py finds the GEMM's k loop in the SASS of both engines. It looks the
kernel up by its mangled name; when the kernel gained its engine template parameter the lookup
found nothing, every count came out 0 and the benchmark silently dropped the decode term of its
speed of light (a whole anchor's pct_sol column). Compile-only: nvcc and cuobjdump, no GPU."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import sass_loop  # noqa: E402


def _cuobjdump_or_skip() -> None:
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("nvcc not available")
    try:
        sass_loop.cuobjdump()
    except SystemExit:
        pytest.skip("cuobjdump not available")


@pytest.mark.parametrize("engine", ["mma", "wgmma"])
def test_k_loop_found_and_counted(tmp_path: Path, engine: str) -> None:
    _cuobjdump_or_skip()
    out = tmp_path / "sass.json"
    args = ["--compile", "--bits", "4", "--json", str(out)]
    args += ["--wgmma", "--mt", "16"] if engine == "wgmma" else ["--mt", "1"]
    assert sass_loop.main(args) == 0
    loops = json.loads(out.read_text())
    assert set(loops) == ({f"4:{cb}:mt16:wgmma" for cb in (0, 1, 2)} if engine == "wgmma"
                          else {f"4:{cb}" for cb in (0, 1, 2)})
    for key, loop in loops.items():
        # A 4-bit decode is 5-8 instructions per weight (5.7-6.2 for mma.sync at BM 16 on
        # sm_90 in session 7, 7.4-7.9 for wgmma at BM 256); the loop holds its tensor ops.
        assert 4.0 < loop["per_weight"] < 10.0, (key, loop)
        assert loop["by_pipe"].get("tensor", 0) > 0, (key, loop)


def test_symbol_names_carry_the_engine() -> None:
    assert sass_loop.kernel_name(8, 1, 1).endswith("ELi1ELb0ELb0EEEvNS_10GemmParamsE")
    assert sass_loop.kernel_name(8, 1, 16, True).endswith("ELi16ELb1ELb0EEEvNS_10GemmParamsE")
    assert sass_loop.kernel_name(8, 1, 16, True, True).endswith("ELb1ELb1EEEvNS_10GemmParamsE")
