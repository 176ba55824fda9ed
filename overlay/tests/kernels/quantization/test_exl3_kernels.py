# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of the EXL3 kernels: the oracle's checks (vllm_exl3.testing.exl3_oracle) as
pytest cases.

Needs a CUDA GPU and the extension: $VLLM_EXL3_EXT, build/exl3/_exl3_C.abi3.so (quick
build: `python -m vllm_exl3.kernels_build` from scripts/), or an installed vllm._exl3_C.
The oracle is the overlay's reference codec in float64; the error bounds and their
derivation are in the oracle's docstring. Also here: batch invariance, the split-k
workspace, the plan table's errors and reproducibility, and the fixture perplexity with
every linear run by the op (sections below).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_exl3.testing import exl3_oracle as vk
from vllm_exl3.testing.fixtures import QWEN3_TINY as FIXTURES
from vllm_exl3.testing.qwen3_tiny import (
    model_from_state_dict,
    perplexity,
    validation_windows,
)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

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


# Batch invariance of `_C::exl3_linear` (vLLM's VLLM_BATCH_INVARIANT=1 sets the table's
# FLAG_BATCH_INVARIANT): each row's output is bit-identical whether computed alone or
# inside a call of 2..4096 rows, for every bitrate and codebook, bf16 and fp16, with and
# without bias.

# Row counts crossing every BM tier and bucket boundary up to 4096.
M_VALUES = (
    2,
    3,
    15,
    16,
    17,
    31,
    33,
    63,
    64,
    65,
    100,
    127,
    128,
    129,
    255,
    256,
    257,
    511,
    512,
    513,
    1000,
    1024,
    1025,
    2047,
    2048,
    2049,
    4095,
    4096,
)
K = 512
WIDTHS = [256, 128]
INVARIANT = vk.header(batch_invariant=1)


@pytest.mark.parametrize("bits, codebook", vk.combos())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_do_not_depend_on_the_batch(
    bits: float, codebook: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator(device="cuda")
    gen.seed()
    layer = vk.random_layer(gen, K, WIDTHS, bits, codebook)
    x = torch.randn(max(M_VALUES), K, generator=gen, device="cuda").to(dtype)
    bias = (
        torch.randn(layer.n, generator=gen, device="cuda").to(dtype)
        if bits % 2
        else None
    )

    def op(rows: torch.Tensor) -> torch.Tensor:
        return vk.exl3_op(
            rows,
            layer.trellis,
            layer.suh,
            layer.svh,
            bias,
            layer.widths,
            layer.codebook,
            plans=INVARIANT,
        )

    alone = torch.cat([op(x[i : i + 1]) for i in range(x.shape[0])])
    assert bool(torch.isfinite(alone).all()), "non-finite output"
    for m in M_VALUES:
        y = op(x[:m])
        diff = (y != alone[:m]).any(dim=1).nonzero().flatten()
        assert diff.numel() == 0, (
            f"bits {bits} cb {codebook} {dtype} m = {m}: rows "
            f"{diff[:8].tolist()} differ from the same rows alone"
        )


def test_invariant_mode_refuses_other_plans() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = vk.random_layer(gen, K, [256], 4.0, 1)
    x = torch.randn(8, K, generator=gen, device="cuda").to(torch.bfloat16)
    split_entry = [8, 0, 16, 2, 0, 0, 1, 0]
    with pytest.raises(RuntimeError, match="batch-invariant mode admits only"):
        vk.exl3_op(
            x,
            layer.trellis,
            layer.suh,
            layer.svh,
            None,
            layer.widths,
            1,
            plans=INVARIANT + split_entry,
        )
    # The cost model keeps to the invariant engine whatever the pins ask for.
    for m in (1, 64, 4096):
        plan = torch.ops._C.exl3_plan(
            layer.trellis,
            1,
            1,
            True,
            m,
            vk.header(batch_invariant=1, reconstruct_m=1, wgmma=1, split_k=4),
            1 << 30,
        )
        assert plan[1] == 0 and plan[3] == 1 and plan[4] == 0 and plan[5] == 0, (
            m,
            plan,
        )


# The op's memory and plans on a GPU: the split-k workspace is a torch allocation (it
# shows in torch.cuda.memory_allocated, and the op allocates nothing outside torch's
# allocator), the plan table's errors, and two fresh processes resolve identical plans
# for every layer of the 4.0bpw fixture at every token-count bucket (exl3_oracle.py
# --log-plans).


def non_torch_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def test_workspace_is_a_torch_allocation() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = vk.random_layer(gen, 1024, [16384], 4.0, 1)
    split = vk.header(bm=128, split_k=2, reconstruct_m=0)
    m = 4096
    x = torch.randn(m, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ws = torch.zeros(m * layer.n, dtype=torch.float32, device="cuda")  # 256 MiB
    assert torch.cuda.memory_allocated() - before >= m * layer.n * 4
    # The op runs split-k through it and leaves it all zeros; outside torch's allocator
    # the process gains nothing (the cuBLAS path's workspace is torch's too).
    torch.ops._C.exl3_linear(
        x[:1], layer.trellis, layer.suh, layer.svh, None, layer.widths, 1, split, ws
    )  # context and first launches
    torch.ops._C.exl3_linear(
        x[:1],
        layer.trellis,
        layer.suh,
        layer.svh,
        None,
        layer.widths,
        1,
        vk.header(reconstruct_m=1),
        ws,
    )
    torch.cuda.synchronize()
    base = non_torch_bytes()
    plan = torch.ops._C.exl3_plan(layer.trellis, 1, 1, True, m, split, ws.numel())
    assert plan[3] == 2, plan
    y = torch.ops._C.exl3_linear(
        x, layer.trellis, layer.suh, layer.svh, None, layer.widths, 1, split, ws
    )
    y2 = torch.ops._C.exl3_linear(
        x,
        layer.trellis,
        layer.suh,
        layer.svh,
        None,
        layer.widths,
        1,
        vk.header(reconstruct_m=1),
        ws,
    )
    torch.cuda.synchronize()
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(y2).all())
    assert not ws.any(), "the finish kernel must leave the workspace zeroed"
    grown = non_torch_bytes() - base
    assert grown < 8 << 20, f"{grown >> 20} MiB allocated outside torch's allocator"


def test_too_small_workspace_runs_split_one() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    layer = vk.random_layer(gen, 1024, [1280], 4.0, 1)
    split = vk.header(bm=16, split_k=4, reconstruct_m=0)
    x = torch.randn(16, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    small = torch.zeros(16 * layer.n - 1, dtype=torch.float32, device="cuda")
    assert (
        torch.ops._C.exl3_plan(layer.trellis, 1, 1, True, 16, split, small.numel())[3]
        == 1
    )
    y = torch.ops._C.exl3_linear(
        x, layer.trellis, layer.suh, layer.svh, None, layer.widths, 1, split, small
    )
    ok, rel, mx = vk.within(y, vk.reference_y(x, layer, None))
    assert ok, (rel, mx)


@pytest.mark.parametrize(
    "plans, message",
    [
        ([2, 0, -1, 0, 0, -1, -1, -1, -1, 250], "plans version 2"),
        ([1, 8, -1, 0, 0, -1, -1, -1, -1, 250], "unknown plan flags"),
        ([1, 0, -1, 0, 0, -1, -1, -1, -1], "the header alone"),
        (vk.FREE_HEADER + [16, 3, 16, 1, 0, 0, 1, 0], "unknown path 3"),
        (vk.FREE_HEADER + [16, 0, 48, 1, 0, 0, 1, 0], "is not an mma.sync tier"),
        (vk.FREE_HEADER + [16, 0, 16, 64, 0, 0, 1, 0], "split_k 64 is outside"),
        (vk.FREE_HEADER + [16, 0, 64, 1, 0, 12, 1, 0], "stream-k is built only"),
        (vk.FREE_HEADER + [16, 0, 16, 1, 0, 0, 1], "not a multiple of 8"),
        (
            vk.FREE_HEADER + [16, 0, 16, 1, 0, 0, 1, 0, 8, 0, 16, 1, 0, 0, 1, 0],
            "above the previous",
        ),
        (vk.header(deterministic=1) + [16, 0, 16, 2, 0, 0, 1, 0], "deterministic mode"),
    ],
)
def test_plan_table_errors(plans: list[int], message: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    layer = vk.random_layer(gen, 1024, [256], 4.0, 1)
    x = torch.randn(4, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        vk.exl3_op(
            x, layer.trellis, layer.suh, layer.svh, None, layer.widths, 1, plans=plans
        )


def test_wgmma_entry_needs_the_engine() -> None:
    if vk.wgmma_engine():
        pytest.skip("this device has the wgmma engine")
    gen = torch.Generator(device="cuda").manual_seed(3)
    layer = vk.random_layer(gen, 1024, [256], 4.0, 1)
    x = torch.randn(64, 1024, generator=gen, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="sm_90a build"):
        vk.exl3_op(
            x,
            layer.trellis,
            layer.suh,
            layer.svh,
            None,
            layer.widths,
            1,
            plans=vk.FREE_HEADER + [64, 0, 64, 1, 1, 0, 1, 0],
        )


def test_two_processes_log_identical_plans(tmp_path) -> None:
    logs = []
    for i in range(2):
        r = subprocess.run(
            [sys.executable, "-m", "vllm_exl3.testing.exl3_oracle", "--log-plans"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        logs.append(r.stdout)
        (tmp_path / f"plans_{i}.log").write_text(r.stdout)
    lines = logs[0].splitlines()
    assert len(lines) > 100, logs[0][-2000:]
    assert logs[0] == logs[1], "two fresh processes resolved different plans"


# The fixture checkpoints through transformers' Qwen3 in bf16 with every EXL3 linear run
# by the op on the checkpoint's own trellis/suh/svh (no vLLM, so only the kernels stand
# between the format and the score): perplexity on the fixture windows, scored as the
# ExLlamaV3 1.6.5 values in tests/fixtures/README.md were, within the end-to-end limit;
# and one fused q/k/v call (3 shards) agrees with the three separate calls.

# ExLlamaV3 1.6.5's perplexities on the same windows (tests/fixtures/README.md).
RECORDED_PPL = {"exl3-4.0bpw": 6.5847, "exl3-3.0bpw-mcg": 7.0024}
# The limit the end-to-end runs through vLLM are held to (scripts/e2e/README.md).
PPL_TOLERANCE = 3e-3
# Windows per forward pass.
PPL_BATCH = 40


class Exl3OpLinear(torch.nn.Module):
    """A linear of the model run by `_C::exl3_linear` on one module's tensors."""

    def __init__(self, w) -> None:
        super().__init__()
        self.trellis = w.trellis.cuda()
        self.suh = w.suh.cuda().view(1, -1)
        self.svh = w.svh.cuda()
        self.n = self.svh.numel()
        self.codebook = int(w.codebook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = vk.exl3_op(
            x.reshape(-1, shape[-1]).contiguous(),
            self.trellis,
            self.suh,
            self.svh,
            None,
            [self.n],
            self.codebook,
        )
        return y.view(*shape[:-1], self.n)


def _op_model(ckpt: Path):
    """The fixture model in bf16 on the GPU with every EXL3 linear an Exl3OpLinear, and
    the modules' weights by prefix."""
    from vllm_exl3.codec import exl3_format as fmt

    index = fmt.read_safetensors_index(ckpt)
    specs = fmt.find_exl3_modules(index)
    owned = {n for s in specs.values() for n in s.tensor_names}
    state = {n: fmt.read_tensor(ckpt, n, e) for n, e in index.items() if n not in owned}
    weights = {p: fmt.load_module(ckpt, s, index=index) for p, s in specs.items()}
    # Placeholders so the model builds; every one is replaced by the op module below.
    for p, w in weights.items():
        state[f"{p}.weight"] = torch.zeros(w.svh.numel(), w.suh.numel())
    model = model_from_state_dict(ckpt / "config.json", state)
    model = model.to(torch.bfloat16).cuda().eval()
    for p, w in weights.items():
        parent, _, leaf = p.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Exl3OpLinear(w))
    return model, weights


@pytest.mark.parametrize("name", sorted(RECORDED_PPL))
def test_fixture_perplexity_through_the_op(name: str) -> None:
    model, weights = _op_model(FIXTURES / name)
    ppl = perplexity(model, validation_windows(), device="cuda", batch_size=PPL_BATCH)
    rel = ppl / RECORDED_PPL[name] - 1
    assert abs(rel) <= PPL_TOLERANCE, (name, ppl, RECORDED_PPL[name], rel)

    # One fused q/k/v call (3 shards, the trellises concatenated along n) against the
    # three separate calls: each is within the oracle's bound of the reference, so they
    # are within twice it of each other; a shard's columns in the wrong place are O(1).
    parts = [weights[f"model.layers.0.self_attn.{x}_proj"] for x in "qkv"]
    x = torch.randn(37, parts[0].suh.numel(), device="cuda", dtype=torch.bfloat16)
    fused = vk.exl3_op(
        x,
        torch.cat([p.trellis for p in parts], 1).cuda(),
        torch.stack([p.suh for p in parts]).cuda(),
        torch.cat([p.svh for p in parts]).cuda(),
        None,
        [p.svh.numel() for p in parts],
        int(parts[0].codebook),
    ).float()
    separate = torch.cat([Exl3OpLinear(p)(x) for p in parts], 1).float()
    _, max_rel = vk.TOLERANCE[torch.bfloat16]
    rms = separate.pow(2).mean().sqrt()
    assert torch.isfinite(fused).all()
    assert (fused - separate).abs().max() <= 2 * max_rel * rms
