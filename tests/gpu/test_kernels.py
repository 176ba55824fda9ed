# SPDX-License-Identifier: Apache-2.0
"""GPU tests of the EXL3 kernels: the checks of scripts/bench/verify_kernels.py as pytest cases.

Needs a CUDA GPU and the extension: $VLLM_EXL3_EXT, build/exl3/_exl3_C.abi3.so (quick build:
`python -m vllm_exl3.kernels_build` from scripts/), or an installed vllm._exl3_C. The oracle is
the overlay's reference codec in float64; the error bounds and their derivation are in the
verify script's docstring.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import verify_kernels as vk  # noqa: E402

try:
    vk.load_extension()
except (ImportError, OSError, RuntimeError) as e:  # pragma: no cover - depends on the host
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
def test_every_rate_tier_split_shard_dtype(gen: torch.Generator, bits: float,
                                           codebook: int) -> None:
    rep = vk.Report()
    vk.check_matrix(rep, gen, vk.M_VALUES, [(bits, codebook)],
                    ([256], [128, 128], [128, 128, 128]))
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


def _timed_plans(err: str, m: int) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith(f"exl3 plan m={m} ")]


def test_tuner_candidates_and_bucket_cache(gen: torch.Generator, capfd, monkeypatch) -> None:
    """The autotuner (VLLM_EXL3_LOG_PLANS=1 prints each timed candidate): at m = 4096 only the
    reconstruct paths and fused tiers that decode the weights <= 16 times (the wgmma engine's
    256-token tier, where it exists) are timed; at m = 100 every tier with <= 16 row blocks is;
    the k-splits that fill whole waves of blocks are among the candidates; below 17 rows each
    fused plan is timed with the GEMM released at the input transform's start, at its start
    with its blocks spread, and at its end; from 17 rows at its start only, and also spread
    where its grid leaves room to stack blocks; a second m in an already tuned power-of-two
    bucket times nothing (what exl3/warmup.py relies on)."""
    monkeypatch.setenv("VLLM_EXL3_LOG_PLANS", "1")
    layer = vk.random_layer(gen, 1024, [1280], 4.0, 1)

    def call(m: int) -> None:
        x = torch.randn(m, 1024, device="cuda", generator=gen).to(torch.bfloat16)
        y = torch.ops._C.exl3_linear(x, layer.trellis, layer.suh, layer.svh, None,
                                     layer.widths, layer.codebook)
        assert bool(torch.isfinite(y).all())
        torch.cuda.synchronize()

    capfd.readouterr()
    call(4096)
    big = _timed_plans(capfd.readouterr().err, 4096)
    wgmma = vk.wgmma_engine()
    fused_big = [ln for ln in big if " path=0 " in ln]
    assert big and len(fused_big) < len(big), big
    assert all(" bm=256 " in ln and " wgmma=1 " in ln for ln in fused_big), big
    assert bool(fused_big) == wgmma, big
    call(100)
    mid = _timed_plans(capfd.readouterr().err, 100)

    def tiers(engine: int) -> set[int]:
        return {int(ln.split(" bm=")[1].split()[0]) for ln in mid
                if " path=0 " in ln and f" wgmma={engine} " in ln}

    assert tiers(0) == {16, 32, 64, 128}, mid
    assert tiers(1) == ({64, 128} if wgmma else set()), mid
    # 100 rows x 1280 columns are 10 tiles of BM 128, far short of one wave of blocks: the
    # wave-filling candidate is the deepest split a 1024-deep layer allows (1024 / 128), which
    # the traffic-capped split model alone never reaches here.
    for engine in (0, 1) if wgmma else (0,):
        splits = {int(ln.split(" split=")[1].split()[0]) for ln in mid
                  if " path=0 " in ln and " bm=128 " in ln and f" wgmma={engine} " in ln}
        assert 8 in splits, (engine, mid)
    # The wgmma engine's 128-token tier also times its stream-k grid there (10 tiles, far short
    # of a wave); the mma.sync engine has none.
    streams = {(int(ln.split(" bm=")[1].split()[0]), int(ln.split(" stream=")[1].split()[0]))
               for ln in mid if " path=0 " in ln}
    assert any(bm == 128 and g > 0 for bm, g in streams) == wgmma, mid
    assert {ln.split(" early=")[1].split()[0] for ln in mid if " path=0 " in ln} == {"1"}, mid
    # 100 rows leave every classic grid of one k-split (at most 70 blocks) short of one block per
    # SM, and every tier holds two or more per SM: each is timed both unspread and spread.
    whole_k = [ln for ln in mid if " path=0 " in ln and " split=1 " in ln and " stream=0 " in ln]
    assert whole_k, mid
    for variant in (" spread=0", " spread=1"):
        assert ({ln.split(": ")[1].split(" early=")[0] for ln in whole_k if variant in ln}
                == {ln.split(": ")[1].split(" early=")[0] for ln in whole_k}), (variant, mid)
    call(8)
    small = [ln for ln in _timed_plans(capfd.readouterr().err, 8) if " path=0 " in ln]
    assert small, "no fused plan timed at m = 8"
    plans = {ln.split(": ")[1].split(" early=")[0] for ln in small}
    # Below 17 rows every fused plan is timed three ways: released early or late, and released
    # early with its blocks spread (Plan::spread); never late and spread.
    for variant in (" early=0 spread=0 ", " early=1 spread=0 ", " early=1 spread=1 "):
        assert {ln.split(": ")[1].split(" early=")[0] for ln in small
                if variant in ln} == plans, (variant, small)
    assert not [ln for ln in small if " early=0 spread=1 " in ln], small
    call(3000)  # bucket 4096, tuned above
    call(65)  # bucket 128, tuned above
    err = capfd.readouterr().err
    assert not _timed_plans(err, 3000) and not _timed_plans(err, 65), err


WORKSPACE_PROBE = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import verify_kernels as vk
vk.load_extension()
os.environ.update(VLLM_EXL3_BM="128", VLLM_EXL3_SPLIT_K="2", VLLM_EXL3_RECONSTRUCT_M="0")
gen = torch.Generator(device="cuda").manual_seed(0)
layer = vk.random_layer(gen, 1024, [16384], 4.0, 1)

def non_torch_bytes():
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()

def call(m):
    x = torch.randn(m, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    torch.ops._C.exl3_linear(x, layer.trellis, layer.suh, layer.svh, None, layer.widths,
                             layer.codebook)
    torch.cuda.synchronize()

call(1)  # cuBLAS handle, context, a first small workspace
base = non_torch_bytes()
for m in (2048, 4096, 8192):  # workspace m x 16384 fp32: 128, 256, 512 MiB
    call(m)
print("GROWN", non_torch_bytes() - base)
"""


def test_outgrown_workspace_is_freed_when_no_graph_holds_it(tmp_path) -> None:
    """Eager growth (the load-time warm-up's pattern) keeps only the newest split-k workspace:
    growing 128 -> 256 -> 512 MiB leaves ~512 MiB in use, not the 896 MiB of all three."""
    import subprocess
    script = tmp_path / "probe.py"
    script.write_text(WORKSPACE_PROBE)
    r = subprocess.run([sys.executable, str(script), str(REPO / "scripts" / "bench")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    grown = int(r.stdout.split("GROWN")[-1])
    assert 480 << 20 <= grown <= 600 << 20, f"workspace memory grew by {grown >> 20} MiB"
