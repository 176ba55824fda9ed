# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cold benchmark of the sparse-MLA decode kernel (torch.ops._C.exl3_sparse_mla_decode)
against FLASHMLA_SPARSE, called the way vLLM 0.26's FlashMLASparseImpl calls it.

  * bf16 cache: `flash_mla_sparse_fwd(q, kv.view(-1, 1, 576), indices.view(T, 1, topk),
    scale)`, q padded to a multiple of 64 heads on Hopper (a copy into a padded buffer
    each call, as `_bf16_flash_mla_kernel` does);
  * fp8_ds_mla cache: `flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)`
    with `get_mla_metadata()`, heads padded to 64 or 128; below 32 heads as one batch
    of T query tokens (`_forward_fp8_kv_mixed_batch`), otherwise T requests of one token
    (`_forward_fp8_kv_separate_prefill_decode`'s decode).
Cold: a KV cache of at least --cache-gib (>= 1 GiB, far beyond the 60 MB L2), one query
token per request, each request's context mapped through its own random block table,
and a fresh random top-k selection (distinct positions of the context) for every timed
call: a captured index graph draws it, then the captured attention graph runs and is
timed alone (CUDA events around its replay). Median over --iters replays. % of copy
bandwidth = selected KV bytes (T * topk * row bytes) / time / --copy-tbps.

    python scripts/bench/bench_sparse_mla.py --json OUT.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
H200_COPY_TBPS = 4.12  # measured device-to-device copy bandwidth of the H200
HOPPER_BF16_HEAD_PADDING = 64  # FlashMLASparseImpl.prefill_padding on sm_90
MIN_HEADS_FOR_BF16_PREFILL = 32  # vLLM: below it the fp8 path runs one mixed batch
ROW_BYTES = {"bf16": 576 * 2, "fp8_ds_mla": 656}
FP8_QUANT_CHUNK_ROWS = 1 << 16


def load_wrapper():
    """The op (extension: $VLLM_EXL3_EXT, build/exl3, or vllm._exl3_C) and this
    checkout's wrapper module."""
    for c in (os.environ.get("VLLM_EXL3_EXT"), REPO / "build/exl3/_exl3_C.abi3.so"):
        if c and Path(c).is_file():
            torch.ops.load_library(str(c))
            break
    else:
        importlib.import_module("vllm._exl3_C")
    spec = importlib.util.spec_from_file_location(
        "exl3_sparse_mla", REPO / "overlay/vllm/v1/attention/ops/exl3_sparse_mla.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(torch.ops._C, mod.OP):
        sys.exit(f"the loaded EXL3 extension has no {mod.OP}: rebuild it")
    return mod


def load_flashmla():
    try:
        from vllm.v1.attention.ops import flashmla
    except ImportError as e:
        return None, f"vllm.v1.attention.ops.flashmla: {e}"
    ok, why = flashmla.is_flashmla_sparse_supported()
    return (flashmla, None) if ok else (None, why)


def make_cache(fmt: str, gib: float, block_size: int, mla) -> torch.Tensor:
    rows = math.ceil(gib * (1 << 30) / ROW_BYTES[fmt])
    nb = math.ceil(rows / block_size)
    if fmt == "bf16":
        return torch.randn((nb, block_size, 576), device="cuda").to(torch.bfloat16)
    cache = torch.empty((nb * block_size, 656), dtype=torch.uint8, device="cuda")
    for s in range(0, nb * block_size, FP8_QUANT_CHUNK_ROWS):
        e = min(s + FP8_QUANT_CHUNK_ROWS, nb * block_size)
        cache[s:e] = mla.quantize_fp8_ds_mla(torch.randn((e - s, 576), device="cuda"))
    return cache.view(nb, block_size, 656)


def time_graph(graph: torch.cuda.CUDAGraph, draw: torch.cuda.CUDAGraph, iters: int):
    """Median µs of `graph`'s replay, each after a replay of `draw` (fresh indices)."""
    times = []
    for i in range(iters + 3):
        draw.replay()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        if i >= 3:  # warm-up replays
            times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def capture(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up (FlashMLA builds its scheduler metadata on the first call)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def run_case(fmt, heads, batch, context, topk, cache, block_size, iters, mla, fm):
    t, scale = batch, 192**-0.5
    nb = cache.shape[0]
    blocks = math.ceil(context / block_size)
    tables = torch.randint(0, nb, (t, blocks), device="cuda", dtype=torch.int64)
    q = torch.randn((t, heads, 576), device="cuda").to(torch.bfloat16)
    idx = torch.empty((t, topk), dtype=torch.int32, device="cuda")

    def draw_indices():
        pos = torch.argsort(torch.rand((t, context), device="cuda"), dim=1)[:, :topk]
        blk = torch.gather(tables, 1, pos // block_size)
        idx.copy_(blk * block_size + pos % block_size)

    draw = capture(draw_indices)
    kv_format = mla.KV_FORMAT_BF16 if fmt == "bf16" else mla.KV_FORMAT_FP8_DS_MLA
    out = torch.empty((t, heads, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((t, heads), device="cuda")
    ws = torch.empty(
        (mla.workspace_bytes(t, heads, topk),), dtype=torch.uint8, device="cuda"
    )
    ours = time_graph(
        capture(
            lambda: mla.sparse_mla_decode(q, cache, idx, scale, kv_format, out, lse, ws)
        ),
        draw,
        iters,
    )
    theirs, note = None, None
    if fm is not None:
        try:
            theirs = time_graph(
                capture(flashmla_call(fmt, fm, q, cache, idx, scale)), draw, iters
            )
        except Exception as e:  # noqa: BLE001 - reported in the table
            note = f"FlashMLA failed: {type(e).__name__}: {e}"[:200]
    return ours, theirs, note


def flashmla_call(fmt, fm, q, cache, idx, scale):
    t, heads, d = q.shape
    topk = idx.shape[1]
    if fmt == "bf16":
        padded = math.ceil(heads / HOPPER_BF16_HEAD_PADDING) * HOPPER_BF16_HEAD_PADDING
        q_pad = q.new_empty((t, padded, d))
        kv = cache.view(-1, 1, d)
        idx3 = idx.view(t, 1, topk)

        def call():
            src = q
            if padded != heads:
                q_pad[:, :heads] = q
                src = q_pad
            fm.flash_mla_sparse_fwd(src, kv, idx3, scale)

        return call
    padded = 64 if heads <= 64 else 128
    mixed = heads < MIN_HEADS_FOR_BF16_PREFILL
    batch, seq = (1, t) if mixed else (t, 1)
    q_pad = q.new_zeros((batch, seq, padded, d)) if padded != heads else None
    k_cache = cache.view(torch.uint8).unsqueeze(-2)
    idx4 = idx.view(batch, seq, topk)
    cache_lens = torch.full((batch,), 1 << 20, dtype=torch.int32, device="cuda")
    dummy_table = torch.empty((batch, 1), dtype=torch.int32, device="cuda")
    sched, _ = fm.get_mla_metadata(
        cache_seqlens=cache_lens,
        num_q_tokens_per_head_k=t * padded,
        topk=topk,
        num_heads_q=padded,
        num_heads_k=1,
        is_fp8_kvcache=True,
    )

    def call():
        if q_pad is None:
            src = q.view(batch, seq, heads, d)
        else:
            q_pad.view(t, padded, d)[:, :heads] = q
            src = q_pad
        fm.flash_mla_with_kvcache(
            q=src,
            k_cache=k_cache,
            block_table=dummy_table,
            head_dim_v=512,
            cache_seqlens=cache_lens,
            tile_scheduler_metadata=sched,
            is_fp8_kvcache=True,
            indices=idx4,
            softmax_scale=scale,
        )

    return call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True, help="where to write results")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_ds_mla"])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--cache-gib", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--copy-tbps", type=float, default=H200_COPY_TBPS)
    args = ap.parse_args(argv)
    if args.cache_gib < 1.0:
        ap.error("--cache-gib below 1 GiB is not cold (the L2 is 60 MB)")
    mla = load_wrapper()
    fm, why = load_flashmla()
    if fm is None:
        print(f"FlashMLA unavailable ({why}): timing ours only", file=sys.stderr)
    rows = []
    for fmt in args.formats:
        cache = make_cache(fmt, args.cache_gib, args.block_size, mla)
        for heads in args.heads:
            for context in args.contexts:
                for batch in args.batches:
                    ours, theirs, note = run_case(
                        fmt,
                        heads,
                        batch,
                        context,
                        args.topk,
                        cache,
                        args.block_size,
                        args.iters,
                        mla,
                        fm,
                    )
                    sel = batch * args.topk * ROW_BYTES[fmt]
                    bw = args.copy_tbps * 1e12
                    pct_ours = 100 * sel / (ours * 1e-6) / bw
                    pct_theirs = (
                        None if theirs is None else 100 * sel / (theirs * 1e-6) / bw
                    )
                    rows.append(
                        dict(
                            format=fmt,
                            heads=heads,
                            batch=batch,
                            context=context,
                            topk=args.topk,
                            ours_us=ours,
                            flashmla_us=theirs,
                            ratio=None if theirs is None else ours / theirs,
                            ours_pct_copy_bw=pct_ours,
                            flashmla_pct_copy_bw=pct_theirs,
                            selected_kv_bytes=sel,
                            note=note,
                        )
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del cache
        torch.cuda.empty_cache()

    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    print(
        "| cache | heads | batch | context | ours µs | FlashMLA µs | ours/FlashMLA "
        "| ours % copy BW | FlashMLA % copy BW |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['format']} | {r['heads']} | {r['batch']} | {r['context']} | "
            f"{f(r['ours_us'], '.1f')} | {f(r['flashmla_us'], '.1f')} | "
            f"{f(r['ratio'], '.2f')} | {f(r['ours_pct_copy_bw'], '.0f')} | "
            f"{f(r['flashmla_pct_copy_bw'], '.0f')} |"
        )
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        topk=args.topk,
        block_size=args.block_size,
        cache_gib=args.cache_gib,
        iters=args.iters,
        copy_tbps=args.copy_tbps,
        flashmla=None if fm is not None else why,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
