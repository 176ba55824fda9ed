# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The EXL3 codec in plain PyTorch: the executable spec, the test oracle and the CPU
path.

Vectorized, runs on any device. Follows docs/design/exl3_format.md §2-§4:
  trellis words -> 16-bit states (tail-biting bit windows) -> codebook values (fp16,
  exact) -> Ŵ in the rotated basis (tile permutation undone) -> W = diag(suh) · Bd(Ĥ) ·
  Ŵ · Bd(Ĥ) · diag(svh)   (Ĥ = 128-point Sylvester Hadamard / sqrt(128))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from .format import (
    HADAMARD_SIZE,
    HALF_BITS,
    TILE,
    Codebook,
    Exl3FormatError,
    bits_from_trellis_width,
)

# Trellis window L: every weight is decoded from the 16 stream bits ending at its code.
STATE_BITS = 16
STATE_MASK = (1 << STATE_BITS) - 1
# Weights per tile, i.e. trellis steps in one tail-biting ring.
TILE_POSITIONS = TILE * TILE
# Half-integer rates: position i carries KA + bit (i mod 16) of this mask bits (odd
# positions +1).
HALF_RATE_MASK = 0xAAAA

# Codebook arithmetic, all mod 2**32 on the zero-extended state
# (docs/design/exl3_format.md §4).
U32_MASK = 0xFFFFFFFF
THREE_INST_MULT = 89226354
THREE_INST_ADD = 64248484
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
# 3INST/MCG: keep each fp16 half's sign and low 12 bits, force its exponent into
# 0b011xx.
HALVES_AND_MASK = 0x8FFF8FFF
HALVES_XOR_MASK = 0x3B603B60
# MUL1: the fp16 pattern 0x6400 + t is the number 1024 + t; then one fp16 fma with
# these constants.
MUL1_BYTE_SUM_BASE = 1024
MUL1_FMA_SCALE_BITS = 0x1EEE
MUL1_FMA_BIAS_BITS = 0xC931

# decode_rotated works on this many tile-row states at once, to bound the int32/int64
# scratch.
DECODE_CHUNK_STATES = 1 << 24


def _fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integers 0..65535 as fp16 bit patterns."""
    signed = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
    return signed.to(torch.int16).view(torch.float16)


@functools.cache
def _codebook_table_cpu(codebook: int) -> torch.Tensor:
    """All 65,536 decoded values of one codebook, fp16, in state order.

    Emulated in float64 (exact: the sum of two fp16 halves, or the fp16 fma, needs at
    most 22 significant bits, so it is also exact in float32 on torch's double->half
    path) and rounded once to fp16, round-to-nearest-even, exactly like __hadd / __hfma.
    """
    cb = Codebook(codebook)
    s = torch.arange(1 << STATE_BITS, dtype=torch.int64)
    if cb == Codebook.MUL1:
        x = (s * MUL1_MULT) & U32_MASK
        t = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        scale = _fp16_from_bits(torch.tensor([MUL1_FMA_SCALE_BITS])).double()
        bias = _fp16_from_bits(torch.tensor([MUL1_FMA_BIAS_BITS])).double()
        exact = (MUL1_BYTE_SUM_BASE + t).double() * scale + bias
    else:
        if cb == Codebook.THREE_INST:
            x = (s * THREE_INST_MULT + THREE_INST_ADD) & U32_MASK
        else:
            x = (s * MCG_MULT) & U32_MASK
        x = (x & HALVES_AND_MASK) ^ HALVES_XOR_MASK
        exact = (
            _fp16_from_bits(x & STATE_MASK).double() + _fp16_from_bits(x >> 16).double()
        )
    return exact.to(torch.float32).to(torch.float16)


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def codebook_table(
    codebook: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The 65,536-entry fp16 lookup table of a codebook on `device` (cached)."""
    device = torch.device(device or "cpu")
    key = (int(codebook), device)
    table = _TABLES.get(key)
    if table is None:
        table = _codebook_table_cpu(int(Codebook(codebook))).to(device)
        _TABLES[key] = table
    return table


def codebook_decode(states: torch.Tensor, codebook: int) -> torch.Tensor:
    """Decode 16-bit trellis states (0..65535; int16 is read as unsigned) to fp16
    values."""
    if states.dtype == torch.int16:
        states = states.to(torch.int32) & STATE_MASK
    return codebook_table(codebook, states.device)[states.long()]


def _code_lengths(bits: float) -> list[int]:
    """d_i, the code length of each of the 256 positions of a tile."""
    if bits in HALF_BITS:
        base = int(bits)
        return [
            base + ((HALF_RATE_MASK >> (i % 16)) & 1) for i in range(TILE_POSITIONS)
        ]
    return [int(bits)] * TILE_POSITIONS


@functools.cache
def _tile_to_positions() -> tuple[int, ...]:
    """For row-major tile element r*16+c, the trellis position holding it (§3.2)."""
    table = [0] * TILE_POSITIONS
    for p in range(TILE_POSITIONS):
        lane, j = divmod(p, 8)
        r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
        c = lane // 4 + 8 * ((j >> 2) & 1)
        table[r * TILE + c] = p
    return tuple(table)


@functools.cache
def _window_plan(
    bits: float, order: tuple[int, ...] | None
) -> tuple[torch.Tensor, ...]:
    """Where each state's 16-bit window lies in the stored words.

    Position i's state is stream bits [S_i - 16, S_i) modulo the ring length R (§3.4).
    That window spans stream words w0 = start // 16 and w0 + 1, at bit offset o = start
    % 16. Stream word j is stored word j ^ 1 (each uint32's halves are swapped on store,
    §3.3), so the plan indexes the stored words directly. `order` lists the positions to
    produce (default all).
    """
    lengths = _code_lengths(bits)
    ring = sum(lengths)
    n_words = ring // STATE_BITS
    ends, total = [], 0
    for d in lengths:
        total += d
        ends.append(total)
    positions = order if order is not None else tuple(range(TILE_POSITIONS))
    first, second, shift = [], [], []
    for p in positions:
        start = (ends[p] - STATE_BITS) % ring
        w0, o = divmod(start, STATE_BITS)
        first.append(w0 ^ 1)
        second.append(((w0 + 1) % n_words) ^ 1)
        shift.append(o)
    return (
        torch.tensor(first),
        torch.tensor(second),
        torch.tensor(shift, dtype=torch.int32),
    )


def _check_bits(trellis: torch.Tensor, bits: float | None) -> float:
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise Exl3FormatError(
            f"trellis: expected int16 [k/16, n/16, 16*bits], got {trellis.dtype} "
            f"{list(trellis.shape)}"
        )
    found = bits_from_trellis_width(trellis.shape[-1], "trellis")
    if bits is not None and float(bits) != float(found):
        raise Exl3FormatError(
            f"trellis: width {trellis.shape[-1]} means {found} bits, caller said {bits}"
        )
    return found


def _states(
    trellis: torch.Tensor, bits: float, order: tuple[int, ...] | None
) -> torch.Tensor:
    first, second, shift = (t.to(trellis.device) for t in _window_plan(bits, order))
    words = trellis.to(torch.int32) & STATE_MASK
    hi = words.index_select(-1, first)
    lo = words.index_select(-1, second)
    # hi << o may exceed 16 bits (and wrap int32 for o = 15); the mask keeps only the
    # window.
    return ((hi << shift) | (lo >> (STATE_BITS - shift))) & STATE_MASK


def unpack_states(trellis: torch.Tensor, bits: float | None = None) -> torch.Tensor:
    """int16 [k/16, n/16, 16K] -> int32 [k/16, n/16, 256] states in trellis-position
    order."""
    return _states(trellis, _check_bits(trellis, bits), None)


def decode_rotated(
    trellis: torch.Tensor, codebook: int, bits: float | None = None
) -> torch.Tensor:
    """Ŵ: the fp16 [k, n] weight in the rotated basis, decoded from the trellis."""
    bits = _check_bits(trellis, bits)
    kb, nb, _ = trellis.shape
    order = _tile_to_positions()
    out = torch.empty((kb, TILE, nb, TILE), dtype=torch.float16, device=trellis.device)
    rows_per_chunk = max(1, DECODE_CHUNK_STATES // (nb * TILE_POSITIONS))
    for r0 in range(0, kb, rows_per_chunk):
        r1 = min(kb, r0 + rows_per_chunk)
        # States come out in row-major tile order already (the plan is permuted), so a
        # tile is a plain [16, 16] view.
        values = codebook_decode(_states(trellis[r0:r1], bits, order), codebook)
        out[r0:r1] = values.view(r1 - r0, nb, TILE, TILE).permute(0, 2, 1, 3)
    return out.view(kb * TILE, nb * TILE)


_HADAMARDS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def hadamard_128(
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Ĥ = H / sqrt(128), H[i, j] = (-1)^popcount(i & j) (Sylvester, natural order)."""
    device = torch.device(device or "cpu")
    key = (dtype, device)
    h = _HADAMARDS.get(key)
    if h is None:
        idx = torch.arange(HADAMARD_SIZE)
        and_ = idx[:, None] & idx[None, :]
        parity = torch.zeros_like(and_)
        for b in range(int(math.log2(HADAMARD_SIZE))):
            parity ^= (and_ >> b) & 1
        h64 = (1 - 2 * parity).double() / math.sqrt(HADAMARD_SIZE)
        h = h64.to(dtype=dtype, device=device)
        _HADAMARDS[key] = h
    return h


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_blocks(size: int) -> None:
    if size % HADAMARD_SIZE:
        raise Exl3FormatError(
            f"Hadamard: dim {size} is not a multiple of {HADAMARD_SIZE}"
        )


def _had_last(x: torch.Tensor) -> torch.Tensor:
    """Ĥ applied to each contiguous 128-block of the last dim (x · Bd(Ĥ))."""
    size = x.shape[-1]
    _check_blocks(size)
    h = hadamard_128(x.dtype, x.device)
    blocks = x.reshape(*x.shape[:-1], size // HADAMARD_SIZE, HADAMARD_SIZE)
    return (blocks @ h).reshape(x.shape)


def _had_rows(w: torch.Tensor) -> torch.Tensor:
    """Ĥ applied to each 128-row block of a [k, n] matrix (Bd(Ĥ) · w), without
    transposes."""
    k, n = w.shape
    _check_blocks(k)
    h = hadamard_128(w.dtype, w.device)
    return torch.matmul(h, w.reshape(k // HADAMARD_SIZE, HADAMARD_SIZE, n)).reshape(
        k, n
    )


def reconstruct(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: int,
    bits: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W [k, n] in the original basis (y = x @ W), in fp32 (float64 if asked)."""
    w_hat = decode_rotated(trellis, codebook, bits)
    k, n = w_hat.shape
    if tuple(suh.shape) != (k,) or tuple(svh.shape) != (n,):
        raise Exl3FormatError(
            f"reconstruct: suh {list(suh.shape)} / svh {list(svh.shape)} do not match "
            "the "
            f"trellis' [k={k}, n={n}]"
        )
    cdtype = _compute_dtype(dtype)
    w = w_hat.to(cdtype)
    w = _had_rows(w) * suh.to(cdtype)[:, None]
    w = _had_last(w) * svh.to(cdtype)[None, :]
    return w.to(dtype)


def transform_input(x: torch.Tensor, suh: torch.Tensor) -> torch.Tensor:
    """xh = blockwise Ĥ of (x * suh) over the last dim, fp32 (float64 stays float64)."""
    if x.shape[-1] != suh.shape[-1]:
        raise Exl3FormatError(
            f"transform_input: x has {x.shape[-1]} input features, suh has "
            f"{suh.shape[-1]}"
        )
    cdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return _had_last(x.to(cdtype) * suh.to(cdtype))


def forward(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: int,
    shard_widths: Sequence[int] | None = None,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """y = x @ W + bias through the transform path, shard by shard (fused layers).

    Shard s owns output columns [sum(widths[:s]), +widths[s]) and its own input scales
    suh[s]: y_s = H(x * suh[s]) @ Ŵ[:, cols_s]; then the output Hadamard per 128 columns
    and svh.
    """
    w_hat = decode_rotated(trellis, codebook)
    k, n = w_hat.shape
    suh2 = suh if suh.dim() == 2 else suh.unsqueeze(0)
    if suh2.dim() != 2 or suh2.shape[1] != k:
        raise Exl3FormatError(f"forward: suh {list(suh.shape)} does not match k = {k}")
    widths = (
        list(shard_widths) if shard_widths is not None else [n] * (suh2.shape[0] == 1)
    )
    if len(widths) != suh2.shape[0]:
        raise Exl3FormatError(
            f"forward: {suh2.shape[0]} suh rows but shard_widths = {shard_widths}"
        )
    if sum(widths) != n or any(w <= 0 or w % HADAMARD_SIZE for w in widths):
        raise Exl3FormatError(
            f"forward: shard_widths {widths} must be positive multiples of "
            f"{HADAMARD_SIZE} "
            f"summing to n = {n}"
        )
    if tuple(svh.shape) != (n,):
        raise Exl3FormatError(f"forward: svh {list(svh.shape)} does not match n = {n}")
    if x.shape[-1] != k:
        raise Exl3FormatError(
            f"forward: x has {x.shape[-1]} input features, layer has k = {k}"
        )
    cdtype = _compute_dtype(dtype)
    w = w_hat.to(cdtype)
    x = x.to(cdtype)
    parts, col = [], 0
    for s, width in enumerate(widths):
        parts.append(transform_input(x, suh2[s]) @ w[:, col : col + width])
        col += width
    y = _had_last(torch.cat(parts, dim=-1)) * svh.to(cdtype)
    if bias is not None:
        y = y + bias.to(cdtype)
    return y.to(dtype)
