# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of the sparse-MLA decode kernel (torch.ops._C.exl3_sparse_mla_decode)
against the fp32 reference of overlay/vllm/v1/attention/ops/exl3_sparse_mla.py.

Needs a CUDA GPU and an extension that registers the op: $VLLM_EXL3_EXT,
build/exl3/_exl3_C.abi3.so (`python -m vllm_exl3.kernels_build` from scripts/) or an
installed vllm._exl3_C. The wrapper is loaded from this checkout's overlay, so the test
runs against the code it sits next to whatever vLLM is installed.

Fresh random inputs every run (the failing seed is printed), outputs and workspace
poisoned with NaN first, NaN never passes. Error bound: the kernel multiplies bf16
probabilities (relative rounding 2^-9) with bf16 values and rounds the output to
bf16, so |out - ref| <= 2^-8 max|V| + 2^-9 |ref|; the bounds below are twice that. lse
carries the bf16 probability sum (2^-9 relative -> 2e-3 absolute). The fp8_ds_mla path
rounds the dequantized latent (e4m3 x scale) to bf16 for the MMAs, as FlashMLA does:
its reference is the fp32 reference over those bf16 rows, so the same bounds hold (the
rounding itself moves a score by up to 2^-9 scale sum|q k|, which a peaky softmax turns
into errors no fixed bound on the exact fp8 values would separate from a bug).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from vllm.v1.attention.ops import exl3_sparse_mla as mla
from vllm_exl3.testing import exl3_oracle

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

try:
    exl3_oracle.load_extension()
except (ImportError, OSError, RuntimeError) as e:  # pragma: no cover - host dependent
    pytest.skip(f"EXL3 extension not available: {e}", allow_module_level=True)
if not hasattr(torch.ops._C, "exl3_sparse_mla_decode"):
    pytest.skip(
        "the loaded EXL3 extension has no exl3_sparse_mla_decode (rebuild it)",
        allow_module_level=True,
    )

BF16, FP8 = mla.KV_FORMAT_BF16, mla.KV_FORMAT_FP8_DS_MLA
OUT_ATOL_PER_VMAX = 8e-3
OUT_RTOL = 8e-3
LSE_ATOL = 4e-3


@dataclass(frozen=True)
class Case:
    tokens: int
    heads: int
    head_size: int = 576
    kv_format: int = BF16
    topk: int = 2048
    context: int = 4096
    block_size: int = 64
    strided: bool = False  # block and row strides beyond the packed row
    pad_frac: float = 0.0  # share of each token's top-k list set to -1
    empty_tokens: int = 0  # tokens whose list is all -1
    junk_frac: float = 0.0  # share of slots past the cache or below -1 (count as none)
    scale: float = 192**-0.5

    @property
    def ident(self) -> str:
        """A pytest id without spaces (for -k)."""
        fmt = "bf16" if self.kv_format == BF16 else "fp8"
        return (
            f"T{self.tokens}-H{self.heads}-D{self.head_size}-{fmt}-k{self.topk}"
            f"-ctx{self.context}-bs{self.block_size}"
            f"{'-strided' if self.strided else ''}"
            f"{f'-pad{self.pad_frac}' if self.pad_frac else ''}"
            f"{f'-empty{self.empty_tokens}' if self.empty_tokens else ''}"
            f"{f'-junk{self.junk_frac}' if self.junk_frac else ''}"
            f"{f'-scale{self.scale:g}' if self.scale != 192**-0.5 else ''}"
        )

    def __str__(self) -> str:
        fmt = "bf16" if self.kv_format == BF16 else "fp8_ds_mla"
        return (
            f"T={self.tokens} H={self.heads} D={self.head_size} {fmt} "
            f"topk={self.topk} ctx={self.context} bs={self.block_size}"
            f"{' strided' if self.strided else ''} pad={self.pad_frac}"
            f" empty={self.empty_tokens} junk={self.junk_frac}"
            f" scale={self.scale:.4g}"
        )


def make_cache(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """A cache holding `context` tokens (plus spare blocks) in vLLM's layout; strided
    caches are views into a wider buffer. Returns (cache, num_blocks)."""
    nb = -(-case.context // case.block_size) + 3
    d = case.head_size
    extra_rows = 3 if case.strided else 0
    if case.kv_format == FP8:
        extra_bytes = 16 if case.strided else 0
        vals = torch.randn(
            (nb, case.block_size + extra_rows, d), generator=gen, device="cuda"
        )
        rows = mla.quantize_fp8_ds_mla(vals)
        buf = torch.zeros(
            (nb, case.block_size + extra_rows, mla.FP8_ROW_BYTES + extra_bytes),
            dtype=torch.uint8,
            device="cuda",
        )
        buf[..., : mla.FP8_ROW_BYTES] = rows
        cache = buf[:, : case.block_size, : mla.FP8_ROW_BYTES]
    else:
        extra = 8 if case.strided else 0
        buf = torch.randn(
            (nb, case.block_size + extra_rows, d + extra), generator=gen, device="cuda"
        ).to(torch.bfloat16)
        cache = buf[:, : case.block_size, :d]
    return cache, nb


def make_indices(case: Case, nb: int, gen: torch.Generator) -> torch.Tensor:
    """Per token: a context length, a random block table over the cache's blocks,
    `topk` distinct positions of the context (fewer -> -1), then -1 padding and empty
    tokens."""
    t, k, bs = case.tokens, case.topk, case.block_size
    ctx = torch.randint(
        1, case.context + 1, (t,), generator=gen, device="cuda"
    ).clamp_min(min(case.context, k // 2 + 1))
    score = torch.rand((t, case.context), generator=gen, device="cuda")
    pos_ids = torch.arange(case.context, device="cuda")
    score = score.masked_fill(pos_ids >= ctx.unsqueeze(1), -1.0)
    kk = min(k, case.context)
    top = score.topk(kk, dim=1)
    pos = torch.where(top.values >= 0, top.indices, -1)
    if kk < k:
        pos = torch.cat([pos, pos.new_full((t, k - kk), -1)], dim=1)
    tables = torch.argsort(torch.rand((t, nb), generator=gen, device="cuda"), dim=1)
    blk = torch.gather(tables, 1, (pos.clamp_min(0) // bs))
    slots = torch.where(pos >= 0, blk * bs + pos.clamp_min(0) % bs, -1)
    if case.pad_frac:
        drop = torch.rand((t, k), generator=gen, device="cuda") < case.pad_frac
        slots = slots.masked_fill(drop, -1)
    if case.junk_frac:
        junk = torch.rand((t, k), generator=gen, device="cuda") < case.junk_frac
        far = torch.randint(nb * bs, 2**31 - 1, (t, k), generator=gen, device="cuda")
        low = -torch.randint(2, 2**31 - 1, (t, k), generator=gen, device="cuda")
        bad = torch.where(
            torch.rand((t, k), generator=gen, device="cuda") < 0.5, far, low
        )
        slots = torch.where(junk, bad, slots)
    if case.empty_tokens:
        which = torch.randperm(t, generator=gen, device="cuda")[: case.empty_tokens]
        slots[which] = -1
    # The selection order is arbitrary in vLLM too; shuffle so -1s interleave.
    perm = torch.argsort(torch.rand((t, k), generator=gen, device="cuda"), dim=1)
    return torch.gather(slots, 1, perm).to(torch.int32).contiguous()


def run_kernel(q, cache, idx, case):
    t, h = q.shape[:2]
    out = torch.full(
        (t, h, mla.LATENT), float("nan"), dtype=torch.bfloat16, device="cuda"
    )
    lse = torch.full((t, h), float("nan"), device="cuda")
    ws = torch.full(
        (mla.workspace_bytes(t, h, case.topk),), 0xFF, dtype=torch.uint8, device="cuda"
    )
    return mla.sparse_mla_decode(
        q, cache, idx, case.scale, case.kv_format, out, lse, ws
    )


def reference(q, cache, idx, case):
    """fp32 reference; fp8_ds_mla over the bf16 rows the kernel multiplies."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        if case.kv_format == FP8:
            rows = mla.dequantize_fp8_ds_mla(cache).to(torch.bfloat16)
            return mla.sparse_mla_reference(q, rows, idx, case.scale, BF16)
        return mla.sparse_mla_reference(q, cache, idx, case.scale, case.kv_format)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def compare(case: Case, seed: int, out, lse, ref_out, ref_lse, cache) -> list[str]:
    """Every broken rule as one diagnostic line (empty: pass)."""
    errs = []
    got = out.float()
    nan_out = int(torch.isnan(got).sum())
    nan_lse = int(torch.isnan(lse).sum())
    if nan_out or nan_lse:
        errs.append(f"NaN: {nan_out} in out, {nan_lse} in lse")
    if cache.dtype == torch.uint8:
        vmax = float(mla.dequantize_fp8_ds_mla(cache)[..., : mla.LATENT].abs().max())
    else:
        vmax = float(cache[..., : mla.LATENT].float().abs().max())
    bound = OUT_ATOL_PER_VMAX * vmax + OUT_RTOL * ref_out.abs()
    err = (got - ref_out).abs()
    excess = torch.nan_to_num(err - bound, nan=float("inf"))
    if bool((excess > 0).any()):
        i = int(excess.flatten().argmax())
        t, h, d = (
            i // (out.shape[1] * out.shape[2]),
            (i // out.shape[2]) % out.shape[1],
            i % out.shape[2],
        )
        errs.append(
            f"out: {int((excess > 0).sum())} values out of bound; worst at "
            f"[t={t}, h={h}, d={d}] got {float(got[t, h, d]):.5g} ref "
            f"{float(ref_out[t, h, d]):.5g} (max abs err {float(err.max()):.3g}, "
            f"bound there {float(bound[t, h, d]):.3g})"
        )
    empty = torch.isinf(ref_lse)
    if not torch.equal(torch.isinf(lse) & (lse < 0), empty):
        errs.append(
            f"lse: -inf at {int((torch.isinf(lse) & (lse < 0)).sum())} heads, "
            f"expected at {int(empty.sum())}"
        )
    if bool(empty.any()) and bool((out.float()[empty] != 0).any()):
        errs.append("out: an all -1 token has nonzero output")
    lerr = torch.where(empty, 0.0, (lse - ref_lse).abs())
    lerr = torch.nan_to_num(lerr, nan=float("inf"))
    if float(lerr.max()) > LSE_ATOL:
        i = int(lerr.flatten().argmax())
        t, h = i // lse.shape[1], i % lse.shape[1]
        errs.append(
            f"lse: max abs err {float(lerr.max()):.3g} at [t={t}, h={h}] got "
            f"{float(lse[t, h]):.6g} ref {float(ref_lse[t, h]):.6g}"
        )
    return [f"{case} seed={seed}: {e}" for e in errs]


def check(case: Case) -> list[str]:
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    cache, nb = make_cache(case, gen)
    idx = make_indices(case, nb, gen)
    q = torch.randn(
        (case.tokens, case.heads, case.head_size), generator=gen, device="cuda"
    ).to(torch.bfloat16)
    out, lse = run_kernel(q, cache, idx, case)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(q, cache, idx, case)
    return compare(case, seed, out, lse, ref_out, ref_lse, cache)


CASES = [
    # heads: one group, partial groups, several groups, the TP shards of 128
    *(Case(tokens=4, heads=h) for h in (1, 16, 17, 32, 64, 65, 100, 128)),
    *(Case(tokens=3, heads=h, kv_format=FP8) for h in (1, 16, 17, 64, 65, 100, 128)),
    # head size 512 (bf16 only)
    Case(tokens=5, heads=16, head_size=512),
    Case(tokens=2, heads=128, head_size=512, topk=512, pad_frac=0.3),
    # top-k lengths, -1 padding, contexts shorter than top-k, all -1 tokens
    *(
        Case(tokens=3, heads=16, topk=k, context=8192, pad_frac=0.25)
        for k in (64, 512, 4096)
    ),
    Case(tokens=6, heads=32, topk=2048, context=1000, empty_tokens=2),
    Case(tokens=6, heads=32, topk=2048, context=1000, kv_format=FP8, empty_tokens=3),
    Case(tokens=1, heads=16, topk=64, context=64, empty_tokens=1),
    Case(tokens=4, heads=20, topk=33, context=40, pad_frac=0.5),
    # block sizes and strides
    Case(tokens=8, heads=16, block_size=256, strided=True),
    Case(tokens=8, heads=16, block_size=256, kv_format=FP8, strided=True),
    Case(tokens=8, heads=64, block_size=64, strided=True, head_size=512),
    # long contexts
    Case(tokens=2, heads=128, context=131072, topk=2048),
    Case(tokens=2, heads=16, context=131072, topk=4096, kv_format=FP8),
    # batches: split-k over few tokens, one pass over many
    Case(tokens=1, heads=16, topk=2048, context=65536),
    Case(tokens=1, heads=128, topk=4096, context=65536, kv_format=FP8),
    Case(tokens=32, heads=16, topk=2048, context=16384, pad_frac=0.1),
    Case(tokens=128, heads=64, topk=2048, context=8192, kv_format=FP8),
    Case(tokens=512, heads=16, topk=2048, context=8192),
    Case(tokens=512, heads=128, topk=512, context=4096, kv_format=FP8, empty_tokens=5),
    # one pass of many tiles through the ring of stages (from 64 heads on: the wgmma
    # path's two stages on Hopper, the 32-head CTAs' ring elsewhere), partial head
    # groups
    Case(tokens=160, heads=65, topk=2048, context=8192),
    Case(tokens=160, heads=100, topk=2048, context=8192, kv_format=FP8, pad_frac=0.1),
    Case(tokens=256, heads=128, topk=2048, context=8192),
    Case(tokens=40, heads=128, topk=4096, context=16384, kv_format=FP8),
    # split-k from 64 heads on: splits longer and shorter than the ring
    Case(tokens=3, heads=65, topk=4096, context=16384, kv_format=FP8),
    Case(tokens=2, heads=100, topk=1000, context=4096, pad_frac=0.2),
    # fewer tiles than the ring's prologue fills (empty commit groups; one partial
    # tile of the wgmma path)
    Case(tokens=5, heads=128, topk=100, context=4096, pad_frac=0.3),
    Case(tokens=5, heads=128, topk=100, context=4096, kv_format=FP8),
    Case(tokens=7, heads=65, topk=33, context=64, kv_format=FP8, empty_tokens=2),
    # Hopper's wgmma path (a CTA per 64 heads from 64 heads on; mma.sync elsewhere):
    # lists that are no multiple of its 64-row tile, one short tile, splits of an odd
    # number of 32-row units (96 rows: a full and a half tile), the peaky softmax
    # rescaled across its tiles, strided fp8 rows with empty tokens
    Case(tokens=2, heads=64, topk=100, context=4096),
    Case(tokens=5, heads=100, topk=17, context=32, pad_frac=0.3),
    Case(tokens=3, heads=128, topk=2048, context=16384, head_size=512),
    Case(tokens=1, heads=65, topk=2016, context=8192, kv_format=FP8),
    Case(tokens=3, heads=128, scale=1.0, context=8192),
    Case(tokens=3, heads=128, scale=1.0, context=8192, kv_format=FP8),
    Case(
        tokens=6,
        heads=64,
        topk=1000,
        context=2048,
        kv_format=FP8,
        block_size=256,
        strided=True,
        empty_tokens=2,
    ),
    # slots outside the cache count as none (never read)
    Case(tokens=4, heads=16, junk_frac=0.2),
    Case(tokens=2, heads=16, junk_frac=0.3, kv_format=FP8, context=65536),
    # peaky softmax: the online max must rescale correctly
    Case(tokens=4, heads=16, scale=1.0),
    Case(tokens=4, heads=16, scale=1.0, kv_format=FP8),
]


def _sampled_cases(n: int) -> list[Case]:
    rng = random.Random(random.SystemRandom().randrange(2**31))
    out = []
    for _ in range(n):
        fmt = rng.choice((BF16, FP8))
        out.append(
            Case(
                tokens=rng.choice((1, 2, 7, 33, 96, 200, 512)),
                heads=rng.choice((1, 16, 17, 32, 64, 65, 100, 128)),
                head_size=576 if fmt == FP8 else rng.choice((576, 512)),
                kv_format=fmt,
                topk=rng.choice((64, 512, 2048, 4096)),
                context=rng.choice((256, 4096, 32768)),
                block_size=rng.choice((64, 256)),
                strided=rng.random() < 0.5,
                pad_frac=rng.choice((0.0, 0.1, 0.6)),
                empty_tokens=rng.choice((0, 0, 1)),
            )
        )
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.ident)
def test_matches_reference(case: Case) -> None:
    errs = check(case)
    assert not errs, "\n".join(errs)


def test_sampled_configurations() -> None:
    errs = []
    for case in _sampled_cases(12):
        errs += check(case)
    assert not errs, "\n".join(errs)


def test_nan_never_passes() -> None:
    """The comparison rejects a NaN output, a wrong value and a missing -inf."""
    case = Case(tokens=2, heads=16, topk=64, context=256, empty_tokens=1)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    cache, nb = make_cache(case, gen)
    idx = make_indices(case, nb, gen)
    q = torch.randn((2, 16, 576), generator=gen, device="cuda").to(torch.bfloat16)
    ref_out, ref_lse = reference(q, cache, idx, case)
    out = ref_out.to(torch.bfloat16)
    assert not compare(case, 1, out, ref_lse.clone(), ref_out, ref_lse, cache)
    bad = out.clone()
    bad[0, 3, 7] = float("nan")
    assert compare(case, 1, bad, ref_lse, ref_out, ref_lse, cache)
    bad = out.clone()
    bad[0, 3, 7] += 1.0
    assert compare(case, 1, bad, ref_lse, ref_out, ref_lse, cache)
    bad_lse = ref_lse.clone()
    bad_lse[torch.isinf(ref_lse)] = 0.0
    assert compare(case, 1, out, bad_lse, ref_out, ref_lse, cache)


@pytest.mark.parametrize("heads", [32, 128])  # mma.sync everywhere; wgmma on Hopper
@pytest.mark.parametrize("kv_format", [BF16, FP8])
@pytest.mark.parametrize("tokens", [2, 200])  # split-k and its combine; one pass
def test_nan_inputs_reach_the_output(kv_format: int, tokens: int, heads: int) -> None:
    """A NaN in q or in a selected row gives NaN (out and lse) where the reference
    has it, never zeros or a finite lse; every other head still matches."""
    case = Case(tokens=tokens, heads=heads, kv_format=kv_format, context=8192)
    gen = torch.Generator(device="cuda")
    seed = random.SystemRandom().randrange(2**31)
    gen.manual_seed(seed)
    cache, nb = make_cache(case, gen)
    idx = make_indices(case, nb, gen)
    q = torch.randn((tokens, heads, 576), generator=gen, device="cuda").to(
        torch.bfloat16
    )
    q[0, 3] = float("nan")  # a whole head
    q[1, 20, 7] = float("nan")  # one value of another
    if heads > 64:
        q[0, 90] = float("nan")  # a head of the second group of 64
    # a NaN in one selected row poisons every head of each token that selected it: a
    # row token 0 did not select, so token 0 keeps finite heads to compare
    chosen = idx[1][idx[1] >= 0]
    slot = int(chosen[~torch.isin(chosen, idx[0])][0])
    row = cache[slot // case.block_size, slot % case.block_size]
    if kv_format == FP8:
        row[mla.FP8_ROPE_OFFSET : mla.FP8_ROPE_OFFSET + 2] = torch.tensor(
            [0xC0, 0x7F], dtype=torch.uint8, device="cuda"
        )  # bf16 NaN in the rope
    else:
        row[100] = float("nan")
    out, lse = run_kernel(q, cache, idx, case)
    ref_out, ref_lse = reference(q, cache, idx, case)
    nan_ref = torch.isnan(ref_lse)
    assert bool(nan_ref[0, 3]) and bool(nan_ref[1].all()), "reference lost the NaN"
    assert torch.equal(torch.isnan(lse), nan_ref), f"seed={seed}: lse NaN pattern"
    assert torch.equal(
        torch.isnan(out.float()).any(-1), torch.isnan(ref_out).any(-1)
    ), f"seed={seed}: out NaN pattern"
    keep = ~nan_ref
    errs = compare(
        case,
        seed,
        out[keep].unsqueeze(0),
        lse[keep].unsqueeze(0),
        ref_out[keep].unsqueeze(0),
        ref_lse[keep].unsqueeze(0),
        cache.masked_fill(torch.isnan(cache), 0) if kv_format == BF16 else cache,
    )
    assert not errs, "\n".join(errs)


@pytest.mark.parametrize("kv_format", [BF16, FP8])
@pytest.mark.parametrize("tokens,heads", [(1, 16), (3, 128), (200, 16)])
def test_graph_replay_matches_eager(kv_format: int, tokens: int, heads: int) -> None:
    """Captured once, replayed on new indices and queries written into the same
    buffers: bit-identical to eager calls (split-k included: (1, 16) and (3, 128))."""
    case = Case(tokens=tokens, heads=heads, kv_format=kv_format, context=8192)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(random.SystemRandom().randrange(2**31))
    cache, nb = make_cache(case, gen)
    q = torch.empty((tokens, heads, 576), dtype=torch.bfloat16, device="cuda")
    idx = torch.empty((tokens, case.topk), dtype=torch.int32, device="cuda")
    out = torch.empty((tokens, heads, mla.LATENT), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((tokens, heads), device="cuda")
    ws = torch.empty(
        (mla.workspace_bytes(tokens, heads, case.topk),),
        dtype=torch.uint8,
        device="cuda",
    )

    def fill():
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        idx.copy_(make_indices(case, nb, gen))

    fill()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        mla.sparse_mla_decode(q, cache, idx, case.scale, kv_format, out, lse, ws)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.sparse_mla_decode(q, cache, idx, case.scale, kv_format, out, lse, ws)
    for _ in range(3):
        fill()
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        g_out, g_lse = out.clone(), lse.clone()
        e_out, e_lse = run_kernel(q, cache, idx, case)
        torch.cuda.synchronize()
        assert not torch.isnan(g_out.float()).any(), f"{case}: NaN after replay"
        assert torch.equal(g_out, e_out), f"{case}: replayed out differs from eager"
        assert torch.equal(g_lse, e_lse), f"{case}: replayed lse differs from eager"
    ref_out, ref_lse = reference(q, cache, idx, case)
    errs = compare(case, -1, g_out, g_lse, ref_out, ref_lse, cache)
    assert not errs, "\n".join(errs)


def _raw(q, cache, idx, fmt, out, lse, ws, scale=0.1):
    torch.ops._C.exl3_sparse_mla_decode(q, cache, idx, scale, fmt, out, lse, ws)


def test_bad_inputs_raise_named_errors() -> None:
    """The C++ checks (through the raw op, past the wrapper) name the argument."""
    t, h = 2, 16
    q = torch.randn((t, h, 576), device="cuda").to(torch.bfloat16)
    cache = torch.randn((4, 64, 576), device="cuda").to(torch.bfloat16)
    idx = torch.zeros((t, 64), dtype=torch.int32, device="cuda")
    out = torch.empty((t, h, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((t, h), device="cuda")
    need = mla.workspace_bytes(t, h, 64)
    ws = torch.empty((max(need, 1),), dtype=torch.uint8, device="cuda")
    _raw(q, cache, idx, BF16, out, lse, ws)  # the good call runs
    cases = [
        ("q must be bfloat16", dict(q=q.half())),
        ("head size must be 576", dict(q=q[..., :448])),
        (
            "heads; 1..128",
            dict(q=torch.zeros((t, 129, 576), dtype=torch.bfloat16, device="cuda")),
        ),
        (
            "last dimension must be contiguous",
            dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)),
        ),
        ("kv_format must be 0", dict(fmt=2)),
        ("fp8_ds_mla kv_cache (kv_format 1) must be uint8", dict(fmt=FP8)),
        ("rows do not match", dict(cache=cache[..., :512])),
        ("kv_cache must be a CUDA tensor", dict(cache=cache.cpu())),
        ("indices must be int32", dict(idx=idx.long())),
        ("indices must be [tokens", dict(idx=idx[:1])),
        ("out must be [", dict(out=out[:, :, :256].contiguous())),
        ("lse must be float32", dict(lse=lse.double())),
        ("scale must be finite", dict(scale=float("inf"))),
    ]
    for needle, kw in cases:
        args = dict(q=q, cache=cache, idx=idx, fmt=BF16, out=out, lse=lse, ws=ws)
        args.update(kw)
        with pytest.raises(RuntimeError, match="exl3_sparse_mla_decode") as ei:
            _raw(**args)
        assert needle in str(ei.value), (needle, str(ei.value))


@pytest.mark.parametrize("t,h", [(1, 16), (2, 128)])
def test_workspace_rule_matches_the_kernel(t: int, h: int) -> None:
    """The wrapper's workspace_bytes is exactly the C++ requirement: one byte less is
    refused, naming the rule (split-k shapes of 16 and 128 heads)."""
    k = 2048
    need = mla.workspace_bytes(t, h, k)
    assert need > 0
    q = torch.randn((t, h, 576), device="cuda").to(torch.bfloat16)
    cache = torch.randn((40, 64, 576), device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 40 * 64, (t, k), dtype=torch.int32, device="cuda")
    out = torch.empty((t, h, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((t, h), device="cuda")
    _raw(
        q,
        cache,
        idx,
        BF16,
        out,
        lse,
        torch.empty(need, dtype=torch.uint8, device="cuda"),
    )
    with pytest.raises(RuntimeError, match="workspace_bytes"):
        _raw(
            q,
            cache,
            idx,
            BF16,
            out,
            lse,
            torch.empty(need - 1, dtype=torch.uint8, device="cuda"),
        )


def test_wrapper_names_the_argument() -> None:
    q = torch.randn((2, 16, 576), device="cuda").to(torch.bfloat16)
    cache = torch.randn((4, 64, 576), device="cuda").to(torch.bfloat16)
    idx = torch.zeros((2, 64), dtype=torch.int32, device="cuda")
    with pytest.raises(mla.SparseMLAInputError, match="indices must be int32"):
        mla.sparse_mla_decode(q, cache, idx.long(), 0.1, BF16)
    with pytest.raises(mla.SparseMLAInputError, match="workspace must be uint8"):
        mla.sparse_mla_decode(
            q, cache, idx, 0.1, BF16, workspace=torch.empty(0, device="cuda")
        )


def _kernel_names(q, cache, idx, case) -> list[str]:
    """The CUDA kernels one call of the op launches."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        run_kernel(q, cache, idx, case)
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages()]


@pytest.mark.skipif(
    torch.cuda.get_device_capability() != (9, 0), reason="Hopper's wgmma path"
)
@pytest.mark.parametrize("kv_format", [BF16, FP8])
def test_hopper_runs_the_wgmma_path_from_64_heads(kv_format: int) -> None:
    """On sm_90 64 heads and more run the wgmma kernel (the reference tests above then
    check it), fewer heads the mma.sync one."""
    for heads, wgmma in ((128, True), (64, True), (32, False)):
        case = Case(tokens=2, heads=heads, kv_format=kv_format, topk=256)
        gen = torch.Generator(device="cuda")
        gen.manual_seed(0)
        cache, nb = make_cache(case, gen)
        idx = make_indices(case, nb, gen)
        q = torch.randn((2, heads, 576), generator=gen, device="cuda").to(
            torch.bfloat16
        )
        names = _kernel_names(q, cache, idx, case)
        ran = [n for n in names if "sparse_mla_decode" in n]
        assert ran, names
        assert any("wgmma" in n for n in ran) == wgmma, (heads, ran)
