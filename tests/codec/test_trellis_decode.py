# SPDX-License-Identifier: Apache-2.0
"""The reference decoder at every rate: bit unpacking against an independent packer, the tile
layout of §3.2, the transform path (forward == x @ W, shards, bias) and CPU == CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from lcg import code_lengths, lcg_activations, lcg_scales, lcg_trellis, pack_codes, ring_states

ALL_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)

# §3.2, grid[r][c] = trellis position of tile element (r, c), copied from the format document.
TILE_GRID = [
    [0, 32, 64, 96, 128, 160, 192, 224, 4, 36, 68, 100, 132, 164, 196, 228],
    [1, 33, 65, 97, 129, 161, 193, 225, 5, 37, 69, 101, 133, 165, 197, 229],
    [8, 40, 72, 104, 136, 168, 200, 232, 12, 44, 76, 108, 140, 172, 204, 236],
    [9, 41, 73, 105, 137, 169, 201, 233, 13, 45, 77, 109, 141, 173, 205, 237],
    [16, 48, 80, 112, 144, 176, 208, 240, 20, 52, 84, 116, 148, 180, 212, 244],
    [17, 49, 81, 113, 145, 177, 209, 241, 21, 53, 85, 117, 149, 181, 213, 245],
    [24, 56, 88, 120, 152, 184, 216, 248, 28, 60, 92, 124, 156, 188, 220, 252],
    [25, 57, 89, 121, 153, 185, 217, 249, 29, 61, 93, 125, 157, 189, 221, 253],
    [2, 34, 66, 98, 130, 162, 194, 226, 6, 38, 70, 102, 134, 166, 198, 230],
    [3, 35, 67, 99, 131, 163, 195, 227, 7, 39, 71, 103, 135, 167, 199, 231],
    [10, 42, 74, 106, 138, 170, 202, 234, 14, 46, 78, 110, 142, 174, 206, 238],
    [11, 43, 75, 107, 139, 171, 203, 235, 15, 47, 79, 111, 143, 175, 207, 239],
    [18, 50, 82, 114, 146, 178, 210, 242, 22, 54, 86, 118, 150, 182, 214, 246],
    [19, 51, 83, 115, 147, 179, 211, 243, 23, 55, 87, 119, 151, 183, 215, 247],
    [26, 58, 90, 122, 154, 186, 218, 250, 30, 62, 94, 126, 158, 190, 222, 254],
    [27, 59, 91, 123, 155, 187, 219, 251, 31, 63, 95, 127, 159, 191, 223, 255],
]


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_matches_packer_at_every_rate(ref, bits):
    rng = random.Random(int(bits * 10))
    tiles, expected = [], []
    for _ in range(3):
        codes = [rng.randrange(1 << d) for d in code_lengths(bits)]
        tiles.append(pack_codes(codes, bits))
        expected.append(ring_states(codes, bits))
    trellis = torch.stack(tiles).reshape(1, 3, -1)
    assert trellis.shape[-1] == 16 * bits
    states = ref.unpack_states(trellis)
    assert states.tolist() == [expected]
    # The rate may be passed explicitly; a wrong one is refused.
    assert torch.equal(ref.unpack_states(trellis, bits), states)
    with pytest.raises(ValueError, match="bits"):
        ref.unpack_states(trellis, 4 if bits != 4 else 5)


def test_tile_layout_matches_format_grid(ref, monkeypatch):
    # With K = 8 every state's low byte is its own code; a table returning the low byte makes
    # each decoded weight equal to the code written at its trellis position.
    identity_low_byte = (torch.arange(65536) & 0xFF).half()
    monkeypatch.setattr(ref, "codebook_table", lambda cb, device=None: identity_low_byte)
    trellis = pack_codes(list(range(256)), 8).reshape(1, 1, 128)
    w_hat = ref.decode_rotated(trellis, 0)
    assert w_hat.int().tolist() == TILE_GRID


def test_tile_order_row_major_over_k_then_n(ref, monkeypatch):
    identity_low_byte = (torch.arange(65536) & 0xFF).half()
    monkeypatch.setattr(ref, "codebook_table", lambda cb, device=None: identity_low_byte)
    kb, nb = 3, 5
    tiles = [pack_codes([10 * i + j] * 256, 8) for i in range(kb) for j in range(nb)]
    trellis = torch.stack(tiles).reshape(kb, nb, 128)
    w_hat = ref.decode_rotated(trellis, 0)
    assert w_hat.shape == (16 * kb, 16 * nb)
    for i in range(kb):
        for j in range(nb):
            block = w_hat[16 * i:16 * i + 16, 16 * j:16 * j + 16]
            assert (block == 10 * i + j).all()


def test_hadamard_is_sylvester_orthonormal(ref):
    h = ref.hadamard_128(torch.float64)
    assert h.shape == (128, 128)
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.t())
    assert h[0].tolist() == pytest.approx([128 ** -0.5] * 128, rel=1e-15)
    # H[i][j] = (-1)^popcount(i & j)
    for i, j in ((1, 1), (3, 5), (127, 127), (64, 63), (96, 32)):
        assert h[i, j].item() * 128 ** 0.5 == pytest.approx((-1) ** bin(i & j).count("1"))


@pytest.mark.parametrize("bits,codebook", [(4, 0), (3, 1), (2.5, 2), (8, 2), (1, 0)])
def test_forward_equals_x_times_reconstructed_w(ref, bits, codebook):
    trellis = lcg_trellis(11, 16, 24, bits)
    suh, svh = lcg_scales(12, 256), lcg_scales(13, 384)
    x = lcg_activations(14, 3, 256)
    w = ref.reconstruct(trellis, suh, svh, codebook, dtype=torch.float64)
    y = ref.forward(x, trellis, suh, svh, codebook, dtype=torch.float64)
    assert torch.allclose(y, x.double() @ w, rtol=1e-10, atol=1e-10)
    # W is the two-sided transform of Ŵ (§2.1), written out with dense block-diagonal matrices.
    h = torch.block_diag(*[ref.hadamard_128(torch.float64)] * 2)
    hn = torch.block_diag(*[ref.hadamard_128(torch.float64)] * 3)
    w_hat = ref.decode_rotated(trellis, codebook).double()
    dense = torch.diag(suh.double()) @ h @ w_hat @ hn @ torch.diag(svh.double())
    assert torch.allclose(w, dense, rtol=1e-10, atol=1e-12)


def test_forward_shards_use_their_own_input_scales(ref):
    # A fused qkv-like layer: 3 shards (256, 128, 128 columns), one suh row each.
    trellis = lcg_trellis(21, 16, 32, 3)
    suh = torch.stack([lcg_scales(22 + s, 256) for s in range(3)])
    svh, bias = lcg_scales(25, 512), lcg_scales(26, 512)
    x = lcg_activations(27, 4, 256)
    widths = [256, 128, 128]
    y = ref.forward(x, trellis, suh, svh, 2, shard_widths=widths, bias=bias, dtype=torch.float64)
    col = 0
    for s, width in enumerate(widths):
        part = trellis[:, col // 16:(col + width) // 16]
        w = ref.reconstruct(part, suh[s], svh[col:col + width], 2, dtype=torch.float64)
        expect = x.double() @ w + bias[col:col + width].double()
        assert torch.allclose(y[:, col:col + width], expect, rtol=1e-10, atol=1e-10)
        col += width


@pytest.mark.parametrize("widths", [[256, 255], [128, 128], [640], [384, 128, 0]])
def test_forward_rejects_bad_shard_widths(ref, widths):
    trellis = lcg_trellis(31, 8, 32, 2)
    suh = torch.stack([lcg_scales(32, 128)] * len(widths))
    with pytest.raises(ValueError, match="shard_widths"):
        ref.forward(lcg_activations(33, 1, 128), trellis, suh, lcg_scales(34, 512), 0,
                    shard_widths=widths)


def test_forward_rejects_wrong_input_width(ref):
    trellis = lcg_trellis(41, 8, 8, 2)
    with pytest.raises(ValueError, match="input features"):
        ref.forward(lcg_activations(42, 1, 64), trellis, lcg_scales(43, 128),
                    lcg_scales(44, 128), 0)


def test_transform_input_is_blockwise_hadamard(ref):
    x = lcg_activations(51, 2, 256)
    suh = lcg_scales(52, 256)
    xh = ref.transform_input(x, suh)
    assert xh.dtype == torch.float32
    h = ref.hadamard_128(torch.float32)
    xs = x.float() * suh.float()
    assert torch.allclose(xh[:, :128], xs[:, :128] @ h, atol=1e-6)
    assert torch.allclose(xh[:, 128:], xs[:, 128:] @ h, atol=1e-6)


def test_decode_chunking_does_not_change_result(ref, monkeypatch):
    trellis = lcg_trellis(61, 8, 16, 4)
    whole = ref.decode_rotated(trellis, 1)
    monkeypatch.setattr(ref, "DECODE_CHUNK_STATES", 16 * 256)  # one tile row per chunk
    assert torch.equal(ref.decode_rotated(trellis, 1), whole)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits,codebook", [(4, 0), (3, 1), (2.5, 2), (6, 2)])
def test_cuda_matches_cpu(ref, bits, codebook):
    trellis = lcg_trellis(71, 32, 64, bits)
    suh, svh = lcg_scales(72, 512), lcg_scales(73, 1024)
    cpu = ref.decode_rotated(trellis, codebook)
    gpu = ref.decode_rotated(trellis.cuda(), codebook)
    assert torch.equal(gpu.cpu(), cpu)
    w = ref.reconstruct(trellis.cuda(), suh.cuda(), svh.cuda(), codebook)
    assert torch.allclose(w.cpu(), ref.reconstruct(trellis, suh, svh, codebook), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decodes_a_full_size_layer(ref):
    # A 5120 x 17408 layer (Qwen3-32B-like MLP) at 4 bits decodes on the GPU in one call, and
    # its first tile rows equal the CPU decode of the same slice.
    gen = torch.Generator().manual_seed(0)
    trellis = torch.randint(-(1 << 15), 1 << 15, (320, 1088, 64), generator=gen,
                            dtype=torch.int32).to(torch.int16)
    suh = torch.ones(5120, dtype=torch.float16, device="cuda")
    svh = torch.ones(17408, dtype=torch.float16, device="cuda")
    w_hat = ref.decode_rotated(trellis.cuda(), 2)
    assert w_hat.shape == (5120, 17408)
    assert torch.equal(w_hat[:32].cpu(), ref.decode_rotated(trellis[:2], 2))
    w = ref.reconstruct(trellis.cuda(), suh, svh, 2)
    assert torch.isfinite(w).all()
