# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of the EXL3 MoE op (torch.ops._C.exl3_moe) against a float64 reference.

Needs a CUDA GPU and the extension (build/exl3/_exl3_C.abi3.so from
`cd scripts && python3 -m vllm_exl3.kernels_build --out ../build/exl3 --arch 9.0`, or
$VLLM_EXL3_EXT, or an installed vllm._exl3_C). The oracle (scripts/bench/moe_layers.py)
decodes every expert with the overlay codec in float64, routes, applies SiLU(gate) * up,
the down projection and the routing weights, and sums each token's top-k. Every case
draws fresh random weights and routings, leaves a NaN-filled block for the output to
reuse, and fails on any non-finite output.

Error bound. Against the dense op (test_exl3_kernels.py: fused path 3e-4 fp16 /
1.7e-3 bf16, relative RMS) the layer adds three roundings: the gate/up outputs to the
activation dtype, the SwiGLU product to fp16 after its Hadamard (the down GEMM's
operand), and, in the deterministic combine, each (token, k) row to the activation dtype
before the fp32 sum. SiLU's slope is below 1.1, so each rounding passes through at most
about its own size; summed in quadrature the layer's expected relative Frobenius error
is ~4e-4 (fp16) / ~3.5e-3 (bf16). Bounds: rel_fro <= 2e-3 (fp16), 1e-2 (bf16); max |err|
/ rms(ref) <= 1.5e-2 (fp16), 1e-1 (bf16). A wrong expert, role, block, sign or routing
weight gives O(1) errors.

    pytest -q tests/kernels/quantization/test_exl3_moe_kernels.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vllm_exl3.bench import moe_layers as ml  # noqa: E402
from vllm_exl3.testing import exl3_oracle as vk  # noqa: E402

try:
    vk.load_extension()
except (
    ImportError,
    OSError,
    RuntimeError,
) as e:  # pragma: no cover - depends on the host
    pytest.skip(f"EXL3 extension not available: {e}", allow_module_level=True)
if not hasattr(torch.ops._C, "exl3_moe"):
    pytest.skip(
        "the EXL3 extension has no exl3_moe op (an older build)",
        allow_module_level=True,
    )

TOLERANCE = {torch.float16: (2e-3, 1.5e-2), torch.bfloat16: (1e-2, 1e-1)}
BLOCKS = (16, 32, 64, 128)
# The block sizes also built on Hopper's wgmma (exl3_moe.h kMoeWgmmaTiers); the op runs
# them there unless told otherwise (wgmma = -1), and wgmma = 1 forces it.
WGMMA_BLOCKS = (64, 128)
# Asked of the dense op (the same test of the loaded image as the MoE op's): compute
# capability 9.0 and this build's sm_90a image.
WGMMA_DEVICE = vk.wgmma_engine()
needs_wgmma = pytest.mark.skipif(
    not WGMMA_DEVICE, reason="no wgmma engine here (sm_90a image on a 9.0 device)"
)
RATES = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
HALF_RATES = (1.5, 2.5, 3.5)
COMBOS = [(b, cb) for b in RATES for cb in (0, 1, 2) if b not in HALF_RATES or cb == 2]


@pytest.fixture
def gen() -> torch.Generator:
    g = torch.Generator(device="cuda")
    g.seed()  # fresh random inputs every run
    return g


def activations(
    gen: torch.Generator, m: int, h: int, dtype: torch.dtype
) -> torch.Tensor:
    # Unit-RMS gate/up outputs: the sums over h of unit-variance weights are scaled
    # back.
    return (torch.randn(m, h, generator=gen, device="cuda") / math.sqrt(h)).to(dtype)


def check(y: torch.Tensor, ref: torch.Tensor, **info: object) -> None:
    rel, mx = vk.errors(y, ref)
    tol_rel, tol_max = TOLERANCE[y.dtype]
    assert rel <= tol_rel and mx <= tol_max, dict(rel=rel, max=mx, **info)


def run_checked(
    gen: torch.Generator,
    layer: ml.MoeLayer,
    m: int,
    top_k: int,
    global_experts: int,
    dtype: torch.dtype,
    block: int,
    deterministic: bool,
    expert_map: torch.Tensor | None = None,
    only: int | None = None,
    weight_on_input: bool = False,
    ids_dtype: torch.dtype = torch.int32,
    splits: tuple[int, int] = (1, 1),
    drop_nonlocal: bool = True,
    wgmma: int = -1,
    pairs: bool = False,
    **info: object,
) -> torch.Tensor:
    x = activations(gen, m, layer.hidden, dtype)
    w, ids = ml.random_routing(
        gen, m, top_k, global_experts, ids_dtype=ids_dtype, only=only
    )
    ref = ml.reference_moe(
        x, w, ids, layer, expert_map, global_experts, weight_on_input
    )
    if pairs:
        aligned = None
        poison_layout(m, top_k)
    else:
        aligned = ml.align(ids, block, global_experts, expert_map, drop_nonlocal)
    vk.poison_next((m, layer.hidden), dtype)
    y = ml.run_op(
        x,
        w,
        ids,
        layer,
        block,
        global_experts,
        expert_map,
        deterministic,
        weight_on_input,
        aligned=aligned,
        splits=splits,
        wgmma=wgmma,
        pairs=pairs,
    )
    check(
        y,
        ref,
        m=m,
        top_k=top_k,
        block=block,
        dtype=str(dtype),
        deterministic=deterministic,
        splits=splits,
        wgmma=wgmma,
        pairs=pairs,
        **info,
    )
    return y


# The pairs layout's block (moe_ops.PAIRS_BLOCK_SIZE) and an int32 value that is no
# pair and no expert: the op's layout scratch is left filled with it before a call, so
# an entry the input transform did not write drops or misroutes a row.
PAIRS_BLOCK = 16
LAYOUT_GARBAGE = 1 << 30


def poison_layout(m: int, top_k: int) -> None:
    """Leave a garbage-filled block the size of the pairs layout's int32 arrays
    (sorted ids, expert ids, live count) in torch's cache for the op to reuse."""
    pairs = m * top_k
    t = torch.full(
        (pairs * PAIRS_BLOCK + pairs + 1,),
        LAYOUT_GARBAGE,
        dtype=torch.int32,
        device="cuda",
    )
    del t


def test_nan_never_passes() -> None:
    ref = torch.randn(4, 128, dtype=torch.float64, device="cuda")
    for bad in (float("nan"), float("inf")):
        y = ref.to(torch.bfloat16).clone()
        y[1, 7] = bad
        with pytest.raises(AssertionError):
            check(y, ref)


# Per engine (the op's choice, wgmma = -1, which is mma.sync below 64 rows and
# Hopper's wgmma from there; wgmma forced, = 1): the expert width and the (block,
# dtype, deterministic, tokens) cases of test_every_rate_and_codebook, and the expert
# width, tokens and blocks of test_mixed_bitrates_in_one_layer.
EVERY_RATE_CASES = {
    -1: (
        256,
        [
            (16, torch.float16, True, 5),
            (32, torch.bfloat16, False, 37),
            (64, torch.bfloat16, True, 200),
            (128, torch.float16, True, 300),
        ],
    ),
    1: (
        384,
        [
            (64, torch.float16, True, 70),
            (64, torch.bfloat16, False, 200),
            (128, torch.bfloat16, True, 300),
            (128, torch.float16, False, 700),
        ],
    ),
}
MIXED_RATE_CASES = {-1: (256, 77), 1: (640, 300)}
ENGINES = (-1, pytest.param(1, marks=needs_wgmma, id="wgmma"))
ENGINE_BLOCKS = [(-1, b) for b in BLOCKS] + [
    pytest.param(1, b, marks=needs_wgmma, id=f"wgmma-{b}") for b in WGMMA_BLOCKS
]


@pytest.mark.parametrize("wgmma", ENGINES)
@pytest.mark.parametrize("bits,codebook", COMBOS)
def test_every_rate_and_codebook(
    gen: torch.Generator, bits: float, codebook: int, wgmma: int
) -> None:
    width, cases = EVERY_RATE_CASES[wgmma]
    layer = ml.random_moe_layer(gen, 8, 256, width, [bits], codebook)
    for block, dtype, det, m in cases:
        run_checked(
            gen,
            layer,
            m,
            2,
            8,
            dtype,
            block,
            det,
            wgmma=wgmma,
            bits=bits,
            codebook=codebook,
        )


@pytest.mark.parametrize(
    "codebook,bits", [(1, (2, 3, 4, 5)), (2, (1.5, 2.5, 3.5, 4, 8)), (0, (1, 6, 7, 8))]
)
@pytest.mark.parametrize("wgmma,block", ENGINE_BLOCKS)
def test_mixed_bitrates_in_one_layer(
    gen: torch.Generator, codebook: int, bits: tuple[float, ...], wgmma: int, block: int
) -> None:
    """Every (expert, role) draws its own rate: gate, up and down of one expert
    differ; one launch per rate, each block on its own expert's trellis, svh and
    rate (mma.sync or wgmma alike).
    """
    width, m = MIXED_RATE_CASES[wgmma]
    layer = ml.random_moe_layer(gen, 16, 384, width, bits, codebook)
    assert len(layer.k2s[0]) > 1 and len(layer.k2s[1]) > 1, layer.k2s
    for det in (True, False):
        run_checked(
            gen, layer, m, 4, 16, torch.bfloat16, block, det, wgmma=wgmma, bits=bits
        )


@pytest.mark.parametrize(
    "experts,top_k,m",
    [
        (8, 1, 1),
        (8, 8, 3),
        (16, 2, 8192),
        (64, 4, 100),
        (128, 8, 1),
        (128, 8, 1024),
        (256, 8, 16),
        (512, 8, 64),
        (512, 2, 4096),
        (32, 6, 2000),
    ],
)
def test_routings(gen: torch.Generator, experts: int, top_k: int, m: int) -> None:
    layer = ml.random_moe_layer(gen, experts, 256, 128, [2, 4], 1)
    for block in BLOCKS:
        run_checked(
            gen,
            layer,
            m,
            top_k,
            experts,
            torch.bfloat16,
            block,
            block == 16,
            experts=experts,
        )


@pytest.mark.parametrize("block", BLOCKS)
def test_all_tokens_to_one_expert_and_empty_experts(
    gen: torch.Generator, block: int
) -> None:
    layer = ml.random_moe_layer(gen, 32, 256, 256, [3], 1)
    for m, top_k in ((1, 1), (300, 1), (300, 4)):
        run_checked(gen, layer, m, top_k, 32, torch.float16, block, True, only=5)
        run_checked(gen, layer, m, top_k, 32, torch.float16, block, False, only=31)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("drop_nonlocal", (True, False))
def test_expert_parallel_map(
    gen: torch.Generator, block: int, drop_nonlocal: bool
) -> None:
    """Rank 1 of 3: 10 of 30 global experts local; the others contribute nothing,
    whether the alignment leaves them out or places them in -1 blocks."""
    global_experts, local = 30, 10
    emap = torch.full((global_experts,), -1, dtype=torch.int32)
    owned = torch.randperm(
        global_experts,
        generator=torch.Generator().manual_seed(
            int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device="cuda"))
        ),
    )[:local]
    emap[owned] = torch.arange(local, dtype=torch.int32)
    emap = emap.cuda()
    layer = ml.random_moe_layer(gen, local, 256, 128, [2, 3, 4], 1)
    for det in (True, False):
        x = activations(gen, 200, 256, torch.bfloat16)
        w, ids = ml.random_routing(gen, 200, 6, global_experts, ids_dtype=torch.int64)
        ref = ml.reference_moe(x, w, ids, layer, emap, global_experts)
        aligned = ml.align(
            ids, block, global_experts, emap, drop_nonlocal=drop_nonlocal
        )
        vk.poison_next((200, 256), torch.bfloat16)
        y = ml.run_op(
            x, w, ids, layer, block, global_experts, emap, det, aligned=aligned
        )
        check(y, ref, det=det)


def test_router_weight_on_input(gen: torch.Generator) -> None:
    layer = ml.random_moe_layer(gen, 8, 256, 256, [4], 2)
    for det in (True, False):
        run_checked(gen, layer, 50, 1, 8, torch.bfloat16, 16, det, weight_on_input=True)


def test_real_shape_qwen3_30b_a3b(gen: torch.Generator) -> None:
    """One Qwen3-30B-A3B layer (hidden 2048, expert width 768, 128 experts, top-8) at 4
    bits, unsplit (what the few-token rule picks for it on an H200) and with forced
    k-splits: 5 / 4, 2 / 2, 16 / 6 (two stages a split) and 2 / 3."""
    layer = ml.random_moe_layer(gen, 128, 2048, 768, [4], 1, gap=False)
    for m, block in ((1, 16), (16, 16), (256, 64)):
        run_checked(gen, layer, m, 8, 128, torch.bfloat16, block, True)
    for m, splits in ((1, (5, 4)), (2, (2, 2)), (1, (16, 6)), (16, (2, 3))):
        for det in (True, False):
            run_checked(gen, layer, m, 8, 128, torch.bfloat16, 16, det, splits=splits)


@pytest.mark.parametrize("splits", ((1, 1), (2, 2)))
def test_a_launched_rate_no_expert_has(
    gen: torch.Generator, splits: tuple[int, int]
) -> None:
    """Rates launched before and after the layer's own, none of whose blocks has work:
    such a grid has one block wait for the grid before it (the others return at once),
    so the grid after it still sees the input transform's (or the SwiGLU transform's)
    rows. Repeated, with a long input transform, so an early read would show."""
    import dataclasses

    layer = ml.random_moe_layer(gen, 64, 1024, 512, [4], 1)
    k13, k2 = layer.k2s
    padded = dataclasses.replace(layer, k2s=([2, *k13, 16], [2, *k2, 16]))
    for _ in range(5):
        for m in (1, 16, 512):
            for det in (True, False):
                block = 16 if m <= 16 else 64
                run_checked(
                    gen,
                    padded,
                    m,
                    8,
                    64,
                    torch.bfloat16,
                    block,
                    det,
                    splits=splits if block == 16 else (1, 1),
                )


# Few-token decode: the grouped GEMMs' k split (gate/up, down), each split's fp32
# partial rows summed in order by the SwiGLU transform and the combine. Hidden 384 and
# width 256 give 6 and 4 stages of k: even shares, uneven ones (6 / 4, 4 / 3) and one
# stage per split; (1, 1) is the unsplit kernel on the same inputs.
SPLIT_HIDDEN, SPLIT_WIDTH = 384, 256
FORCED_SPLITS = ((1, 1), (2, 1), (1, 2), (4, 3), (6, 4))
SPLIT_BLOCKS = (16, 32)


@pytest.mark.parametrize("experts", (8, 64, 512))
@pytest.mark.parametrize("top_k", (1, 8))
@pytest.mark.parametrize("m", (1, 2, 4, 8, 16))
def test_few_tokens_split_k(
    gen: torch.Generator, m: int, top_k: int, experts: int
) -> None:
    """Every forced split against the float64 oracle, both modes, both split tiers, on
    a mixed-rate layer; the workspace starts NaN, so a partial row read before it was
    written fails."""
    layer = ml.random_moe_layer(gen, experts, SPLIT_HIDDEN, SPLIT_WIDTH, [2, 3, 4], 1)
    x = activations(gen, m, SPLIT_HIDDEN, torch.bfloat16)
    w, ids = ml.random_routing(gen, m, top_k, experts)
    ref = ml.reference_moe(x, w, ids, layer, None, experts)
    for block in SPLIT_BLOCKS:
        aligned = ml.align(ids, block, experts)
        for i, splits in enumerate(FORCED_SPLITS):
            for det in (True, False):
                vk.poison_next((m, SPLIT_HIDDEN), torch.bfloat16)
                y = ml.run_op(
                    x,
                    w,
                    ids,
                    layer,
                    block,
                    experts,
                    None,
                    det,
                    aligned=aligned,
                    splits=splits,
                )
                check(y, ref, m=m, top_k=top_k, block=block, splits=splits, det=det)


@pytest.mark.parametrize(
    "codebook,bits", [(1, (2, 3, 4, 5)), (2, (1.5, 2.5, 3.5, 4, 8)), (0, (1, 6, 7, 8))]
)
def test_split_k_mixed_bitrates(
    gen: torch.Generator, codebook: int, bits: tuple[float, ...]
) -> None:
    """Every (expert, role) with its own rate: one launch per rate, each split of each
    launch writing only its own experts' partial rows."""
    layer = ml.random_moe_layer(gen, 16, SPLIT_HIDDEN, SPLIT_WIDTH, bits, codebook)
    assert len(layer.k2s[0]) > 1 and len(layer.k2s[1]) > 1, layer.k2s
    for m, splits in ((1, (6, 4)), (3, (4, 3)), (16, (2, 2))):
        for block in SPLIT_BLOCKS:
            run_checked(
                gen, layer, m, 4, 16, torch.float16, block, m != 3, splits=splits
            )


@pytest.mark.parametrize("drop_nonlocal", (True, False))
def test_split_k_expert_parallel_map(gen: torch.Generator, drop_nonlocal: bool) -> None:
    """Rank 1 of 3 (10 of 30 experts local): pairs of the other ranks' experts, left
    out of the alignment or placed in -1 blocks, have no partial rows and add
    nothing."""
    global_experts, local = 30, 10
    emap = torch.full((global_experts,), -1, dtype=torch.int32)
    emap[1::3] = torch.arange(local, dtype=torch.int32)
    emap = emap.cuda()
    layer = ml.random_moe_layer(gen, local, SPLIT_HIDDEN, SPLIT_WIDTH, [2, 4], 1)
    for m, top_k in ((1, 8), (5, 6), (16, 2)):
        for det in (True, False):
            run_checked(
                gen,
                layer,
                m,
                top_k,
                global_experts,
                torch.bfloat16,
                16,
                det,
                expert_map=emap,
                splits=(3, 2),
                drop_nonlocal=drop_nonlocal,
            )


def test_split_k_router_weight_on_input(gen: torch.Generator) -> None:
    layer = ml.random_moe_layer(gen, 8, 256, 256, [4], 2)
    for det in (True, False):
        run_checked(
            gen,
            layer,
            2,
            2,
            8,
            torch.bfloat16,
            16,
            det,
            weight_on_input=True,
            splits=(2, 4),
        )


def test_split_k_deterministic_bit_exact(gen: torch.Generator) -> None:
    """Deterministic mode with split GEMMs: the same bits on every run (no atomics: the
    splits are summed in order)."""
    layer = ml.random_moe_layer(gen, 64, SPLIT_HIDDEN, SPLIT_WIDTH, [2, 3, 4], 1)
    for m in (1, 4, 16):
        x = activations(gen, m, SPLIT_HIDDEN, torch.bfloat16)
        w, ids = ml.random_routing(gen, m, 8, 64)
        for splits in ((4, 3), (6, 1), (1, 4)):
            aligned = ml.align(ids, 16, 64)
            first = ml.run_op(x, w, ids, layer, 16, 64, aligned=aligned, splits=splits)
            for _ in range(5):
                again = ml.run_op(
                    x, w, ids, layer, 16, 64, aligned=aligned, splits=splits
                )
                assert torch.equal(first.view(torch.int16), again.view(torch.int16))


@pytest.mark.parametrize("deterministic", (True, False))
def test_split_k_cuda_graph_replay_equals_eager(
    gen: torch.Generator, deterministic: bool
) -> None:
    """A captured split call replays the same splits (host arguments) on new inputs; the
    workspace comes from the graph's pool."""
    layer = ml.random_moe_layer(gen, 32, SPLIT_HIDDEN, SPLIT_WIDTH, [2, 4], 1)
    m, top_k, splits = 3, 4, (4, 3)
    x = activations(gen, m, SPLIT_HIDDEN, torch.bfloat16)
    w, ids = ml.random_routing(gen, m, top_k, 32)
    aligned = ml.align(ids, 16, 32)

    def call() -> torch.Tensor:
        return ml.run_op(
            x,
            w,
            ids,
            layer,
            16,
            32,
            deterministic=deterministic,
            aligned=aligned,
            splits=splits,
        )

    call()  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = call()
    for _ in range(3):
        x.copy_(activations(gen, m, SPLIT_HIDDEN, torch.bfloat16))
        graph.replay()
        eager = call()
        # Both modes sum a split down projection's partial rows in order.
        assert torch.equal(y_graph.view(torch.int16), eager.view(torch.int16))
        check(y_graph, ml.reference_moe(x, w, ids, layer, None, 32))


def test_split_k_propagates_nan(gen: torch.Generator) -> None:
    """A NaN in one token's input reaches that token's output through the split
    partial sums and leaves the other tokens finite."""
    layer = ml.random_moe_layer(gen, 8, SPLIT_HIDDEN, SPLIT_WIDTH, [4], 1)
    x = activations(gen, 3, SPLIT_HIDDEN, torch.bfloat16)
    x[1, 5] = float("nan")
    w, ids = ml.random_routing(gen, 3, 2, 8)
    for splits in ((1, 1), (4, 3)):
        for det in (True, False):
            y = ml.run_op(x, w, ids, layer, 16, 8, None, det, splits=splits)
            assert bool(torch.isnan(y[1]).any()), (splits, det)
            assert bool(torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all())


def test_deterministic_mode_bit_exact(gen: torch.Generator) -> None:
    layer = ml.random_moe_layer(gen, 64, 512, 256, [2, 3, 4], 1)
    x = activations(gen, 500, 512, torch.bfloat16)
    w, ids = ml.random_routing(gen, 500, 8, 64)
    for block in BLOCKS:
        aligned = ml.align(ids, block, 64)
        first = ml.run_op(x, w, ids, layer, block, 64, aligned=aligned)
        for _ in range(5):
            again = ml.run_op(x, w, ids, layer, block, 64, aligned=aligned)
            assert torch.equal(first.view(torch.int16), again.view(torch.int16))


@pytest.mark.parametrize("deterministic", (True, False))
def test_cuda_graph_replay_equals_eager(
    gen: torch.Generator, deterministic: bool
) -> None:
    layer = ml.random_moe_layer(gen, 32, 256, 256, [2, 4], 1)
    m, top_k = 48, 4
    x = activations(gen, m, 256, torch.bfloat16)
    w, ids = ml.random_routing(gen, m, top_k, 32)
    aligned = ml.align(ids, 16, 32)
    ml.run_op(
        x, w, ids, layer, 16, 32, deterministic=deterministic, aligned=aligned
    )  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = ml.run_op(
            x, w, ids, layer, 16, 32, deterministic=deterministic, aligned=aligned
        )
    for _ in range(3):
        x.copy_(activations(gen, m, 256, torch.bfloat16))
        graph.replay()
        eager = ml.run_op(
            x, w, ids, layer, 16, 32, deterministic=deterministic, aligned=aligned
        )
        if deterministic:
            assert torch.equal(y_graph.view(torch.int16), eager.view(torch.int16))
        else:
            check(y_graph, eager.double())
        check(y_graph, ml.reference_moe(x, w, ids, layer, None, 32))


# Hopper's wgmma engine (the unsplit 64- and 128-row tiers), forced (wgmma = 1): the
# same cases as mma.sync above, against the same float64 oracle and bounds (wgmma sums
# the same fp16 products in fp32).


@needs_wgmma
@pytest.mark.parametrize("block", WGMMA_BLOCKS)
def test_wgmma_all_tokens_to_one_expert_and_empty_experts(
    gen: torch.Generator, block: int
) -> None:
    layer = ml.random_moe_layer(gen, 32, 256, 256, [3], 1)
    for m, top_k in ((1, 1), (300, 1), (300, 4)):
        run_checked(
            gen, layer, m, top_k, 32, torch.float16, block, True, only=5, wgmma=1
        )
        run_checked(
            gen, layer, m, top_k, 32, torch.float16, block, False, only=31, wgmma=1
        )


@needs_wgmma
@pytest.mark.parametrize("block", WGMMA_BLOCKS)
@pytest.mark.parametrize("drop_nonlocal", (True, False))
def test_wgmma_expert_parallel_map(
    gen: torch.Generator, block: int, drop_nonlocal: bool
) -> None:
    """Rank 1 of 3 (10 of 30 experts local): -1 blocks return at once, their rows of
    the transformed buffer (never written) are never read."""
    global_experts, local = 30, 10
    emap = torch.full((global_experts,), -1, dtype=torch.int32)
    emap[1::3] = torch.arange(local, dtype=torch.int32)
    emap = emap.cuda()
    layer = ml.random_moe_layer(gen, local, 256, 128, [2, 3, 4], 1)
    for det in (True, False):
        run_checked(
            gen,
            layer,
            200,
            6,
            global_experts,
            torch.bfloat16,
            block,
            det,
            expert_map=emap,
            ids_dtype=torch.int64,
            drop_nonlocal=drop_nonlocal,
            wgmma=1,
        )


@needs_wgmma
def test_wgmma_real_shape_qwen3_30b_a3b(gen: torch.Generator) -> None:
    """One Qwen3-30B-A3B layer (hidden 2048, expert width 768: 32 and 12 stages of k) at
    4 bits, at the token counts whose blocks the rule makes 64 and 128 rows."""
    layer = ml.random_moe_layer(gen, 128, 2048, 768, [4], 1, gap=False)
    for m, block in ((1024, 64), (2048, 128)):
        for det in (True, False):
            run_checked(gen, layer, m, 8, 128, torch.bfloat16, block, det, wgmma=1)


@needs_wgmma
def test_wgmma_deterministic_mode_bit_exact(gen: torch.Generator) -> None:
    layer = ml.random_moe_layer(gen, 64, 512, 256, [2, 3, 4], 1)
    x = activations(gen, 500, 512, torch.bfloat16)
    w, ids = ml.random_routing(gen, 500, 8, 64)
    for block in WGMMA_BLOCKS:
        aligned = ml.align(ids, block, 64)
        first = ml.run_op(x, w, ids, layer, block, 64, aligned=aligned, wgmma=1)
        for _ in range(5):
            again = ml.run_op(x, w, ids, layer, block, 64, aligned=aligned, wgmma=1)
            assert torch.equal(first.view(torch.int16), again.view(torch.int16))


@needs_wgmma
@pytest.mark.parametrize("deterministic", (True, False))
def test_wgmma_cuda_graph_replay_equals_eager(
    gen: torch.Generator, deterministic: bool
) -> None:
    """A captured call replays with the tensor maps encoded at capture (the buffers
    come from the graph's pool) on new inputs."""
    layer = ml.random_moe_layer(gen, 32, 256, 256, [2, 4], 1)
    m, top_k = 400, 4
    x = activations(gen, m, 256, torch.bfloat16)
    w, ids = ml.random_routing(gen, m, top_k, 32)
    aligned = ml.align(ids, 64, 32)

    def call() -> torch.Tensor:
        return ml.run_op(
            x,
            w,
            ids,
            layer,
            64,
            32,
            deterministic=deterministic,
            aligned=aligned,
            wgmma=1,
        )

    call()  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = call()
    for _ in range(3):
        x.copy_(activations(gen, m, 256, torch.bfloat16))
        graph.replay()
        eager = call()
        if deterministic:
            assert torch.equal(y_graph.view(torch.int16), eager.view(torch.int16))
        else:
            check(y_graph, eager.double())
        check(y_graph, ml.reference_moe(x, w, ids, layer, None, 32))


@needs_wgmma
def test_wgmma_propagates_nan_to_its_token_only(gen: torch.Generator) -> None:
    """A NaN in one token's input reaches that token's output and no other: a wgmma
    column is one token, and the TMA box of a block holds only its own rows."""
    layer = ml.random_moe_layer(gen, 8, 256, 256, [4], 1)
    m, bad = 300, 7
    x = activations(gen, m, 256, torch.bfloat16)
    x[bad, 5] = float("nan")
    w, ids = ml.random_routing(gen, m, 2, 8)
    others = torch.arange(m, device="cuda") != bad
    for block in WGMMA_BLOCKS:
        for det in (True, False):
            y = ml.run_op(x, w, ids, layer, block, 8, None, det, wgmma=1)
            assert bool(torch.isnan(y[bad]).any()), (block, det)
            assert bool(torch.isfinite(y[others]).all()), (block, det)


def test_engine_choice_launches_the_named_kernels(gen: torch.Generator) -> None:
    """Which kernel runs the grouped GEMMs (torch.profiler): the op's own choice (-1)
    is wgmma from 64-row blocks on compute capability 9.0 and mma.sync for 16 and 32
    rows and on every other device; 0 is mma.sync everywhere. Both engines agree
    within the oracle's bounds."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    layer = ml.random_moe_layer(gen, 8, 256, 256, [4], 1)
    m = 300
    x = activations(gen, m, 256, torch.bfloat16)
    w, ids = ml.random_routing(gen, m, 2, 8)

    def kernels(block: int, wgmma: int) -> tuple[int, int, torch.Tensor]:
        """(wgmma launches, mma.sync launches, output) of one call."""
        aligned = ml.align(ids, block, 8)
        ml.run_op(x, w, ids, layer, block, 8, aligned=aligned, wgmma=wgmma)  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y = ml.run_op(x, w, ids, layer, block, 8, aligned=aligned, wgmma=wgmma)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
        return (
            sum("exl3_moe_wgmma_kernel" in n for n in names),
            sum("exl3_moe_gemm_kernel" in n for n in names),
            y,
        )

    # One rate: one gate/up and one down launch per call.
    for block in BLOCKS:
        wg, mma, y = kernels(block, -1)
        hopper_tier = WGMMA_DEVICE and block in WGMMA_BLOCKS
        assert (wg, mma) == ((2, 0) if hopper_tier else (0, 2)), (block, wg, mma)
        wg, mma, y_mma = kernels(block, 0)
        assert (wg, mma) == (0, 2), (block, wg, mma)
        check(y, y_mma.double(), block=block)
    if WGMMA_DEVICE:
        for block in WGMMA_BLOCKS:
            wg, mma, _ = kernels(block, 1)
            assert (wg, mma) == (2, 0), (block, wg, mma)


def test_through_the_kernel_class_and_vllm_alignment(gen: torch.Generator) -> None:
    """CudaExl3MoEKernel.apply: vLLM's moe_align_block_size, the block-size rule, the
    rate table read once, expert_map; needs vLLM (with the overlay) importable."""
    try:
        from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
            CudaExl3MoEKernel,
            Exl3MoEWeights,
        )
        from vllm.model_executor.layers.quantization.exl3.moe_plans import (
            Exl3MoEOverrides,
            block_size,
        )

        align = "vllm.model_executor.layers.fused_moe.moe_align_block_size"
        if importlib.util.find_spec(align) is None:
            raise ImportError(f"no {align}")
    except ImportError as e:
        pytest.skip(f"vLLM with the EXL3 overlay is not importable: {e}")
    layer = ml.random_moe_layer(gen, 16, 256, 256, [2, 3.5, 4], 2)
    weights = Exl3MoEWeights(*layer.tensors(), num_experts=16, hidden=256, width=256)
    emap = torch.arange(16, dtype=torch.int32, device="cuda")
    for m, force in (
        (1, None),
        (1, (1, 1)),
        (1, (4, 3)),
        (2, (2, 4)),
        (7, None),
        (600, None),
    ):
        kernel = CudaExl3MoEKernel(Exl3MoEOverrides(splits=force))
        for det, expert_map in ((True, None), (False, emap)):
            x = activations(gen, m, 256, torch.float16)
            w, ids = ml.random_routing(gen, m, 4, 16)
            ref = ml.reference_moe(x, w, ids, layer, None, 16)
            vk.poison_next((m, 256), torch.float16)
            y = kernel.apply(
                x,
                w,
                ids,
                weights,
                activation="silu",
                apply_router_weight_on_input=False,
                expert_map=expert_map,
                global_num_experts=16,
                codebook=2,
                deterministic=det,
            )
            check(y, ref, m=m, det=det, force=force)
    # The engine override at a 64-row block (200 x 4 routed rows over 16 experts).
    for force_wgmma in (False, True) if WGMMA_DEVICE else (False,):
        kernel = CudaExl3MoEKernel(Exl3MoEOverrides(wgmma=force_wgmma))
        x = activations(gen, 200, 256, torch.float16)
        w, ids = ml.random_routing(gen, 200, 4, 16)
        assert block_size(200, 4, 16) == 64
        vk.poison_next((200, 256), torch.float16)
        y = kernel.apply(
            x,
            w,
            ids,
            weights,
            activation="silu",
            apply_router_weight_on_input=False,
            expert_map=None,
            global_num_experts=16,
            codebook=2,
            deterministic=True,
        )
        check(y, ml.reference_moe(x, w, ids, layer, None, 16), wgmma=force_wgmma)


# The pairs layout (few tokens): no alignment passed, each routed pair in a 16-row block
# of its own that the op's input transform lays out (exl3_moe.h MoePairsLayout). Forced
# here at every size the tests use; the kernel class's rule (moe_plans.pairs_layout)
# takes it up to an eighth of a routed pair per expert. Same GEMMs, transforms and
# combine as the aligned layout, so at 16-row blocks in deterministic mode the two give
# the same bits (pairs_equal_aligned).


def pairs_limit(experts: int, top_k: int) -> int:
    """The rule's largest token count (moe_plans.Exl3MoEThresholds
    .pairs_max_pairs_per_expert = 1/8), at least 1."""
    return max(1, experts // 8 // top_k)


def pairs_equal_aligned(
    x: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    layer: ml.MoeLayer,
    global_experts: int,
    expert_map: torch.Tensor | None = None,
    splits: tuple[int, int] = (1, 1),
    weight_on_input: bool = False,
) -> torch.Tensor:
    """The pairs layout, deterministic, against the float64 oracle and bit for bit
    against the aligned layout at 16-row blocks with the same splits (both with
    non-local pairs left out of the alignment and placed in -1 blocks)."""
    m, top_k = ids.shape
    ref = ml.reference_moe(
        x, w, ids, layer, expert_map, global_experts, weight_on_input
    )
    poison_layout(m, top_k)
    vk.poison_next((m, layer.hidden), x.dtype)
    y = ml.run_op(
        x,
        w,
        ids,
        layer,
        PAIRS_BLOCK,
        global_experts,
        expert_map,
        True,
        weight_on_input,
        splits=splits,
        pairs=True,
    )
    check(y, ref, m=m, top_k=top_k, splits=splits, pairs=True)
    for drop in (True, False) if expert_map is not None else (True,):
        aligned = ml.align(ids, PAIRS_BLOCK, global_experts, expert_map, drop)
        y_aligned = ml.run_op(
            x,
            w,
            ids,
            layer,
            PAIRS_BLOCK,
            global_experts,
            expert_map,
            True,
            weight_on_input,
            aligned=aligned,
            splits=splits,
        )
        assert torch.equal(y.view(torch.int16), y_aligned.view(torch.int16)), dict(
            m=m, top_k=top_k, splits=splits, drop_nonlocal=drop
        )
    return y


@pytest.mark.parametrize("bits,codebook", COMBOS)
def test_pairs_every_rate_and_codebook(
    gen: torch.Generator, bits: float, codebook: int
) -> None:
    """Forced pairs at every rate and codebook, both dtypes and modes; (5, 8) routes 40
    pairs to 16 experts, past the rule, every expert several times."""
    layer = ml.random_moe_layer(gen, 16, 256, 256, [bits], codebook)
    for m, top_k, dtype, det in (
        (1, 4, torch.float16, True),
        (3, 2, torch.bfloat16, False),
        (5, 8, torch.bfloat16, True),
        (2, 1, torch.float16, False),
    ):
        run_checked(
            gen,
            layer,
            m,
            top_k,
            16,
            dtype,
            PAIRS_BLOCK,
            det,
            pairs=True,
            bits=bits,
            codebook=codebook,
        )


@pytest.mark.parametrize(
    "codebook,bits", [(1, (2, 3, 4, 5)), (2, (1.5, 2.5, 3.5, 4, 8)), (0, (1, 6, 7, 8))]
)
def test_pairs_mixed_bitrates_in_one_layer(
    gen: torch.Generator, codebook: int, bits: tuple[float, ...]
) -> None:
    """Every (expert, role) with its own rate: one launch per rate over the pairs'
    blocks, each block on its own expert's trellis, svh and rate."""
    layer = ml.random_moe_layer(gen, 16, 384, 256, bits, codebook)
    assert len(layer.k2s[0]) > 1 and len(layer.k2s[1]) > 1, layer.k2s
    for m in (1, 4):
        for det in (True, False):
            run_checked(
                gen, layer, m, 4, 16, torch.bfloat16, PAIRS_BLOCK, det, pairs=True
            )
    x = activations(gen, 3, 384, torch.bfloat16)
    w, ids = ml.random_routing(gen, 3, 4, 16)
    pairs_equal_aligned(x, w, ids, layer, 16)


@pytest.mark.parametrize("experts", (8, 64, 128))
@pytest.mark.parametrize("top_k", range(1, 9))
def test_pairs_top_k_and_token_counts(
    gen: torch.Generator, top_k: int, experts: int
) -> None:
    """Top-k 1 to 8, 1 token up to the rule's limit, unsplit and split: the oracle,
    and the aligned layout's bits in deterministic mode; non-deterministic mode (the
    fp32 sum of the top-k rows) against the oracle."""
    layer = ml.random_moe_layer(gen, experts, SPLIT_HIDDEN, SPLIT_WIDTH, [2, 4], 1)
    limit = pairs_limit(experts, top_k)
    for m in sorted({1, 2, max(1, limit // 2), limit}):
        x = activations(gen, m, SPLIT_HIDDEN, torch.bfloat16)
        w, ids = ml.random_routing(gen, m, top_k, experts)
        for splits in ((1, 1), (3, 2)):
            pairs_equal_aligned(x, w, ids, layer, experts, splits=splits)
        run_checked(
            gen,
            layer,
            m,
            top_k,
            experts,
            torch.bfloat16,
            PAIRS_BLOCK,
            False,
            pairs=True,
        )


def test_pairs_router_weight_on_input(gen: torch.Generator) -> None:
    layer = ml.random_moe_layer(gen, 8, 256, 256, [4], 2)
    x = activations(gen, 2, 256, torch.bfloat16)
    w, ids = ml.random_routing(gen, 2, 1, 8)
    pairs_equal_aligned(x, w, ids, layer, 8, weight_on_input=True)
    run_checked(
        gen,
        layer,
        2,
        1,
        8,
        torch.bfloat16,
        PAIRS_BLOCK,
        False,
        weight_on_input=True,
        pairs=True,
    )


@pytest.mark.parametrize("ids_dtype", (torch.int32, torch.int64))
def test_pairs_expert_parallel_map(
    gen: torch.Generator, ids_dtype: torch.dtype
) -> None:
    """Rank 1 of 3 (10 of 30 global experts local): the pairs of the other ranks'
    experts (and one id outside the global range) get -1 blocks, which the GEMMs and
    transforms skip and the combine leaves out; the rest equal the aligned layout's
    bits either way the alignment treats them."""
    global_experts, local = 30, 10
    emap = torch.full((global_experts,), -1, dtype=torch.int32)
    emap[2::3] = torch.arange(local, dtype=torch.int32)
    emap = emap.cuda()
    layer = ml.random_moe_layer(gen, local, SPLIT_HIDDEN, SPLIT_WIDTH, [2, 3, 4], 1)
    for m, top_k in ((1, 8), (2, 6), (5, 3)):
        x = activations(gen, m, SPLIT_HIDDEN, torch.bfloat16)
        w, ids = ml.random_routing(gen, m, top_k, global_experts, ids_dtype=ids_dtype)
        ids[0, -1] = global_experts  # no expert at all: contributes nothing
        for splits in ((1, 1), (3, 2)):
            pairs_equal_aligned(x, w, ids, layer, global_experts, emap, splits)
            poison_layout(m, top_k)
            vk.poison_next((m, SPLIT_HIDDEN), torch.bfloat16)
            y = ml.run_op(
                x,
                w,
                ids,
                layer,
                PAIRS_BLOCK,
                global_experts,
                emap,
                False,
                splits=splits,
                pairs=True,
            )
            check(y, ml.reference_moe(x, w, ids, layer, emap, global_experts))


def test_pairs_repeated_experts(gen: torch.Generator) -> None:
    """Pairs that share an expert each get a block of their own: every token to one
    expert (slot 0), 2 experts for 8 pairs, each of 8 experts 3 times."""
    layer = ml.random_moe_layer(gen, 32, 256, 256, [3], 1)
    for m, top_k in ((1, 1), (3, 4), (8, 2)):
        for det in (True, False):
            run_checked(
                gen,
                layer,
                m,
                top_k,
                32,
                torch.float16,
                PAIRS_BLOCK,
                det,
                only=5,
                pairs=True,
            )
    two = ml.random_moe_layer(gen, 2, 256, 256, [2, 4], 1)
    eight = ml.random_moe_layer(gen, 8, 256, 256, [2, 4], 1)
    for lay, m, top_k in ((two, 4, 2), (eight, 3, 8)):
        x = activations(gen, m, 256, torch.bfloat16)
        w, ids = ml.random_routing(gen, m, top_k, lay.experts)
        for splits in ((1, 1), (2, 2)):
            pairs_equal_aligned(x, w, ids, lay, lay.experts, splits=splits)


def test_pairs_deterministic_bit_exact(gen: torch.Generator) -> None:
    layer = ml.random_moe_layer(gen, 64, SPLIT_HIDDEN, SPLIT_WIDTH, [2, 3, 4], 1)
    for m in (1, 2):
        x = activations(gen, m, SPLIT_HIDDEN, torch.bfloat16)
        w, ids = ml.random_routing(gen, m, 8, 64)
        for splits in ((1, 1), (4, 3)):
            first = ml.run_op(x, w, ids, layer, 16, 64, splits=splits, pairs=True)
            for _ in range(5):
                poison_layout(m, 8)
                again = ml.run_op(x, w, ids, layer, 16, 64, splits=splits, pairs=True)
                assert torch.equal(first.view(torch.int16), again.view(torch.int16))


@pytest.mark.parametrize("deterministic", (True, False))
@pytest.mark.parametrize("splits", ((1, 1), (2, 2)))
def test_pairs_cuda_graph_replay_equals_eager(
    gen: torch.Generator, deterministic: bool, splits: tuple[int, int]
) -> None:
    """A captured pairs call lays the pairs out again on every replay: new inputs and
    a new routing (copied into the captured tensors) give the eager result."""
    layer = ml.random_moe_layer(gen, 32, SPLIT_HIDDEN, SPLIT_WIDTH, [2, 4], 1)
    m, top_k = 2, 4
    x = activations(gen, m, SPLIT_HIDDEN, torch.bfloat16)
    w, ids = ml.random_routing(gen, m, top_k, 32)

    def call() -> torch.Tensor:
        return ml.run_op(
            x,
            w,
            ids,
            layer,
            PAIRS_BLOCK,
            32,
            deterministic=deterministic,
            splits=splits,
            pairs=True,
        )

    call()  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = call()
    for _ in range(3):
        x.copy_(activations(gen, m, SPLIT_HIDDEN, torch.bfloat16))
        w_new, ids_new = ml.random_routing(gen, m, top_k, 32)
        w.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        eager = call()
        if deterministic or splits[1] > 1:
            assert torch.equal(y_graph.view(torch.int16), eager.view(torch.int16))
        else:
            check(y_graph, eager.double())
        check(y_graph, ml.reference_moe(x, w, ids, layer, None, 32))


def test_pairs_propagate_nan_to_their_token_only(gen: torch.Generator) -> None:
    """A NaN in one token's input reaches that token's output and no other (each pair's
    block holds its own row and zero padding)."""
    layer = ml.random_moe_layer(gen, 8, 256, 256, [4], 1)
    m, bad = 3, 1
    x = activations(gen, m, 256, torch.bfloat16)
    x[bad, 5] = float("nan")
    w, ids = ml.random_routing(gen, m, 2, 8)
    for splits in ((1, 1), (2, 2)):
        for det in (True, False):
            y = ml.run_op(
                x, w, ids, layer, PAIRS_BLOCK, 8, None, det, splits=splits, pairs=True
            )
            assert bool(torch.isnan(y[bad]).any()), (splits, det)
            assert bool(torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all())


@pytest.mark.parametrize("splits", ((1, 1), (2, 2)))
def test_pairs_a_launched_rate_no_expert_has(
    gen: torch.Generator, splits: tuple[int, int]
) -> None:
    """Rates launched before and after the layer's own over the pairs layout: every
    block of the first gate/up launch (here a rate no expert has, so all idle) waits
    for the input transform that writes the layout before reading it or releasing
    the grids after it, so the later rate launches, the SwiGLU transform and the down
    GEMM, which read it without waiting, see it whole. Repeated, with a long input
    transform (hidden 1024), so an early read would show."""
    import dataclasses

    layer = ml.random_moe_layer(gen, 64, 1024, 512, [4], 1)
    k13, k2 = layer.k2s
    padded = dataclasses.replace(layer, k2s=([2, *k13, 16], [2, *k2, 16]))
    for _ in range(5):
        for m in (1, 2, 16):
            for det in (True, False):
                run_checked(
                    gen,
                    padded,
                    m,
                    8,
                    64,
                    torch.bfloat16,
                    PAIRS_BLOCK,
                    det,
                    splits=splits,
                    pairs=True,
                )


def pairs_kernel_class(layer: ml.MoeLayer):
    """A maker of CudaExl3MoEKernel with the row layout and the splits fixed (None: the
    rule), and the layer's weights; skips without vLLM (with the overlay) importable."""
    try:
        from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
            CudaExl3MoEKernel,
            Exl3MoEWeights,
        )
        from vllm.model_executor.layers.quantization.exl3.moe_plans import (
            Exl3MoEOverrides,
            Exl3MoEPath,
        )

        align = "vllm.model_executor.layers.fused_moe.moe_align_block_size"
        if importlib.util.find_spec(align) is None:
            raise ImportError(f"no {align}")
    except ImportError as e:
        pytest.skip(f"vLLM with the EXL3 overlay is not importable: {e}")
    weights = Exl3MoEWeights(
        *layer.tensors(),
        num_experts=layer.experts,
        hidden=layer.hidden,
        width=layer.width,
    )

    def make(
        pairs: bool | None, splits: tuple[int, int] | None = None
    ) -> CudaExl3MoEKernel:
        """pairs: True the pairs layout, False vLLM's alignment, None the rule."""
        layout = {None: None, True: Exl3MoEPath.PAIRS, False: Exl3MoEPath.ALIGNED}
        return CudaExl3MoEKernel(Exl3MoEOverrides(path=layout[pairs], splits=splits))

    return make, weights


def test_pairs_through_the_kernel_class(gen: torch.Generator) -> None:
    """CudaExl3MoEKernel.apply: the rule (pairs up to an eighth of a routed pair per
    expert), the layout overridden either way, with and without an expert_map, split
    and not; against the float64 oracle."""
    global_experts, local = 64, 32
    layer = ml.random_moe_layer(gen, local, 256, 256, [2, 3.5, 4], 2)
    make, weights = pairs_kernel_class(layer)
    from vllm.model_executor.layers.quantization.exl3.moe_plans import pairs_layout

    emap = torch.full((global_experts,), -1, dtype=torch.int32)
    emap[1::2] = torch.arange(local, dtype=torch.int32)
    emap = emap.cuda()
    assert pairs_layout(1, 8, 64) and not pairs_layout(2, 8, 64)
    for force in (None, True, False):
        for m, split in ((1, None), (2, (2, 2)), (3, None), (9, None)):
            kernel = make(force, split)
            for det, expert_map in ((True, None), (False, emap)):
                ge = global_experts if expert_map is not None else local
                x = activations(gen, m, 256, torch.float16)
                w, ids = ml.random_routing(gen, m, 8, ge)
                ref = ml.reference_moe(x, w, ids, layer, expert_map, ge)
                vk.poison_next((m, 256), torch.float16)
                y = kernel.apply(
                    x,
                    w,
                    ids,
                    weights,
                    activation="silu",
                    apply_router_weight_on_input=False,
                    expert_map=expert_map,
                    global_num_experts=ge,
                    codebook=2,
                    deterministic=det,
                )
                check(y, ref, m=m, force=force, split=split, det=det)


def test_pairs_layout_launches_no_alignment(gen: torch.Generator) -> None:
    """Which kernels a call launches (torch.profiler): the pairs layout only the op's
    own (input transform, a GEMM per rate and stage, SwiGLU transform, combine), none
    of vLLM's alignment; the aligned layout (overridden) launches the alignment, so
    the check can fail."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    layer = ml.random_moe_layer(gen, 128, 256, 256, [2, 4], 1)
    make, weights = pairs_kernel_class(layer)
    from vllm.model_executor.layers.quantization.exl3.moe_plans import pairs_layout

    m, top_k = 1, 8
    x = activations(gen, m, 256, torch.bfloat16)
    w, ids = ml.random_routing(gen, m, top_k, 128)

    def names(force: bool | None) -> list[str]:
        kernel = make(force, (1, 1))

        def call() -> torch.Tensor:
            return kernel.apply(
                x,
                w,
                ids,
                weights,
                activation="silu",
                apply_router_weight_on_input=False,
                expert_map=None,
                global_num_experts=128,
                codebook=1,
                deterministic=True,
            )

        call()  # warm (and the rate table read)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y = call()
            torch.cuda.synchronize()
        check(y, ml.reference_moe(x, w, ids, layer, None, 128), force=force)
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    assert pairs_layout(m, top_k, 128)  # the rule: 8 pairs of 128 experts
    rates13, rates2 = layer.k2s
    expected = 3 + len(rates13) + len(rates2)
    for force in (None, True):
        got = names(force)
        assert all("exl3_moe" in n for n in got), got
        assert len(got) == expected, got
        assert not any("align" in n or "sort" in n for n in got), got
    aligned = names(False)
    assert any("moe_align" in n for n in aligned), aligned


# The reconstructed weights against float64: the dense original-basis reconstruct's
# bounds (exl3_oracle.py: the fp16 staging between the two Hadamard sides, then one
# rounding to the output dtype, 1.65e-3 RMS for bf16; its maxima reach 2^-8 of the
# largest of ~1e5 weights, several rms). (relative Frobenius, max |err| / rms).
RECONSTRUCT_TOLERANCE = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (5e-3, 6e-2)}


def reconstruct_all(
    layer: ml.MoeLayer, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops._C.exl3_moe_reconstruct of both weight sets into NaN-filled buffers."""
    e, h, i = layer.experts, layer.hidden, layer.width
    w1 = torch.full((e, 2 * i, h), float("nan"), dtype=dtype, device="cuda")
    w2 = torch.full((e, h, i), float("nan"), dtype=dtype, device="cuda")
    k13, k2 = layer.k2s
    torch.ops._C.exl3_moe_reconstruct(
        layer.w13_trellis,
        layer.w13_meta,
        layer.w13_suh,
        layer.w13_svh,
        k13,
        layer.codebook,
        w1,
    )
    torch.ops._C.exl3_moe_reconstruct(
        layer.w2_trellis,
        layer.w2_meta.unsqueeze(1),
        layer.w2_suh.unsqueeze(1),
        layer.w2_svh,
        k2,
        layer.codebook,
        w2,
    )
    return w1, w2


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize(
    "codebook,bits", [(1, (2, 3, 4, 5)), (2, (1.5, 2.5, 3.5, 4, 8)), (0, (1, 6, 7, 8))]
)
def test_reconstruct_every_expert_and_role(
    gen: torch.Generator, codebook: int, bits: tuple[float, ...], dtype: torch.dtype
) -> None:
    """exl3_moe_reconstruct: each (expert, role) of a mixed-rate layer transposed into
    the fused-MoE layout, against the float64 decode; a block left unwritten stays NaN.
    """
    layer = ml.random_moe_layer(gen, 12, 384, 256, bits, codebook)
    i = layer.width
    w1, w2 = reconstruct_all(layer, dtype)
    tol_rel, tol_max = RECONSTRUCT_TOLERANCE[dtype]
    for e in range(layer.experts):
        for role in (0, 1, 2):
            ref = ml.reference.reconstruct(
                *layer.block(e, role), layer.codebook, dtype=torch.float64
            ).T
            got = w2[e] if role == 2 else w1[e, role * i : (role + 1) * i]
            rel, mx = vk.errors(got, ref)
            assert rel <= tol_rel and mx <= tol_max, dict(
                expert=e, role=role, rel=rel, max=mx
            )


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize(
    "codebook,bits", [(1, (2, 4, 5)), (2, (1.5, 3.5, 8)), (0, (3,))]
)
def test_reconstruct_bit_identical_to_the_dense_original_basis(
    gen: torch.Generator, codebook: int, bits: tuple[float, ...], dtype: torch.dtype
) -> None:
    """exl3_moe_reconstruct runs the dense original-basis reconstruct's arithmetic and
    only stores W^T instead of W: each (expert, role) must equal, bit for bit, the W
    that exl3_linear's original-basis path multiplies by, read back through the
    identity (I @ W in fp32 is exact). Fresh random layers; the MoE output starts as
    NaN, so a block the kernel left unwritten fails."""
    layer = ml.random_moe_layer(gen, 6, 384, 256, bits, codebook)
    i = layer.width
    w1, w2 = reconstruct_all(layer, dtype)
    for e in range(layer.experts):
        for role in (0, 1, 2):
            trellis, suh, svh = layer.block(e, role)
            k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
            eye = torch.eye(k, dtype=dtype, device="cuda")
            vk.poison_next((k, n), dtype)
            with vk.knobs(reconstruct_m=1, reconstruct_basis="original"):
                w = vk.exl3_op(eye, trellis, suh[None], svh, None, [n], codebook)
            got = w2[e] if role == 2 else w1[e, role * i : (role + 1) * i]
            assert bool(torch.isfinite(w).all()), dict(expert=e, role=role)
            # Values, not bits: I @ W turns a -0 of W into +0.
            same = got == w.T
            assert bool(same.all()), dict(
                expert=e, role=role, mismatches=int((~same).sum())
            )


def large_batch_kernel(layer: ml.MoeLayer):
    """CudaExl3MoEKernel with its scratch reserved and the large-batch path taken at
    every size; skips without vLLM (with the overlay) importable."""
    try:
        from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
            CudaExl3MoEKernel,
            Exl3MoEWeights,
        )
        from vllm.model_executor.layers.quantization.exl3.moe_plans import (
            Exl3MoEOverrides,
            Exl3MoEPath,
        )
    except ImportError as e:
        pytest.skip(f"vLLM with the EXL3 overlay is not importable: {e}")
    weights = Exl3MoEWeights(
        *layer.tensors(),
        num_experts=layer.experts,
        hidden=layer.hidden,
        width=layer.width,
    )
    kernel = CudaExl3MoEKernel(Exl3MoEOverrides(path=Exl3MoEPath.RECONSTRUCT))
    kernel.prepare(weights, torch.bfloat16)
    assert kernel.reconstruct_ready, "the scratch was not reserved"
    return kernel, weights


def test_large_batch_path(gen: torch.Generator) -> None:
    """The reconstruct + vLLM fused_experts path of CudaExl3MoEKernel.apply on a
    mixed-rate layer, with and without an expert_map (rank 1 of 2), bf16 and fp16,
    against the float64 reference; taken only from the rows-per-expert threshold."""
    global_experts, local = 32, 16
    layer = ml.random_moe_layer(gen, local, 256, 384, [2, 3, 4], 1)
    kernel, weights = large_batch_kernel(layer)
    from vllm.config import VllmConfig, set_current_vllm_config

    emap = torch.full((global_experts,), -1, dtype=torch.int32)
    emap[1::2] = torch.arange(local, dtype=torch.int32)
    emap = emap.cuda()
    with set_current_vllm_config(VllmConfig()):
        for m, dtype, expert_map in (
            (1, torch.bfloat16, None),
            (300, torch.bfloat16, emap),
            (1000, torch.float16, None),
            (64, torch.float16, emap),
        ):
            ge = global_experts if expert_map is not None else local
            x = activations(gen, m, layer.hidden, dtype)
            w, ids = ml.random_routing(gen, m, 4, ge)
            ref = ml.reference_moe(x, w, ids, layer, expert_map, ge)
            vk.poison_next((m, layer.hidden), dtype)
            y = kernel.apply(
                x,
                w,
                ids,
                weights,
                activation="silu",
                apply_router_weight_on_input=False,
                expert_map=expert_map,
                global_num_experts=ge,
                codebook=1,
                deterministic=True,
            )
            check(y, ref, m=m, path="reconstruct", emap=expert_map is not None)
            # Run to run bit-exact (no split-k or atomics on this path either).
            again = kernel.apply(
                x,
                w,
                ids,
                weights,
                activation="silu",
                apply_router_weight_on_input=False,
                expert_map=expert_map,
                global_num_experts=ge,
                codebook=1,
                deterministic=True,
            )
            assert torch.equal(y.view(torch.int16), again.view(torch.int16)), m
    # Not forced, the path is taken from the rows-per-expert threshold (16 here) on.
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        CudaExl3MoEKernel,
    )
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        MOE_THRESHOLDS,
        Exl3MoEPath,
    )

    sixteen = dataclasses.replace(MOE_THRESHOLDS, reconstruct_min_rows_per_expert=16)
    ruled = CudaExl3MoEKernel(thresholds=sixteen)
    ruled.prepare(weights, torch.bfloat16)
    rates = ruled.rates(weights, 1)
    cuda = torch.device("cuda")
    path = Exl3MoEPath.RECONSTRUCT
    assert ruled.choose(63, 4, 16, weights, rates, cuda).path is not path
    assert ruled.choose(64, 4, 16, weights, rates, cuda).path is path


def test_sanitizer_sample(gen: torch.Generator) -> None:
    """A small sample of every MoE kernel for compute-sanitizer (memcheck, racecheck):
    both stages at every block size, mixed rates, both combines, -1 blocks of an
    expert_map, all tokens to one expert, the split-k path (both tiers, both modes,
    uneven and one-stage splits, -1 blocks), the pairs layout, the reconstruct. Also an
    ordinary test.

        PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
            --error-exitcode 1 python3 -m pytest -q -m gpu \
            overlay/tests/kernels/quantization/test_exl3_moe_kernels.py \
            -k sanitizer_sample
    """
    layer = ml.random_moe_layer(gen, 8, 256, 128, [2, 3, 4], 1)
    for block in BLOCKS:
        for det in (True, False):
            run_checked(gen, layer, 37, 2, 8, torch.bfloat16, block, det)
    run_checked(gen, layer, 20, 2, 8, torch.float16, 16, True, only=3)
    emap = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 7, -1], dtype=torch.int32).cuda()
    x = activations(gen, 9, 256, torch.bfloat16)
    w, ids = ml.random_routing(gen, 9, 3, 10)
    ref = ml.reference_moe(x, w, ids, layer, emap, 10)
    aligned = ml.align(ids, 16, 10, emap, drop_nonlocal=False)
    y = ml.run_op(x, w, ids, layer, 16, 10, emap, False, aligned=aligned)
    check(y, ref)
    # Split-k: width 128 and hidden 256 give 2 and 4 stages of k.
    for block, det, splits in (
        (16, True, (3, 2)),
        (32, False, (4, 2)),
        (16, False, (2, 1)),
    ):
        run_checked(gen, layer, 3, 2, 8, torch.bfloat16, block, det, splits=splits)
    y = ml.run_op(x, w, ids, layer, 16, 10, emap, True, aligned=aligned, splits=(4, 2))
    check(y, ref)
    # The pairs layout: both modes, -1 blocks, split and not.
    for det, splits in ((True, (1, 1)), (False, (1, 1)), (True, (4, 2))):
        y = ml.run_op(x, w, ids, layer, 16, 10, emap, det, splits=splits, pairs=True)
        check(y, ref, det=det, splits=splits, pairs=True)
    w1, w2 = reconstruct_all(layer, torch.bfloat16)
    assert bool(torch.isfinite(w1).all()) and bool(torch.isfinite(w2).all())


def test_bad_inputs_name_the_tensor(gen: torch.Generator) -> None:
    layer = ml.random_moe_layer(gen, 4, 128, 128, [2], 1)
    x = activations(gen, 3, 128, torch.bfloat16)
    w, ids = ml.random_routing(gen, 3, 2, 4)
    aligned = ml.align(ids, 16, 4)
    k13, k2 = layer.k2s

    def call(**over: object) -> None:
        args = dict(
            x=x,
            w=w,
            ids=ids,
            sorted=aligned[0],
            blocks=aligned[1],
            pad=aligned[2],
            emap=None,
            tensors=layer.tensors(),
            block=16,
            k13=k13,
            k2=k2,
            ge=4,
            cb=1,
            splits=(1, 1),
            ws=None,
            wgmma=-1,
        )
        args.update(over)
        torch.ops._C.exl3_moe(
            args["x"],
            args["w"],
            args["ids"],
            args["sorted"],
            args["blocks"],
            args["pad"],
            args["emap"],
            *args["tensors"],
            args["block"],
            args["k13"],
            args["k2"],
            args["ge"],
            args["cb"],
            False,
            True,
            *args["splits"],
            args["ws"],
            args["wgmma"],
        )

    call()
    call(sorted=None, blocks=None, pad=None)  # the pairs layout
    # hidden 128 and width 128: 2 stages of k each; split (2, 2) needs
    # 2 * 2 * 6 * 128 + 2 * 6 * 128 partial sums.
    need = ml.split_workspace_floats(3, 2, 128, 128, 2, 2)
    assert need == 2 * 2 * 6 * 128 + 2 * 6 * 128
    ws = torch.empty(need, dtype=torch.float32, device="cuda")
    call(splits=(2, 2), ws=ws)
    a64 = ml.align(ids, 64, 4)
    by64 = dict(zip(("sorted", "blocks", "pad"), a64), block=64)
    call(wgmma=0, **by64)
    if WGMMA_DEVICE:
        call(wgmma=1, **by64)
    t = layer.tensors()
    cases = [
        (dict(x=x.float()), "x must be bfloat16 or float16"),
        (dict(w=w.half()), "topk_weights must be float32"),
        (dict(ids=ids[:, :1].contiguous()), "topk_weights must be [3, 1]"),
        (dict(block=48), "block_size 48"),
        (dict(k13=[]), "w13_k2s"),
        (dict(k2=[5]), "only with the MUL1 codebook"),
        (dict(k13=[4, 4]), "twice"),
        (dict(cb=3), "codebook must be"),
        (dict(tensors=[t[0], t[1].int()] + t[2:]), "w13_meta must be int64"),
        (dict(tensors=t[:2] + [t[2][:, :1].contiguous()] + t[3:]), "w13_suh must be"),
        (dict(tensors=t[:7] + [t[7][:, :64].contiguous()]), "w2_svh must be"),
        (dict(ge=8), "without an expert_map"),
        (
            dict(emap=torch.zeros(5, dtype=torch.int32, device="cuda")),
            "expert_map must be",
        ),
        (dict(blocks=aligned[1][:-1]), "expert_ids must be"),
        (dict(blocks=None), "are given together"),
        (dict(sorted=None, pad=None), "got 1 of them"),
        (dict(x=x.cpu()), "x must be a CUDA tensor"),
        (dict(splits=(2, 1)), "need a workspace of"),
        (dict(splits=(2, 2), ws=ws[:-1]), "holds fewer than the"),
        (dict(splits=(2, 2), ws=ws.half()), "workspace must be float32"),
        (dict(splits=(2, 2), ws=ws[1:]), "workspace must be 16-byte aligned"),
        (dict(splits=(3, 1), ws=ws), "gate_up_splits = 3 is outside 1..2"),
        (dict(splits=(1, 0), ws=ws), "down_splits = 0 is outside 1..2"),
        (
            dict(
                splits=(2, 1),
                ws=ws,
                block=64,
                **dict(zip(("sorted", "blocks", "pad"), a64)),
            ),
            "built for block sizes up to 32",
        ),
        (dict(wgmma=2), "wgmma must be -1 (auto), 0 (never) or 1 (always)"),
        (dict(wgmma=1), "wgmma = 1 needs an unsplit block_size of 64 or 128"),
    ]
    if not WGMMA_DEVICE:
        cases.append(
            (
                dict(wgmma=1, **by64),
                "wgmma = 1 needs a compute capability 9.0 device",
            )
        )
    for over, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call(**over)


def test_reconstruct_bad_inputs_name_the_tensor(gen: torch.Generator) -> None:
    layer = ml.random_moe_layer(gen, 4, 128, 256, [2], 1)
    e, h, i = 4, 128, 256
    good = dict(
        trellis=layer.w13_trellis,
        meta=layer.w13_meta,
        suh=layer.w13_suh,
        svh=layer.w13_svh,
        k2s=layer.k2s[0],
        cb=1,
        out=torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device="cuda"),
    )

    def call(**over: object) -> None:
        a = {**good, **over}
        torch.ops._C.exl3_moe_reconstruct(
            a["trellis"], a["meta"], a["suh"], a["svh"], a["k2s"], a["cb"], a["out"]
        )

    call()
    for over, message in [
        (dict(out=good["out"].float()), "out must be bfloat16 or float16"),
        (dict(out=good["out"][:, :i].contiguous()), "out must be [4, 512, 128]"),
        (dict(out=good["out"].cpu()), "out must be a CUDA tensor"),
        (dict(meta=good["meta"].int()), "meta must be int64"),
        (dict(suh=good["suh"][:, :1].contiguous()), "suh must be [4, 2, 128]"),
        (dict(k2s=[]), "k2s"),
        (dict(k2s=[3]), "only with the MUL1 codebook"),
        (dict(cb=5), "codebook must be"),
        (dict(trellis=good["trellis"].int()), "trellis must be int16"),
    ]:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call(**over)
