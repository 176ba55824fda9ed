# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU verification of the EXL3 kernels (torch.ops._C.exl3_linear / exl3_reconstruct).

Oracle: the reference codec of the overlay (reference.forward / reference.reconstruct)
in float64. Every case draws fresh random inputs (the seed is printed), poisons the
output memory with NaN first (the op allocates its output from torch's caching
allocator, so a freed NaN-filled block of the same size is what it gets back), and fails
on any non-finite output.

Error bound (fp16 operands, fp32 accumulation). Rounding a value to a p-bit significand
has a relative RMS error of about 0.21 * 2^-(p-1) (uniform error over an ulp, averaged
over a binade): 2.1e-4 for fp16, 1.65e-3 for bf16. The fused path rounds the transformed
input xh = Ĥ(x * suh) to fp16; the trellis weights are exact fp16; products are exact
and sums are fp32 (k <= 17408 terms: ~sqrt(k) * 2^-24, below 1e-5); the Hadamards are
orthonormal, so relative errors pass through unchanged; the output is rounded once to
its dtype. Expected relative Frobenius error: fused 3e-4 (fp16 out) / 1.7e-3 (bf16 out).
The original-basis reconstruct + cuBLAS path rounds W to the activation dtype instead of
xh, after rounding Ĥ Ŵ to fp16 once between its two tensor-core Hadamard passes: 4e-4
(fp16) / 2.3e-3 (bf16). Bounds:
  rel_fro = ||y - ref|| / ||ref||       <= 2e-3 (fp16), 5e-3 (bf16)
  max_rel = max |y - ref| / rms(ref)    <= 1e-2 (fp16), 6e-2 (bf16)
The max term: the largest of ~1e6-1e7 outputs is ~5.5 rms; its output rounding alone can
reach 2^-8 of it (bf16, bottom of a binade) = 0.021 rms, plus ~5.5 sigma of the W (or
xh) rounding error (0.01-0.02 rms for bf16), so bf16 maxima reach ~0.04; measured worst
0.041 (original-basis path, bf16, m = 4096, with bias; 2 of 11340 matrix cases exceeded
an earlier 4e-2 bound with rel_fro 2.9e-3). A wrong tile, sign or column gives O(1)
errors; a single wrong element of magnitude ~rms fails max_rel.

    python -m vllm_exl3.testing.exl3_oracle [--ext path/_exl3_C.abi3.so] \
        [--quick|--sample]

With --log-plans it prints instead the plan `_C::exl3_linear` runs for every linear of
a checkpoint (default: the 4.0bpw fixture) at every token-count bucket, one line each,
as the layers' load-time preparation resolves them (the checked-in table for this GPU
if the overlay is installed, else the cost model). Two processes' outputs must be
identical (test_exl3_kernels.py runs it twice):

    python -m vllm_exl3.testing.exl3_oracle --log-plans [CHECKPOINT_DIR] \
        [--max-tokens 8192] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..codec import reference
from ..repo import ROOT as REPO
from .fixtures import QWEN3_TINY

TOLERANCE = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (5e-3, 6e-2)}
RATES = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
HALF_RATES = (1.5, 2.5, 3.5)
CODEBOOKS = (0, 1, 2)  # 3INST, MCG, MUL1
CODEBOOK_NAMES = {0: "3inst", 1: "mcg", 2: "mul1"}
M_VALUES = (1, 3, 16, 17, 100, 1000, 4096)
BM_TIERS = (16, 32, 64, 128)
# Tiers of the Hopper wgmma engine (tokens per block), checked where the build and
# device have it.
WGMMA_TIERS = (64, 128, 256)
# Its tiers built with the stream-k grid as well.
STREAM_K_TIERS = (128, 256)
# The op's plan table header (overlay ops.py documents it): version, flags, then the
# pins of VLLM_EXL3_PLAN for the cost model (-1 / 0 = free), reconstruct_m, split-k
# traffic per mille.
PLAN_VERSION = 1
FLAG_DETERMINISTIC, FLAG_BATCH_INVARIANT = 1, 2
BASES = {"original": 1, "rotated": 2}
FREE_HEADER = [PLAN_VERSION, 0, -1, 0, 0, -1, -1, -1, -1, 250]
# Both large-m paths: W in the original basis + one GEMM, or Ŵ + transforms around the
# GEMM.
RECONSTRUCT_PLANS = (
    dict(reconstruct_m=1, reconstruct_basis="original"),
    dict(reconstruct_m=1, reconstruct_basis="rotated"),
)


def combos() -> list[tuple[float, int]]:
    return [
        (b, cb) for b in RATES for cb in CODEBOOKS if b not in HALF_RATES or cb == 2
    ]


def load_extension(path: str | None = None) -> str:
    """Register torch.ops._C.exl3_*, from the first of: an extension named by `path`
    or $VLLM_EXL3_EXT; an installed vLLM's own `_C_stable_libtorch` built with the
    kernels (`build --from-source`); the quick build's build/exl3/_exl3_C.abi3.so; an
    installed vllm._exl3_C. Nothing is loaded when the ops are registered already (a
    second library registering them would be refused)."""
    if hasattr(torch.ops._C, "exl3_linear"):
        return "torch.ops._C (already registered)"
    for c in (path, os.environ.get("VLLM_EXL3_EXT")):
        if c and Path(c).is_file():
            torch.ops.load_library(c)
            return c
    # Without vLLM (or its library) here, the quick build's extension below.
    with contextlib.suppress(ImportError, OSError):
        importlib.import_module("vllm._C_stable_libtorch")
    if hasattr(torch.ops._C, "exl3_linear"):
        return "vllm._C_stable_libtorch"
    quick = REPO / "build" / "exl3" / "_exl3_C.abi3.so"
    if quick.is_file():
        torch.ops.load_library(str(quick))
        return str(quick)
    importlib.import_module("vllm._exl3_C")
    return "vllm._exl3_C"


_WORKSPACE: list[torch.Tensor] = []


def default_header() -> list[int]:
    """The header of the process's settings (VLLM_EXL3_PLAN, VLLM_EXL3_DETERMINISTIC,
    VLLM_BATCH_INVARIANT) when vLLM with the overlay is installed: how the benchmarks
    force a plan. Without it, the free header (the cost model)."""
    try:
        from vllm.model_executor.layers.quantization.exl3 import plans
    except ImportError:
        return list(FREE_HEADER)
    return plans.current_header()


def header(
    deterministic: int = 0,
    batch_invariant: int = 0,
    bm: int = 0,
    split_k: int = 0,
    wgmma: int = -1,
    stream_k: int = -1,
    spread: int = -1,
    reconstruct_m: int = -1,
    reconstruct_basis: str | None = None,
    split_k_traffic: float = 0.25,
) -> list[int]:
    """The op's plan header for these pins (no entries: the cost model applies them)."""
    flags = (FLAG_DETERMINISTIC if deterministic else 0) | (
        FLAG_BATCH_INVARIANT if batch_invariant else 0
    )
    basis = BASES[reconstruct_basis] if reconstruct_basis else -1
    return [
        PLAN_VERSION,
        flags,
        basis,
        bm,
        split_k,
        wgmma,
        stream_k,
        spread,
        reconstruct_m,
        round(split_k_traffic * 1000),
    ]


@contextlib.contextmanager
def knobs(**values: object) -> Iterator[None]:
    """Run the block's ops with these plan pins (header() keywords), restoring
    afterwards."""
    _PLANS.append(header(**values))
    try:
        yield
    finally:
        _PLANS.pop()


_PLANS: list[list[int]] = []


def workspace(floats: int) -> torch.Tensor:
    """A zeroed fp32 split-k workspace of at least `floats` (grown, never shrunk; not
    during CUDA-graph capture, where the op then runs split 1)."""
    capturing = torch.cuda.is_current_stream_capturing()
    if not _WORKSPACE or (_WORKSPACE[0].numel() < floats and not capturing):
        _WORKSPACE[:] = [
            torch.zeros(max(floats, 1), dtype=torch.float32, device="cuda")
        ]
    return _WORKSPACE[0]


# Set inside fake_cuda().
_FAKE: list[bool] = []


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """The block's tensors made with device="cuda" are fake (torch's FakeTensor: a
    CUDA tensor's device, shape and dtype, no memory, no GPU), and exl3_op calls the
    op's CUDA kernel directly with them, so its input checks run on a CPU host. Only
    refusals can be checked so (check_errors): a call the checks accept would go on to
    launch its kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _FAKE.append(True)
    try:
        with FakeTensorMode():
            yield
    finally:
        _FAKE.pop()


def exl3_op(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    bias: torch.Tensor | None,
    widths: list[int],
    codebook: int,
    plans: list[int] | None = None,
) -> torch.Tensor:
    """torch.ops._C.exl3_linear under the current knobs, with a workspace for any
    split.
    """
    if _FAKE:
        # No device to ask for the process's plan settings or a stream to capture.
        cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
        ws = torch.empty(max(1, x.shape[0] * trellis.shape[1] * 16), device="cuda")
        return torch.ops._C.exl3_linear.default.redispatch(
            cuda, x, trellis, suh, svh, bias, widths, codebook, plans or FREE_HEADER, ws
        )
    ws = workspace(x.shape[0] * trellis.shape[1] * 16 if x.is_cuda else 0)
    if plans is None:
        plans = _PLANS[-1] if _PLANS else default_header()
    return torch.ops._C.exl3_linear(
        x, trellis, suh, svh, bias, widths, codebook, plans, ws
    )


@dataclass
class Layer:
    trellis: torch.Tensor
    suh: torch.Tensor  # [S, k]
    svh: torch.Tensor
    widths: list[int]
    codebook: int
    bits: float

    @property
    def k(self) -> int:
        return self.trellis.shape[0] * 16

    @property
    def n(self) -> int:
        return self.trellis.shape[1] * 16

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """torch.ops._C.exl3_linear on this layer."""
        return exl3_op(
            x, self.trellis, self.suh, self.svh, bias, self.widths, self.codebook
        )


def signed_scales(
    gen: torch.Generator, shape: Sequence[int], zeros: int = 0
) -> torch.Tensor:
    mag = 0.5 + torch.rand(shape, generator=gen, device="cuda")
    sign = torch.where(torch.rand(shape, generator=gen, device="cuda") < 0.5, -1.0, 1.0)
    v = (mag * sign).half()
    if zeros:
        # svh is exactly 0 on padded / all-zero output channels (exl3-format.md §6).
        idx = torch.randint(0, v.shape[-1], (zeros,), generator=gen, device="cuda")
        v[..., idx] = 0
    return v


def random_layer(
    gen: torch.Generator, k: int, widths: Sequence[int], bits: float, codebook: int
) -> Layer:
    n = sum(widths)
    trellis = torch.randint(
        -32768,
        32768,
        (k // 16, n // 16, int(16 * bits)),
        generator=gen,
        device="cuda",
        dtype=torch.int32,
    ).to(torch.int16)
    suh = signed_scales(gen, (len(widths), k))
    svh = signed_scales(gen, (n,), zeros=2)
    return Layer(trellis, suh, svh, list(widths), codebook, bits)


def reference_y(
    x: torch.Tensor, layer: Layer, bias: torch.Tensor | None
) -> torch.Tensor:
    return reference.forward(
        x,
        layer.trellis,
        layer.suh,
        layer.svh,
        layer.codebook,
        shard_widths=layer.widths,
        bias=bias,
        dtype=torch.float64,
    )


class ReferenceWeights:
    """float64 W per layer through reference.reconstruct, cached: for the large shapes,
    where re-decoding inside reference.forward for every (m, dtype) would dominate the
    run."""

    def __init__(self, layer: Layer):
        parts, col = [], 0
        for s, width in enumerate(layer.widths):
            t = layer.trellis[:, col // 16 : (col + width) // 16].contiguous()
            parts.append(
                reference.reconstruct(
                    t,
                    layer.suh[s],
                    layer.svh[col : col + width],
                    layer.codebook,
                    dtype=torch.float64,
                )
            )
            col += width
        self.w = torch.cat(parts, dim=1)

    def y(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = x.double() @ self.w
        return y if bias is None else y + bias.double()


def poison_next(shape: Sequence[int], dtype: torch.dtype) -> None:
    """Leave a NaN-filled block of this size in torch's cache for the op's output to
    reuse."""
    t = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del t


def run_op(x: torch.Tensor, layer: Layer, bias: torch.Tensor | None) -> torch.Tensor:
    poison_next((x.shape[0], layer.n), x.dtype)
    return layer.linear(x, bias)


def errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max abs error / rms of ref); inf when y has a
    non-finite."""
    if not bool(torch.isfinite(y).all()):
        return math.inf, math.inf
    d = y.double() - ref
    norm = float(ref.norm())
    rms = norm / math.sqrt(max(ref.numel(), 1))
    if norm == 0.0:
        return (0.0, 0.0) if float(d.abs().max()) == 0.0 else (math.inf, math.inf)
    return float(d.norm()) / norm, float(d.abs().max()) / rms


def within(y: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, float]:
    rel, mx = errors(y, ref)
    tol_rel, tol_max = TOLERANCE[y.dtype]
    return rel <= tol_rel and mx <= tol_max, rel, mx


class Report:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.failures: list[dict] = []

    def add(self, check: str, ok: bool, **info: object) -> None:
        row = {"check": check, "ok": bool(ok), **info}
        self.rows.append(row)
        if not ok:
            self.failures.append(row)
            if len(self.failures) <= 30:
                print("FAIL", json.dumps(row, default=str), flush=True)

    def summary(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.rows:
            s = out.setdefault(
                r["check"],
                {"cases": 0, "failed": 0, "worst_rel": 0.0, "worst_max": 0.0},
            )
            s["cases"] += 1
            s["failed"] += 0 if r["ok"] else 1
            for key, field in (("worst_rel", "rel"), ("worst_max", "max")):
                v = r.get(field)
                if isinstance(v, float) and v > s[key]:
                    s[key] = v
        return out


# -----------------------------------------------------------------------------
# Checks


def check_nan_guard(rep: Report) -> None:
    """The comparison itself must reject NaN and Inf (NaN never passes)."""
    ref = torch.randn(4, 128, dtype=torch.float64, device="cuda")
    for bad in (float("nan"), float("inf")):
        y = ref.to(torch.float16).clone()
        y[1, 7] = bad
        rep.add("nan_guard", not within(y, ref)[0], value=str(bad))


def check_reconstruct(rep: Report, gen: torch.Generator) -> None:
    """exl3_reconstruct == reference.decode_rotated, bit for bit, every rate x
    codebook.
    """
    for bits, cb in combos():
        for k, n in ((256, 384), (128, 1024)):
            layer = random_layer(gen, k, [n], bits, cb)
            got = torch.ops._C.exl3_reconstruct(layer.trellis, cb)
            want = reference.decode_rotated(layer.trellis, cb)
            same = got.dtype == torch.float16 and torch.equal(
                got.view(torch.int16), want.view(torch.int16)
            )
            rep.add(
                "reconstruct_bitexact",
                same,
                bits=bits,
                cb=cb,
                k=k,
                n=n,
                mismatches=int((got.view(torch.int16) != want.view(torch.int16)).sum()),
            )


_WGMMA: list[bool] = []


def wgmma_engine() -> bool:
    """Whether the op has the wgmma engine here: asked by pinning it on a tiny layer."""
    if not _WGMMA:
        tr = torch.zeros(8, 8, 32, dtype=torch.int16, device="cuda")
        ones = torch.ones(1, 128, dtype=torch.half, device="cuda")
        x = torch.zeros(64, 128, dtype=torch.half, device="cuda")
        try:
            with knobs(wgmma=1, bm=64, split_k=1, reconstruct_m=0):
                exl3_op(x, tr, ones, ones[0], None, [128], 1)
            _WGMMA.append(True)
        except RuntimeError as e:
            if "sm_90a build" not in str(e):
                raise
            _WGMMA.append(False)
    return _WGMMA[0]


def fused_plans(splits: Sequence[int]) -> list[dict]:
    """Every tier of every engine this device has, pinned, with each split factor, and
    the wgmma engine's stream-k grid."""
    plans = [
        dict(bm=bm, split_k=s, reconstruct_m=0, wgmma=0)
        for bm in BM_TIERS
        for s in splits
    ]
    if wgmma_engine():
        plans += [
            dict(bm=bm, split_k=s, reconstruct_m=0, wgmma=1)
            for bm in WGMMA_TIERS
            for s in splits
        ]
        plans += [
            dict(bm=bm, stream_k=1, reconstruct_m=0, wgmma=1) for bm in STREAM_K_TIERS
        ]
    return plans


def check_matrix(
    rep: Report,
    gen: torch.Generator,
    m_values: Sequence[int],
    rates: Sequence[tuple[float, int]],
    shard_sets: Sequence[Sequence[int]],
    k: int = 384,
) -> None:
    """Every rate x codebook x shard set x m x dtype x BM tier x {full-k, split-k} and
    the reconstruct path, against reference.forward. Split-k runs back to back on one
    shape, so a workspace left non-zero by one call corrupts the next and fails it."""
    for bits, cb in rates:
        for widths in shard_sets:
            layer = random_layer(gen, k, widths, bits, cb)
            for m in m_values:
                for dtype in (torch.bfloat16, torch.float16):
                    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
                    bias = (
                        torch.randn(layer.n, generator=gen, device="cuda").to(dtype)
                        if (m + cb) % 2
                        else None
                    )
                    ref = reference_y(x, layer, bias)
                    plans = fused_plans((1, 3)) + list(RECONSTRUCT_PLANS)
                    for plan in plans:
                        with knobs(**plan):
                            y = run_op(x, layer, bias)
                        ok, rel, mx = within(y, ref)
                        ok = ok and y.dtype == dtype and tuple(y.shape) == (m, layer.n)
                        rep.add(
                            "matrix",
                            ok,
                            bits=bits,
                            cb=cb,
                            shards=len(widths),
                            m=m,
                            dtype=str(dtype)[6:],
                            bias=bias is not None,
                            plan=plan,
                            rel=rel,
                            max=mx,
                        )


def real_layers() -> list[tuple[int, list[int], float, int]]:
    """(k, shard widths, bits, codebook): the benchmark shapes as fused layers would
    run."""
    return [
        (4096, [4096], 4, 1),
        (5120, [8192, 2048, 2048], 3.5, 2),
        (5120, [8704, 8704], 6, 0),
        (17408, [5120], 2, 1),
        (4096, [11008], 5, 2),
        (4096, [4096], 8, 0),
    ]


def check_real(rep: Report, gen: torch.Generator, m_values: Sequence[int]) -> None:
    """Realistic shapes through the autotuner's own choices (no pins), both dtypes."""
    for k, widths, bits, cb in real_layers():
        layer = random_layer(gen, k, widths, bits, cb)
        rw = ReferenceWeights(layer)
        for m in m_values:
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
                bias = (
                    torch.randn(layer.n, generator=gen, device="cuda").to(dtype)
                    if m % 2
                    else None
                )
                with knobs():
                    y = run_op(x, layer, bias)
                ok, rel, mx = within(y, rw.y(x, bias))
                rep.add(
                    "real_autotuned",
                    ok,
                    k=k,
                    widths=widths,
                    bits=bits,
                    cb=cb,
                    m=m,
                    dtype=str(dtype)[6:],
                    rel=rel,
                    max=mx,
                )
        del rw
        torch.cuda.empty_cache()


def check_splits(rep: Report, gen: torch.Generator) -> None:
    """Every BM tier x a range of split factors on a real shape, repeated with fresh
    inputs; each plan also with its blocks spread (Plan::spread: a launch asking for
    more shared memory than the kernel needs, which the tuner times only where a grid
    can stack blocks, so pinned here for every plan)."""
    layer = random_layer(gen, 4096, [4096], 4, 1)
    rw = ReferenceWeights(layer)
    for m in (1, 17, 100, 1000):
        for plan in [
            dict(p, spread=s) for p in fused_plans((1, 2, 8, 32)) for s in (0, 1)
        ]:
            for rep_i in range(2):
                x = torch.randn(m, 4096, generator=gen, device="cuda").bfloat16()
                with knobs(**plan):
                    y = run_op(x, layer, None)
                ok, rel, mx = within(y, rw.y(x, None))
                rep.add("split_k", ok, m=m, plan=plan, rep=rep_i, rel=rel, max=mx)


def check_determinism(rep: Report, gen: torch.Generator) -> None:
    layer = random_layer(gen, 4096, [2048, 2048], 4, 2)
    for m in (1, 16, 100, 4096):
        x = torch.randn(m, 4096, generator=gen, device="cuda").bfloat16()
        with knobs(deterministic=1):
            outs = [run_op(x, layer, None) for _ in range(3)]
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        rep.add("deterministic_bitexact", same, m=m)


def check_graphs(rep: Report, gen: torch.Generator) -> None:
    """CUDA-graph replay equals eager: bit-exact in deterministic mode, within tolerance
    of the reference otherwise (split-k sums in a run-dependent order)."""
    layer = random_layer(gen, 4096, [4096, 1024], 3, 1)
    rw = ReferenceWeights(layer)
    for det in (1, 0):
        for m in (1, 16, 100, 1000):
            with knobs(**({"deterministic": 1} if det else {})):
                x = torch.randn(m, 4096, generator=gen, device="cuda").bfloat16()
                run_op(x, layer, None)  # eager warm-up: tunes and sizes workspaces
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y_graph = exl3_op(
                        x,
                        layer.trellis,
                        layer.suh,
                        layer.svh,
                        None,
                        layer.widths,
                        layer.codebook,
                    )
                x.copy_(torch.randn(m, 4096, generator=gen, device="cuda").bfloat16())
                y_graph.fill_(float("nan"))
                graph.replay()
                y_eager = run_op(x, layer, None)
                torch.cuda.synchronize()
                ok, rel, mx = within(y_graph.clone(), rw.y(x, None))
                if det:
                    ok = ok and torch.equal(y_graph, y_eager)
                rep.add("cuda_graph", ok, deterministic=det, m=m, rel=rel, max=mx)
                del graph


def check_errors(rep: Report) -> None:
    """Bad inputs raise RuntimeError naming the tensor and the rule broken."""
    dev = "cuda"
    k, n = 256, 256
    tr = torch.zeros(k // 16, n // 16, 64, dtype=torch.int16, device=dev)
    suh = torch.ones(1, k, dtype=torch.half, device=dev)
    svh = torch.ones(n, dtype=torch.half, device=dev)
    x = torch.zeros(4, k, dtype=torch.bfloat16, device=dev)
    op = exl3_op
    cases = {
        "x must be bfloat16 or float16": lambda: op(
            x.float(), tr, suh, svh, None, [n], 1
        ),
        "input features": lambda: op(
            x[:, :128].contiguous(), tr, suh, svh, None, [n], 1
        ),
        "x must be contiguous": lambda: op(
            x.t().contiguous().t(), tr, suh, svh, None, [n], 1
        ),
        "trellis width 72": lambda: op(
            x,
            torch.zeros(16, 16, 72, dtype=torch.int16, device=dev),
            suh,
            svh,
            None,
            [n],
            1,
        ),
        "exist only with the MUL1": lambda: op(
            x,
            torch.zeros(16, 16, 40, dtype=torch.int16, device=dev),
            suh,
            svh,
            None,
            [n],
            1,
        ),
        "codebook must be": lambda: op(x, tr, suh, svh, None, [n], 3),
        "trellis must be int16": lambda: op(x, tr.half(), suh, svh, None, [n], 1),
        "sum to": lambda: op(x, tr, suh, svh, None, [128], 1),
        "multiple of 128": lambda: op(
            x, tr, suh.expand(2, k).contiguous(), svh, None, [64, 192], 1
        ),
        "suh has 1 rows but shard_widths has 2": lambda: op(
            x, tr, suh, svh, None, [128, 128], 1
        ),
        "suh must be float16": lambda: op(x, tr, suh.float(), svh, None, [n], 1),
        "does not match n": lambda: op(
            x, tr, suh, svh[:128].contiguous(), None, [n], 1
        ),
        "bias must have x's dtype": lambda: op(x, tr, suh, svh, svh, [n], 1),
        "must be a CUDA tensor": lambda: op(x, tr, suh.cpu(), svh, None, [n], 1),
        "multiples of 128": lambda: op(
            x[:, :64].contiguous(),
            torch.zeros(4, 16, 64, dtype=torch.int16, device=dev),
            suh[:, :64].contiguous(),
            svh,
            None,
            [n],
            1,
        ),
    }
    for needle, call in cases.items():
        try:
            call()
            rep.add("input_validation", False, expect=needle, got="no error")
        except RuntimeError as e:
            rep.add(
                "input_validation", needle in str(e), expect=needle, got=str(e)[:300]
            )


def sanitizer_sample(rep: Report, gen: torch.Generator) -> None:
    """A representative sample for compute-sanitizer (memcheck / racecheck): every
    kernel kind, a few rates, ragged m, several shards, full-k and split-k, both dtypes.
    """
    for bits, cb in ((1, 0), (2.5, 2), (4, 1), (8, 2)):
        layer = random_layer(gen, 256, [128, 256], bits, cb)
        torch.ops._C.exl3_reconstruct(layer.trellis, cb)
        for m in (1, 17):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(m, 256, generator=gen, device="cuda").to(dtype)
                bias = torch.randn(layer.n, generator=gen, device="cuda").to(dtype)
                ref = reference_y(x, layer, bias)
                wg = (
                    (
                        dict(bm=64, split_k=2, reconstruct_m=0, wgmma=1),
                        dict(bm=64, split_k=1, reconstruct_m=0, wgmma=1, spread=1),
                        dict(bm=256, split_k=1, reconstruct_m=0, wgmma=1),
                        dict(bm=128, stream_k=1, reconstruct_m=0, wgmma=1),
                    )
                    if wgmma_engine()
                    else ()
                )
                for plan in (
                    dict(bm=16, split_k=1, reconstruct_m=0, wgmma=0),
                    dict(bm=16, split_k=2, reconstruct_m=0, wgmma=0, spread=1),
                    dict(bm=32, split_k=2, reconstruct_m=0, wgmma=0),
                    dict(bm=128, split_k=1, reconstruct_m=0, wgmma=0),
                    *wg,
                    *RECONSTRUCT_PLANS,
                ):
                    with knobs(**plan):
                        y = run_op(x, layer, bias)
                    ok, rel, mx = within(y, ref)
                    rep.add(
                        "sanitizer_sample",
                        ok,
                        bits=bits,
                        cb=cb,
                        m=m,
                        plan=plan,
                        rel=rel,
                    )


PLAN_FIXTURE = QWEN3_TINY / "exl3-4.0bpw"


def _codebook_of(tensors: set[str], prefix: str) -> int:
    if f"{prefix}.mul1" in tensors:
        return 2
    if f"{prefix}.mcg" in tensors:
        return 1
    return 0


def log_plans(checkpoint: Path, max_tokens: int, dtype: torch.dtype) -> None:
    """Print every linear's plan at every token-count bucket (see the module doc)."""
    from safetensors import safe_open

    try:
        from vllm.model_executor.layers.quantization.exl3 import plan_table
        from vllm.model_executor.layers.quantization.exl3 import plans as overlay_plans
    except ImportError:
        overlay_plans = None
    device = torch.device("cuda", torch.cuda.current_device())
    buckets = [1]
    while buckets[-1] < max_tokens:
        buckets.append(buckets[-1] * 2)
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names = set(st.keys())
            for name in sorted(n for n in names if n.endswith(".trellis")):
                prefix = name.removesuffix(".trellis")
                trellis = st.get_tensor(name).to(device)
                cb = _codebook_of(names, prefix)
                k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
                bits = trellis.shape[2] / 16
                if overlay_plans is not None:
                    key = plan_table.layer_key(k, n, bits, cb, 1, dtype)
                    table = overlay_plans.layer_plans(key, device)
                else:
                    key, table = f"k={k},n={n},bits={bits:g},codebook={cb}", header()
                for m in buckets:
                    plan = torch.ops._C.exl3_plan(
                        trellis, 1, cb, dtype == torch.bfloat16, m, table, 1 << 27
                    )
                    print(f"{prefix} {key} m<={m}: {list(plan)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ext", default=None, help="path of _exl3_C.abi3.so")
    ap.add_argument(
        "--log-plans",
        nargs="?",
        const=PLAN_FIXTURE,
        type=Path,
        metavar="CHECKPOINT_DIR",
        help="only print the plans of a checkpoint's linears",
    )
    ap.add_argument("--max-tokens", type=int, default=8192, help="with --log-plans")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16"),
        help="with --log-plans",
    )
    ap.add_argument(
        "--sample", action="store_true", help="only the compute-sanitizer sample"
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer m values in the full matrix"
    )
    ap.add_argument("--json", type=Path, default=None, help="write all rows here")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    if args.log_plans is not None:
        load_extension(args.ext)
        log_plans(args.log_plans, args.max_tokens, getattr(torch, args.dtype))
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    ext = load_extension(args.ext)
    seed = args.seed if args.seed is not None else int(time.time_ns() % (1 << 31))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    print(
        f"extension {ext}; device {torch.cuda.get_device_name()}; seed {seed}; "
        f"wgmma engine {'yes' if wgmma_engine() else 'no'}",
        flush=True,
    )
    rep = Report()
    t0 = time.monotonic()
    if args.sample:
        sanitizer_sample(rep, gen)
    else:
        steps = [
            ("nan_guard", lambda: check_nan_guard(rep)),
            ("input_validation", lambda: check_errors(rep)),
            ("reconstruct", lambda: check_reconstruct(rep, gen)),
            (
                "matrix",
                lambda: check_matrix(
                    rep,
                    gen,
                    (1, 17, 100) if args.quick else M_VALUES,
                    combos(),
                    ([256], [128, 128], [128, 128, 128]),
                ),
            ),
            ("split_k", lambda: check_splits(rep, gen)),
            ("determinism", lambda: check_determinism(rep, gen)),
            ("cuda_graph", lambda: check_graphs(rep, gen)),
            (
                "real",
                lambda: check_real(rep, gen, (1, 17, 1000) if args.quick else M_VALUES),
            ),
        ]
        for name, step in steps:
            t = time.monotonic()
            try:
                step()
            except (
                Exception
            ) as e:  # a crash in one check must not hide the others' results
                rep.add(
                    name + "_crashed", False, error=f"{type(e).__name__}: {e}"[:500]
                )
            print(f"[{name}] {time.monotonic() - t:.1f} s", flush=True)
    summary = rep.summary()
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "seed": seed,
                    "device": torch.cuda.get_device_name(),
                    "summary": summary,
                    "failures": rep.failures[:200],
                },
                indent=1,
                default=str,
            )
        )
    print(
        f"\n{'check':24s} {'cases':>6s} {'failed':>6s} {'worst rel':>10s} "
        f"{'worst max':>10s}"
    )
    for name, s in summary.items():
        print(
            f"{name:24s} {s['cases']:6d} {s['failed']:6d} {s['worst_rel']:10.2e} "
            f"{s['worst_max']:10.2e}"
        )
    total_fail = sum(s["failed"] for s in summary.values())
    print(
        f"{'ALL PASS' if total_fail == 0 else f'{total_fail} FAILED'} "
        f"({time.monotonic() - t0:.0f} s, seed {seed})"
    )
    return 0 if total_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
