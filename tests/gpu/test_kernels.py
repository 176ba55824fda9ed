# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of the EXL3 kernels: the oracle's checks (exl3_oracle.py) as pytest cases.

Needs a CUDA GPU and the extension: $VLLM_EXL3_EXT, build/exl3/_exl3_C.abi3.so (quick
build: `python -m vllm_exl3.kernels_build` from scripts/), or an installed vllm._exl3_C.
The oracle is the overlay's reference codec in float64; the error bounds and their
derivation are in the oracle's docstring.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import exl3_oracle as vk  # noqa: E402

try:
    vk.load_extension()
except (
    ImportError,
    OSError,
    RuntimeError,
) as e:  # pragma: no cover - depends on the host
    pytest.skip(f"EXL3 extension not available: {e}", allow_module_level=True)


@pytest.fixture
def gen() -> torch.Generator:
    g = torch.Generator(device="cuda")
    g.seed()  # fresh random inputs every run
    return g


def assert_clean(rep: vk.Report) -> None:
    assert rep.rows, "no cases ran"
    assert not rep.failures, rep.failures[:5]


def test_nan_never_passes() -> None:
    rep = vk.Report()
    vk.check_nan_guard(rep)
    assert_clean(rep)


def test_reconstruct_bit_identical(gen: torch.Generator) -> None:
    rep = vk.Report()
    vk.check_reconstruct(rep, gen)
    assert_clean(rep)


@pytest.mark.parametrize("bits,codebook", vk.combos())
def test_every_rate_tier_split_shard_dtype(
    gen: torch.Generator, bits: float, codebook: int
) -> None:
    rep = vk.Report()
    vk.check_matrix(
        rep, gen, vk.M_VALUES, [(bits, codebook)], ([256], [128, 128], [128, 128, 128])
    )
    assert_clean(rep)


def test_split_k_every_tier(gen: torch.Generator) -> None:
    rep = vk.Report()
    vk.check_splits(rep, gen)
    assert_clean(rep)


def test_deterministic_mode_bit_exact(gen: torch.Generator) -> None:
    rep = vk.Report()
    vk.check_determinism(rep, gen)
    assert_clean(rep)


def test_cuda_graph_replay_equals_eager(gen: torch.Generator) -> None:
    rep = vk.Report()
    vk.check_graphs(rep, gen)
    assert_clean(rep)


def test_real_shapes_autotuned(gen: torch.Generator) -> None:
    rep = vk.Report()
    vk.check_real(rep, gen, vk.M_VALUES)
    assert_clean(rep)


def test_bad_inputs_raise_clear_errors() -> None:
    rep = vk.Report()
    vk.check_errors(rep)
    assert_clean(rep)


def _timed(layer, m: int, gen: torch.Generator) -> list[dict]:
    x = torch.randn(m, layer.k, device="cuda", generator=gen).to(torch.bfloat16)
    ws = vk.workspace(m * layer.n)
    flat = torch.ops._C.exl3_time_plans(
        x,
        layer.trellis,
        layer.suh,
        layer.svh,
        None,
        layer.widths,
        layer.codebook,
        vk.header(),
        ws,
    )
    keys = ("m_max", "path", "bm", "split", "wgmma", "stream", "early", "spread", "ns")
    rows = [dict(zip(keys, flat[i : i + 9])) for i in range(0, len(flat), 9)]
    assert rows and all(r["ns"] > 0 and r["m_max"] >= m for r in rows), rows
    return rows


def test_timer_candidates(gen: torch.Generator) -> None:
    """The opt-in plan timer (exl3_time_plans): at m = 4096 only the reconstruct paths
    and fused tiers that decode the weights <= 16 times (the wgmma engine's 256-token
    tier, where it exists) are timed; at m = 100 every tier with <= 16 row blocks is;
    the k-splits that fill whole waves of blocks are among the candidates; below 17 rows
    each fused plan is timed released early, late, and early with its blocks spread;
    from 17 rows released early only."""
    layer = vk.random_layer(gen, 1024, [1280], 4.0, 1)
    wgmma = vk.wgmma_engine()
    big = _timed(layer, 4096, gen)
    fused_big = [r for r in big if r["path"] == 0]
    assert len(fused_big) < len(big), big
    assert all(r["bm"] == 256 and r["wgmma"] == 1 for r in fused_big), big
    assert bool(fused_big) == wgmma, big
    mid = [r for r in _timed(layer, 100, gen) if r["path"] == 0]
    assert {r["bm"] for r in mid if not r["wgmma"]} == {16, 32, 64, 128}, mid
    assert {r["bm"] for r in mid if r["wgmma"]} == ({64, 128} if wgmma else set()), mid
    for engine in (0, 1) if wgmma else (0,):
        assert 8 in {
            r["split"] for r in mid if r["bm"] == 128 and r["wgmma"] == engine
        }, mid
    assert any(r["bm"] == 128 and r["stream"] > 0 for r in mid) == wgmma, mid
    assert {r["early"] for r in mid} == {1}, mid
    small = [r for r in _timed(layer, 8, gen) if r["path"] == 0]
    shapes = {(r["bm"], r["split"], r["wgmma"]) for r in small}
    for early, spread in ((0, 0), (1, 0), (1, 1)):
        assert {
            (r["bm"], r["split"], r["wgmma"])
            for r in small
            if (r["early"], r["spread"]) == (early, spread)
        } == shapes, small
    assert not [r for r in small if (r["early"], r["spread"]) == (0, 1)], small
