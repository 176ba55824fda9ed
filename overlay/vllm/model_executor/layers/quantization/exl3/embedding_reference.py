# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decode of a quantized token embedding in plain PyTorch: the executable spec of
docs/design/exl3_format.md §8, the oracle of the CUDA row gather and the CPU path.

Only the looked-up rows are decoded (a row gather), in fp32:

    ring words -> K-bit symbols -> 16-bit states (newest symbol lowest, tail-biting)
    -> MUL1 codebook values (fp16, exact) x the group's fp16 scale
    -> 256-point Walsh-Hadamard butterflies (stride 1, 2, ..., 128) / 16 x signs

Every step is one IEEE fp32 operation per element in a fixed order (the butterflies in
ascending stride, as the CUDA kernel runs them), so a decoder that follows the same
order reproduces these values bit for bit.

Imports only torch and the format modules, so the tools load it on its own.
"""

from __future__ import annotations

import functools

import torch

from .format import (
    EMBED_GROUP,
    EMBED_SCALE_WORDS,
    EMBED_SIGNS_SUFFIX,
    Codebook,
    Exl3FormatError,
    embedding_geometry,
)
from .reference import STATE_BITS, STATE_MASK, codebook_table

# Bits per stored word of the ring's bitstream (little-endian: stream bit b is bit
# b % 16 of stream word b // 16).
STREAM_WORD_BITS = 16
# The orthonormal 256-point transform's normalisation, 1/sqrt(256): a power of two, so
# applying it after the butterflies rounds nothing.
GROUP_NORM = EMBED_GROUP**-0.5
# Rows decoded per step of decode_rows, bounding the int64 scratch (rows x groups x 256
# states).
DECODE_CHUNK_ROWS = 4096


@functools.cache
def _symbol_plan(bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each of the 256 positions: the stream word holding its symbol's first bit,
    the word after it (cyclically; read only for the symbol's high bits) and the bit
    offset. Symbol i is stream bits [i*K, i*K + K), lowest bit first."""
    start = torch.arange(EMBED_GROUP) * bits
    words = EMBED_GROUP * bits // STREAM_WORD_BITS
    first = start // STREAM_WORD_BITS
    return first, (first + 1) % words, start % STREAM_WORD_BITS


def ring_states(rings: torch.Tensor, bits: int) -> torch.Tensor:
    """int16 [N, 1 + 16K] rings -> int64 [N, 256] states.

    state_i = ((state_{i-1} << K) | symbol_i) & 0xFFFF around the ring: symbol i in the
    low K bits, symbol i - 1 above it, and so on for ceil(16 / K) symbols; position 0
    takes its older symbols from the ring's end."""
    first, second, shift = (t.to(rings.device) for t in _symbol_plan(bits))
    stream = rings[:, EMBED_SCALE_WORDS:].to(torch.int64) & STATE_MASK
    window = stream[:, first] | (stream[:, second] << STREAM_WORD_BITS)
    symbols = (window >> shift) & ((1 << bits) - 1)
    states = torch.zeros_like(symbols)
    for age in range(-(-STATE_BITS // bits)):
        states |= torch.roll(symbols, age, dims=1) << (age * bits)
    return states & STATE_MASK


def hadamard_butterflies(x: torch.Tensor) -> torch.Tensor:
    """H · x over the last dim (a power of two), unnormalised, H[i, j] =
    (-1)^popcount(i & j): one butterfly stage per index bit, stride 1 first."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    stride = 1
    while stride < n:
        pairs = x.reshape(*lead, n // (2 * stride), 2, stride)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((low + high, low - high), dim=-2).reshape(*lead, n)
        stride *= 2
    return x


def decode_rings(rings: torch.Tensor, signs: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 [N, 256]: the groups encoded by `rings` (int16 [N, 1 + 16K]), each with its
    row of `signs` (fp16 [N, 256], or [256] for all)."""
    scales = rings[:, 0].contiguous().view(torch.float16).float()
    values = codebook_table(Codebook.MUL1, rings.device)[ring_states(rings, bits)]
    rotated = hadamard_butterflies(values.float() * scales[:, None])
    return rotated * GROUP_NORM * signs.float()


def check_ids(ids: torch.Tensor, rows: int, name: str) -> None:
    """Token ids are integers in [0, rows): the rows of `name`."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise Exl3FormatError(
            f"ids: dtype {ids.dtype}, expected int32 or int64 (quantized token "
            f"embedding {name})"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        bad = ids[(ids < 0) | (ids >= rows)][0]
        raise Exl3FormatError(
            f"ids: token id {int(bad)} is outside [0, {rows}), the rows of {name}"
        )


def decode_rows(
    trellis: torch.Tensor,
    signs: torch.Tensor,
    ids: torch.Tensor,
    hidden: int,
    name: str = "embedding",
) -> torch.Tensor:
    """fp32 [*ids.shape, hidden]: the table rows `ids` of a quantized token embedding
    (trellis int16 [rows, groups * (1 + 16K)], signs fp16 [groups, 256]), decoded
    row by row; nothing else of the table is decoded. `name` is the module the error
    messages name."""
    if trellis.dtype != torch.int16 or signs.dtype != torch.float16:
        raise Exl3FormatError(
            f"{name}: trellis {trellis.dtype} / {EMBED_SIGNS_SUFFIX} {signs.dtype}, "
            "expected int16 / float16 (quantized token embedding)"
        )
    rows, groups, bits = embedding_geometry(
        name, tuple(trellis.shape), tuple(signs.shape)
    )
    if not 0 < hidden <= groups * EMBED_GROUP:
        raise Exl3FormatError(
            f"{name}: hidden {hidden} is outside (0, {groups * EMBED_GROUP}], the "
            f"columns of its {groups} groups"
        )
    check_ids(ids, rows, f"{name}.trellis")
    flat = ids.reshape(-1).to(trellis.device, torch.int64)
    out = torch.empty(flat.numel(), hidden, dtype=torch.float32, device=trellis.device)
    for start in range(0, flat.numel(), DECODE_CHUNK_ROWS):
        chunk = flat[start : start + DECODE_CHUNK_ROWS]
        rings = trellis.index_select(0, chunk).view(chunk.numel() * groups, -1)
        tiled = signs.repeat(chunk.numel(), 1)
        decoded = decode_rings(rings, tiled, bits)
        out[start : start + chunk.numel()] = decoded.view(chunk.numel(), -1)[:, :hidden]
    return out.view(*ids.shape, hidden)
