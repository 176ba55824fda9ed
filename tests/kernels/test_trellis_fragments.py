# SPDX-License-Identifier: Apache-2.0
"""The kernels' whole per-lane trellis decode (compiled for the host) against the reference.

decode_fragments (exl3_trellis.cuh) is what the GEMM and reconstruct kernels run per lane and
tile: the rate's compile-time cut plan (views, one-instruction cuts), the codebook products
(with the paired-view shortcut that derives a state's product from its view and its partner's
product instead of cutting it), and the fp16 values packed into the two mma B fragments. Every
instruction has an exact host fallback chosen only by __CUDA_ARCH__, so this checks the decode's
own source for every rate x codebook on random tiles (ring wrap included) against
reference.codebook_decode(reference.unpack_states(...)), bit for bit. Needs nvcc (host only).
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
CODEBOOKS = {0: "3inst", 1: "mcg", 2: "mul1"}
TILES = 5
CASES = [(b, cb) for b in RATES for cb in CODEBOOKS if b % 1 == 0 or cb == 2]


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return build_host_driver("trellis_fragments_host.cu", tmp_path_factory.mktemp("fragments"))


@pytest.mark.parametrize("bits,codebook", CASES,
                         ids=[f"{b:g}b-{CODEBOOKS[c]}" for b, c in CASES])
def test_fragments_match_reference(driver: Path, tmp_path: Path, bits: float,
                                   codebook: int) -> None:
    gen = torch.Generator().manual_seed(int(bits * 10) * 3 + codebook)
    trellis = torch.randint(-32768, 32768, (1, TILES, int(16 * bits)), generator=gen,
                            dtype=torch.int32).to(torch.int16)
    words = tmp_path / "tiles.bin"
    trellis.numpy().tofile(words)
    out = subprocess.run([str(driver), str(int(2 * bits)), str(codebook), str(TILES), str(words)],
                         check=True, capture_output=True, text=True).stdout.split()
    got = torch.tensor([int(v) for v in out], dtype=torch.int32).view(1, TILES, 256)
    states = reference.unpack_states(trellis, bits)
    want = reference.codebook_decode(states, codebook).view(torch.int16).to(torch.int32) & 0xFFFF
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} of {got.numel()} values differ at {bits} bits "
                              f"{CODEBOOKS[codebook]}, first (tile, position) "
                              f"{tuple(bad[0, 1:].tolist())}")
