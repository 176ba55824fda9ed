# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels' codebook arithmetic (compiled for the host) against the reference.

exl3_trellis.cuh decode_pair turns two states into one fp16x2 B-fragment register: integer
multiplies, then for 3INST/MCG one LOP3 mask and one fp16x2 add of the halves per state and a
byte permute, for MUL1 dp4a byte sums and one fp16x2 fma. Every instruction has
an exact host fallback selected only by __CUDA_ARCH__ (fp16 rounding emulated in
exl3_fp16_emulation.h), so this checks the decode's own source for all 65,536 states x 3
codebooks, in both halves of the pair, against reference.codebook_table; only the mapping of
each wrapper to its PTX instruction is left to the GPU verification (exl3_reconstruct bit-exact).
Needs nvcc (host compile only).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from vllm_exl3.codec import reference  # noqa: E402

from host_driver import build_host_driver  # noqa: E402

CODEBOOKS = {0: "3inst", 1: "mcg", 2: "mul1"}
STATES = 1 << 16


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> np.ndarray:
    work = tmp_path_factory.mktemp("codebook")
    exe = build_host_driver("codebook_host.cu", work)
    out = work / "tables.bin"
    subprocess.run([str(exe), str(out)], check=True, capture_output=True)
    return np.fromfile(out, dtype="<u2").reshape(3, 2, STATES)


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS), ids=CODEBOOKS.get)
@pytest.mark.parametrize("half", (0, 1), ids=("even", "odd"))
def test_pair_decode_matches_reference(tables: np.ndarray, codebook: int, half: int) -> None:
    want = reference.codebook_table(codebook, "cpu")  # fp16 [65536], indexed by state
    want_bits = want.view(torch.int16).numpy().view("<u2")
    got = tables[codebook, half]
    bad = np.flatnonzero(got != want_bits)
    assert bad.size == 0, (f"{bad.size} of {STATES} states differ ({CODEBOOKS[codebook]}, "
                           f"{'odd' if half else 'even'} half), first state {bad[0]}: "
                           f"got 0x{got[bad[0]]:04x}, want 0x{want_bits[bad[0]]:04x}")
