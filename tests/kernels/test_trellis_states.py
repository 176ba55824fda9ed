# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels' trellis state extraction (compiled for the host) against the reference.

exl3_trellis.cuh cuts each lane's 8 states out of funnel-shifted words at compile-time offsets;
this checks that bit arithmetic for every rate, on random tiles (including the ring wrap of
lane 0 and the last lanes), against reference.unpack_states. Needs nvcc (host compile only).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from vllm_exl3.codec import reference  # noqa: E402

from host_driver import build_host_driver  # noqa: E402

RATES = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
TILES = 7


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return build_host_driver("trellis_states_host.cu", tmp_path_factory.mktemp("states"))


@pytest.mark.parametrize("bits", RATES)
def test_states_match_reference(driver: Path, tmp_path: Path, bits: float) -> None:
    gen = torch.Generator().manual_seed(int(bits * 10))
    width = int(16 * bits)
    trellis = torch.randint(-32768, 32768, (1, TILES, width), generator=gen,
                            dtype=torch.int32).to(torch.int16)
    words = tmp_path / "tiles.bin"
    trellis.numpy().tofile(words)
    out = subprocess.run([str(driver), str(int(2 * bits)), str(TILES), str(words)],
                         check=True, capture_output=True, text=True).stdout.split()
    got = torch.tensor([int(v) for v in out], dtype=torch.int32).view(1, TILES, 256)
    want = reference.unpack_states(trellis, bits)
    assert torch.equal(got, want), f"{int((got != want).sum())} states differ at {bits} bits"
