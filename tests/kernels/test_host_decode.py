# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA kernels' own decode code, compiled for the host by a small driver program
(decode_host.cu next to this module), against the reference: the codebook arithmetic of
decode_pair, the per-lane trellis state extraction and the whole per-lane
decode_fragments of exl3_trellis.cuh.

The decode headers compile for the host too (exact fallbacks chosen by __CUDA_ARCH__),
so these checks need nvcc but no GPU; only the PTX mapping is left to the GPU tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def driver(host_driver) -> Path:
    return host_driver("decode_host.cu")


# The CUDA kernels' codebook arithmetic (compiled for the host) against the reference.
#
# exl3_trellis.cuh decode_pair turns two states into one fp16x2 B-fragment register:
# integer multiplies, then for 3INST/MCG one LOP3 mask and one fp16x2 add of the halves
# per state and a byte permute, for MUL1 dp4a byte sums and one fp16x2 fma. Every
# instruction has an exact host fallback selected only by __CUDA_ARCH__ (fp16 rounding
# emulated in exl3_trellis.cuh), so this checks the decode's own source for all
# 65,536 states x 3 codebooks, in both halves of the pair, against
# reference.codebook_table; only the mapping of each wrapper to its PTX instruction is
# left to the GPU verification (exl3_reconstruct bit-exact). Needs nvcc (host compile
# only).

from vllm_exl3.codec import reference  # noqa: E402

CODEBOOKS = {0: "3inst", 1: "mcg", 2: "mul1"}
STATES = 1 << 16


@pytest.fixture(scope="module")
def tables(tmp_path_factory, driver: Path) -> np.ndarray:
    out = tmp_path_factory.mktemp("codebook") / "tables.bin"
    subprocess.run([str(driver), "codebook", str(out)], check=True, capture_output=True)
    return np.fromfile(out, dtype="<u2").reshape(3, 2, STATES)


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS), ids=CODEBOOKS.get)
@pytest.mark.parametrize("half", (0, 1), ids=("even", "odd"))
def test_pair_decode_matches_reference(
    tables: np.ndarray, codebook: int, half: int
) -> None:
    want = reference.codebook_table(codebook, "cpu")  # fp16 [65536], indexed by state
    want_bits = want.view(torch.int16).numpy().view("<u2")
    got = tables[codebook, half]
    bad = np.flatnonzero(got != want_bits)
    assert bad.size == 0, (
        f"{bad.size} of {STATES} states differ ({CODEBOOKS[codebook]}, "
        f"{'odd' if half else 'even'} half), first state {bad[0]}: "
        f"got 0x{got[bad[0]]:04x}, want 0x{want_bits[bad[0]]:04x}"
    )


# The CUDA kernels' trellis state extraction (compiled for the host) against the
# reference.
#
# exl3_trellis.cuh cuts each lane's 8 states out of funnel-shifted words at compile-time
# offsets; this checks that bit arithmetic for every rate, on random tiles (including
# the ring wrap of lane 0 and the last lanes), against reference.unpack_states. Needs
# nvcc (host compile only).

RATES = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
STATE_TILES = 7


@pytest.mark.parametrize("bits", RATES)
def test_states_match_reference(driver: Path, tmp_path: Path, bits: float) -> None:
    gen = torch.Generator().manual_seed(int(bits * 10))
    width = int(16 * bits)
    trellis = torch.randint(
        -32768, 32768, (1, STATE_TILES, width), generator=gen, dtype=torch.int32
    ).to(torch.int16)
    words = tmp_path / "tiles.bin"
    trellis.numpy().tofile(words)
    out = subprocess.run(
        [str(driver), "states", str(int(2 * bits)), str(STATE_TILES), str(words)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    got = torch.tensor([int(v) for v in out], dtype=torch.int32).view(
        1, STATE_TILES, 256
    )
    want = reference.unpack_states(trellis, bits)
    assert torch.equal(got, want), (
        f"{int((got != want).sum())} states differ at {bits} bits"
    )


# The kernels' whole per-lane trellis decode (compiled for the host) against the
# reference.
#
# decode_fragments (exl3_trellis.cuh) is what the GEMM and reconstruct kernels run per
# lane and tile: the rate's compile-time cut plan (views, one-instruction cuts), the
# codebook products (with the paired-view shortcut that derives a state's product from
# its view and its partner's product instead of cutting it), and the fp16 values packed
# into the two mma B fragments. Every instruction has an exact host fallback chosen only
# by __CUDA_ARCH__, so this checks the decode's own source for every rate x codebook on
# random tiles (ring wrap included) against
# reference.codebook_decode(reference.unpack_states(...)), bit for bit. Needs nvcc (host
# only).

FRAGMENT_TILES = 5
CASES = [(b, cb) for b in RATES for cb in CODEBOOKS if b % 1 == 0 or cb == 2]


@pytest.mark.parametrize(
    "bits,codebook", CASES, ids=[f"{b:g}b-{CODEBOOKS[c]}" for b, c in CASES]
)
def test_fragments_match_reference(
    driver: Path, tmp_path: Path, bits: float, codebook: int
) -> None:
    gen = torch.Generator().manual_seed(int(bits * 10) * 3 + codebook)
    trellis = torch.randint(
        -32768,
        32768,
        (1, FRAGMENT_TILES, int(16 * bits)),
        generator=gen,
        dtype=torch.int32,
    ).to(torch.int16)
    words = tmp_path / "tiles.bin"
    trellis.numpy().tofile(words)
    out = subprocess.run(
        [
            str(driver),
            "fragments",
            str(int(2 * bits)),
            str(codebook),
            str(FRAGMENT_TILES),
            str(words),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    got = torch.tensor([int(v) for v in out], dtype=torch.int32).view(
        1, FRAGMENT_TILES, 256
    )
    states = reference.unpack_states(trellis, bits)
    want = (
        reference.codebook_decode(states, codebook).view(torch.int16).to(torch.int32)
        & 0xFFFF
    )
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (
        f"{bad.shape[0]} of {got.numel()} values differ at {bits} bits "
        f"{CODEBOOKS[codebook]}, first (tile, position) "
        f"{tuple(bad[0, 1:].tolist())}"
    )
