# SPDX-License-Identifier: Apache-2.0
"""Builds the small host programs that run the kernels' own decode code on the CPU.

The decode headers compile for the host too (exact fallbacks chosen by __CUDA_ARCH__), so a
`*_host.cu` driver next to a test checks the very source the GPU runs against the reference.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNEL_SOURCES = REPO / "csrc" / "quantization" / "exl3"


def build_host_driver(source_name: str, out_dir: Path) -> Path:
    """Compile tests/kernels/<source_name> for the host into out_dir; skip without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not available")
    out = out_dir / Path(source_name).stem
    subprocess.run([nvcc, "-std=c++17", "-O1", f"-I{KERNEL_SOURCES}",
                    str(Path(__file__).with_name(source_name)), "-o", str(out)],
                   check=True, capture_output=True)
    return out
