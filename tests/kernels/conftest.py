# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host drivers of tests/kernels: a .cu file beside the tests that includes the
kernels' headers and runs their device arithmetic on the CPU."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

KERNEL_SOURCES = (
    Path(__file__).resolve().parents[2] / "csrc/libtorch_stable/quantization/exl3"
)


@pytest.fixture(scope="session")
def host_driver(tmp_path_factory) -> Callable[[str], Path]:
    """host_driver("decode_host.cu"): that file compiled for the host with the
    kernels' include path; skips the test without nvcc."""

    def build(source: str) -> Path:
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            pytest.skip("nvcc not available")
        name = Path(source).stem
        out = tmp_path_factory.mktemp(name) / name
        subprocess.run(
            [
                nvcc,
                "-std=c++17",
                "-O1",
                f"-I{KERNEL_SOURCES}",
                str(Path(__file__).with_name(source)),
                "-o",
                str(out),
            ],
            check=True,
            capture_output=True,
        )
        return out

    return build
