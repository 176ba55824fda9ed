# SPDX-License-Identifier: Apache-2.0
"""The test-vector generator of exl3-format.md §7 and a trellis bit packer (the inverse of the
decoder's unpacking, written independently of reference.py from the §3.3 text)."""

from __future__ import annotations

import torch

LCG_MULT = 6364136223846793005
LCG_ADD = 1442695040888963407
MASK64 = (1 << 64) - 1
HALF_RATE_MASK = 0xAAAA  # §3.5: odd positions carry one more bit


def lcg16(seed: int, count: int) -> list[int]:
    """x <- x*a + c mod 2^64, output x >> 48; the first output after one step from x = seed."""
    x, out = seed, []
    for _ in range(count):
        x = (x * LCG_MULT + LCG_ADD) & MASK64
        out.append(x >> 48)
    return out


def _as_int16(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - 65536 if v >= 32768 else v for v in values], dtype=torch.int16)


def lcg_trellis(seed: int, kb: int, nb: int, bits: float) -> torch.Tensor:
    width = int(16 * bits)
    return _as_int16(lcg16(seed, kb * nb * width)).reshape(kb, nb, width)


def lcg_scales(seed: int, n: int) -> torch.Tensor:
    vals = [(-1.0 if r & 0x8000 else 1.0) * (0.5 + (r & 0x3FF) / 1024) for r in lcg16(seed, n)]
    return torch.tensor(vals, dtype=torch.float64).half()


def lcg_activations(seed: int, m: int, k: int) -> torch.Tensor:
    vals = [(r - 32768) / 16384 for r in lcg16(seed, m * k)]
    return torch.tensor(vals, dtype=torch.float64).half().reshape(m, k)


def code_lengths(bits: float) -> list[int]:
    if bits != int(bits):
        base = int(bits)
        return [base + ((HALF_RATE_MASK >> (i % 16)) & 1) for i in range(256)]
    return [int(bits)] * 256


def pack_codes(codes: list[int], bits: float) -> torch.Tensor:
    """One tile's codes (trellis order) -> its stored int16 words.

    The stream is the codes MSB first, cut into 16-bit stream words; stored word j holds stream
    word j ^ 1 (uint32 words stored little-endian).
    """
    stream = []
    for code, d in zip(codes, code_lengths(bits)):
        assert 0 <= code < (1 << d)
        stream += [(code >> (d - 1 - b)) & 1 for b in range(d)]
    assert len(stream) % 32 == 0
    words = [int("".join(map(str, stream[i:i + 16])), 2) for i in range(0, len(stream), 16)]
    return _as_int16([words[j ^ 1] for j in range(len(words))])


def ring_states(codes: list[int], bits: float) -> list[int]:
    """state_i = ((state_{i-1} << d_i) | c_i) & 0xFFFF, cyclic: run the ring twice so every
    state has seen 16 bits of history (§3.4)."""
    lengths = code_lengths(bits)
    state = 0
    for _ in range(2):
        states = []
        for code, d in zip(codes, lengths):
            state = ((state << d) | code) & 0xFFFF
            states.append(state)
    return states


def hex16(t: torch.Tensor) -> list[int]:
    """fp16 or int16 values as unsigned 16-bit patterns."""
    if t.dtype == torch.float16:
        t = t.view(torch.int16)
    return [v & 0xFFFF for v in t.flatten().tolist()]
