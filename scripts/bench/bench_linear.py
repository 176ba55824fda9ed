# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cold benchmark of exl3_linear against ExLlamaV3 1.6.5's LinearEXL3, bf16
torch.matmul and vLLM's int4 Marlin GEMM (GPTQ 4-bit, group 128, as vLLM's
MarlinLinearKernel calls it).

The op runs with the plans vLLM's layer passes by default (plans.layer_plans: the
device's table for the layer key, else the cost model); each row says which. Shapes are
the benchmark's five or, with --models, every linear run of those models at --tp
(model_shapes.py: fused shards as the loader lays them out).

Method (design.md "Measuring", anchors-h200.md):
  * cold: each variant rotates through enough weight copies that one pass reads >=
    POOL_BYTES (several times the 60 MB L2), so every weight comes from HBM;
  * every call of a pass is captured in one CUDA graph (launch gaps as in vLLM's
    graphs); the time is the median over graph replays divided by the calls per pass
    (CUDA events);
  * the ceilings (copy bandwidth, cuBLAS bf16, mma.sync, integer issue) are measured in
    the same run (device_ceilings.py);
  * speed of light = max(bytes / copy bandwidth,
                         k*n * decode time per weight,
                         2*m*k*n / best matrix rate)
    where bytes = trellis (k*n*bits/8) + x + y; decode time per weight =
    max(instructions per weight / issue rate, ALU or FMA-pipe instructions per weight /
    one pipe's rate), from the SASS counts of the GEMM's k loop (sass_loop.py), the
    issue rate from the SM count and clock, one pipe's rate measured
    (device_ceilings.int_rate); the best matrix rate is max(mma.sync, cuBLAS bf16). %SOL
    = 100 * SOL / ours.
ExLlamaV3 runs on the same tensors (fp16 activations, its own dispatch); which of its
paths ran is read from the profiler's kernel names once per (codebook, m).

    python scripts/bench/bench_linear.py --out DIR [--no-exl3] [--bits 4 6]
    python scripts/bench/bench_linear.py --out DIR --no-exl3 --models qwen3-8b --tp 1

With --interleaved: ours against bf16 torch.matmul at large m, timed in alternation. At
m >= 1024 the H200 runs at its power cap (~690 of 700 W) and its SM clock drifts with
the load's history (1455-1530 MHz sustained against 1980 boost), so a bf16 time taken
minutes before ours measures a different card. Both graphs are built once (cold
rotation as above) and timed in INTERLEAVED_ROUNDS alternating rounds (CUDA-event
medians); the ratio is the median of the per-round ratios. The first of --bits and
--codebooks is used; the rows go to DIR/<tag>_interleaved.json.

    python scripts/bench/bench_linear.py --interleaved --out DIR --m 1024 2048 4096
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from vllm_exl3.bench import device_ceilings, exllamav3_anchor, model_shapes
from vllm_exl3.codec import plan_table
from vllm_exl3.testing.exl3_oracle import REPO, exl3_op, load_extension, random_layer

SHAPES = ((5120, 12288), (5120, 17408), (17408, 5120), (4096, 4096), (4096, 11008))
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# One pass reads at least this many weight bytes: > 4x the H200's 60 MB L2.
POOL_BYTES = 256 << 20
MIN_COPIES = 2
REPLAYS = 15
CB_NAMES = {0: "3inst", 1: "mcg", 2: "mul1"}
# The int4 path users pick instead: GPTQ 4-bit with groups of 128 rows (one bf16 scale
# per group and column), symmetric (uint4b8), on vLLM's Marlin GEMM.
MARLIN_BITS = 4
MARLIN_GROUP = 128
# Marlin's packing: int32 words per 16 k-rows and column (16 rows x 4 bits / 32).
MARLIN_WORDS_PER_TILE_COLUMN = 16 * MARLIN_BITS // 32
# Scales small enough that the random int4 weights give finite outputs.
MARLIN_SCALE = 0.01
MCG_MARKER = -877912083
MUL1_MARKER = -2082680531


# A short pass of light work is timed in whatever power state the work before it left:
# on the H200, right after an m = 4096 GEMM, light work runs up to 25 % slower for
# 0.1-0.25 s (5120x12288 6-bit m = 1, pinned plan: 34.1 us right after it, 29.2 after
# 0.1 s idle, 27.8 after 0.25 s, 27.1 fresh), and an anchor run that timed every point
# right after the previous one had ours at m <= 16 10-25 % above a run that idled
# first. So every light point (m <= LIGHT_M) of every variant starts from SETTLE_S of
# idle: the state of steady light work (decode), whatever ran before. m = 128 and 256
# count as light too: a point takes well under the slow window there, and the m = 128
# point of 5120x17408, timed right after the previous shape's m = 4096, once came out
# 17 % slower than in a run before it (same kernels, every tuner candidate alike).
SETTLE_S = 0.25
LIGHT_M = 256
# Alternating rounds of --interleaved: enough for a median that one throttled round
# does not move.
INTERLEAVED_ROUNDS = 5


def settle(m: int) -> None:
    if m <= LIGHT_M:
        torch.cuda.synchronize()
        time.sleep(SETTLE_S)


def copies_for(bytes_per_copy: int) -> int:
    return max(MIN_COPIES, math.ceil(POOL_BYTES / bytes_per_copy))


def cold_bf16(gen: torch.Generator, k: int, n: int) -> list[torch.Tensor]:
    """Random bf16 [k][n] weights, enough copies that a pass over them reads HBM, not
    L2."""
    return [
        torch.randn(k, n, generator=gen, device="cuda").bfloat16()
        for _ in range(copies_for(2 * k * n))
    ]


def cold_layers(
    gen: torch.Generator,
    k: int,
    n: int,
    bits: float,
    cb: int,
    widths: Sequence[int] | None = None,
) -> list:
    """Random EXL3 layers [k][n] (one shard, or shards of `widths` summing to n), enough
    copies that a pass reads trellis from HBM."""
    return [
        random_layer(gen, k, list(widths or [n]), bits, cb)
        for _ in range(copies_for(int(k * n * bits / 8)))
    ]


def warm_capture(calls: list) -> torch.cuda.CUDAGraph:
    """Two eager calls (the op's tuner runs here, not in capture), then capture()."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    return capture(calls)


def capture(calls: list) -> torch.cuda.CUDAGraph:
    """One CUDA graph of `calls` in order (the caller has run them eagerly first:
    autotuners never run during capture)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph


def graph_time_us(calls: list, m: int, use_graph: bool = True) -> tuple[float, str]:
    """Median microseconds per call of a pass over `calls` (closures of m rows each),
    and how it was timed."""
    settle(m)
    # Every call once eagerly, not a sample: autotuners, and state read lazily per
    # weight set (the MoE kernel class reads each layer's bitrate table on its first
    # eager call; a layer first seen under capture launches every rate), run here,
    # never in capture.
    for c in calls:
        c()
    torch.cuda.synchronize()
    mode = "graph"
    if use_graph:
        try:
            run = capture(calls).replay
        except Exception as e:  # noqa: BLE001 - report and fall back to eager passes
            mode = f"eager ({type(e).__name__})"
            print(f"    graph capture failed, timed eagerly: {mode}: {str(e)[:200]}")
            torch.cuda.synchronize()
            run = lambda: [c() for c in calls]  # noqa: E731
    else:
        mode = "eager"
        run = lambda: [c() for c in calls]  # noqa: E731
    return device_ceilings.median_ms(run, REPLAYS) * 1e3 / len(calls), mode


def bf16_times(gen: torch.Generator, k: int, n: int, ms: list[int]) -> dict[int, float]:
    """Cold bf16 torch.matmul time per m on a [k][n] weight (same rotation as ours)."""
    out = {}
    w_copies = cold_bf16(gen, k, n)
    for m in ms:
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        out[m], _ = graph_time_us(
            [lambda w=w, x=x: torch.matmul(x, w) for w in w_copies], m
        )
    del w_copies
    torch.cuda.empty_cache()
    return out


def marlin_times(
    gen: torch.Generator, k: int, n: int, ms: list[int]
) -> dict[int, float]:
    """Cold time per m of vLLM's int4 Marlin GEMM on a [k][n] GPTQ weight (random
    packed words: the kernel's time does not depend on the values), called as vLLM's
    MarlinLinearKernel.apply_weights calls it (apply_gptq_marlin_linear, its workspace,
    its atomic-add and fp32-reduce choices)."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils as mu
    from vllm.scalar_type import scalar_types

    dev = torch.device("cuda")
    workspace = mu.marlin_make_workspace_new(dev)
    empty = mu.marlin_make_empty_g_idx(dev)
    weights = [
        (
            torch.randint(
                -(2**31),
                2**31 - 1,
                (k // 16, n * MARLIN_WORDS_PER_TILE_COLUMN),
                generator=gen,
                device="cuda",
                dtype=torch.int32,
            ),
            (
                torch.rand(k // MARLIN_GROUP, n, generator=gen, device="cuda")
                * MARLIN_SCALE
            ).bfloat16(),
        )
        for _ in range(copies_for(k * n * MARLIN_BITS // 8))
    ]
    out = {}
    for m in ms:
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        out[m], _ = graph_time_us(
            [
                lambda w=w, s=s, x=x: mu.apply_gptq_marlin_linear(
                    x,
                    w,
                    s,
                    empty,
                    empty,
                    empty,
                    workspace,
                    scalar_types.uint4b8,
                    output_size_per_partition=n,
                    input_size_per_partition=k,
                    is_k_full=True,
                )
                for w, s in weights
            ],
            m,
        )
    del weights
    torch.cuda.empty_cache()
    return out


def vllm_plans(
    k: int, widths: Sequence[int], bits: float, cb: int
) -> tuple[list[int], str]:
    """The op's `plans` argument as vLLM's layer passes it for this run by default
    (plans.layer_plans), and where it came from ("table" or "cost-model")."""
    from vllm.model_executor.layers.quantization.exl3 import plans

    key = plan_table.layer_key(k, sum(widths), bits, cb, len(widths), torch.bfloat16)
    dev = torch.device("cuda")
    return plans.layer_plans(key, dev), plans.table_entries(key, dev)[1]


def bench_shapes(args: argparse.Namespace) -> list[tuple[int, tuple[int, ...], str]]:
    """(k, shard widths, where it occurs) of every run to time."""
    if not args.models:
        out = []
        for shape in args.shapes:
            k, n = (int(v) for v in shape.split("x"))
            out.append((k, (n,), "bench"))
        return out
    shapes, skipped = model_shapes.collect(model_shapes.resolve(args.models), args.tp)
    for line in skipped:
        print(f"skipped: {line}", flush=True)
    return [(s.k, tuple(s.widths), "; ".join(s.sources[:3])) for s in shapes]


def rebase_on_second_bf16(rows: list[dict], second: dict[int, float]) -> None:
    """bf16 is timed before a shape's configurations and again after them; the rows keep
    the faster of the two (the ratio against bf16 never gains from the GPU's clock
    drifting between them: a sustained heavy run heats the card and lowers its clocks),
    and both times."""
    for r in rows:
        first = r["bf16_us"]
        best = min(first, second[r["m"]])
        r["bf16_first_us"], r["bf16_second_us"] = first, round(second[r["m"]], 2)
        r["bf16_us"] = round(best, 2)
        r["ratio_bf16"] = round(r["ours_us"] / best, 3)


def exl3_module(state: Path | None, wait_s: float, import_timeout_s: float):
    """ExLlamaV3's LinearEXL3, or None (with the reason printed). With `state`, the
    extension was built in the background by exllamav3_anchor.py and is imported under
    its guard; without, a plain import (which JIT-builds in this process)."""
    try:
        if state is not None:
            return exllamav3_anchor.load_linear_class(state, wait_s, import_timeout_s)
        from exllamav3.modules.quant.exl3 import LinearEXL3

        return LinearEXL3
    except Exception as e:  # noqa: BLE001 - the benchmark of our kernels goes on without it
        print(
            f"ExLlamaV3 unavailable: {type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        return None


def exl3_linears(cls, layers: list, k: int, n: int, cb: int) -> list:
    out = []
    for lay in layers:
        marker = {1: ("mcg", MCG_MARKER), 2: ("mul1", MUL1_MARKER)}.get(cb)
        kw = {}
        if marker:
            kw[marker[0]] = torch.tensor(marker[1], dtype=torch.int32, device="cuda")
        out.append(
            cls(
                None,
                k,
                n,
                suh=lay.suh[0],
                svh=lay.svh,
                trellis=lay.trellis,
                out_dtype=torch.half,
                **kw,
            )
        )
    return out


def exl3_kernels(lin, x) -> str:
    """Names of the CUDA kernels one ExLlamaV3 forward launched (which path ran)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lin.forward(x, {})
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            short = e.name.split("(")[0].split("<")[0].replace("void ", "")[:40]
            if short not in names:
                names.append(short)
    return "+".join(names)


def write_results(
    out: Path, tag: str, meta: dict, rows: list[dict], paths: dict
) -> str:
    """The machine-readable results (JSON with metadata and ExLlamaV3 paths, CSV of the
    rows)."""
    stamp = f"{tag}_{meta['date']}"
    (out / f"{stamp}.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "exl3_paths": {
                    f"{sh} {CB_NAMES[c]} {b:g}b m={m}": p
                    for (sh, c, b, m), p in paths.items()
                },
                "rows": rows,
            },
            indent=1,
            default=str,
        )
    )
    write_csv(out / f"{stamp}.csv", rows)
    return stamp


def write_csv(path: Path, rows: list[dict]) -> None:
    """The rows' comparable columns, one line per configuration."""
    fields = [
        "k",
        "n",
        "bits",
        "codebook",
        "m",
        "shards",
        "plans",
        "ours_us",
        "exllamav3_us",
        "bf16_us",
        "marlin_us",
        "pct_sol",
        "exl3_path",
    ]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def decode_s_per_weight(loop: dict | None, ceil: dict) -> float | None:
    """Seconds per decoded weight of the k loop: its instructions against the issue
    rate, and its ALU and FMA-pipe instructions each against one pipe's rate (the
    measured integer rate)."""
    if not loop or not loop.get("per_weight") or not ceil.get("int_instr_per_s"):
        return None
    per_weight = loop["per_weight"]
    weights_per_stage = loop["per_stage"] / per_weight
    pipes = [
        loop.get("by_pipe", {}).get(p, 0.0) / weights_per_stage for p in ("alu", "fma")
    ]
    terms = [max(pipes) / ceil["int_instr_per_s"]]
    if ceil.get("issue_instr_per_s"):
        terms.append(per_weight / ceil["issue_instr_per_s"])
    return max(terms)


def sol_us(k: int, n: int, m: int, bits: float, ceil: dict, loop: dict | None) -> float:
    bytes_ = k * n * bits / 8 + 2 * m * k + 2 * m * n
    terms = [bytes_ / ceil["copy_bytes_per_s"]]
    s_per_weight = decode_s_per_weight(loop, ceil)
    if s_per_weight:
        terms.append(k * n * s_per_weight)
    rate = max(r for r in (ceil.get("mma_flops"), ceil["bf16_flops"]) if r)
    terms.append(2 * m * k * n / rate)
    return max(terms) * 1e6


def interleaved(args: argparse.Namespace) -> list[dict]:
    """Ours and bf16 at each m, in INTERLEAVED_ROUNDS alternating rounds (--interleaved;
    see the module doc)."""
    bits, cb = args.bits[0], args.codebooks[0]
    gen = torch.Generator(device="cuda").manual_seed(77)
    rows = []
    print(
        f"{'shape':>11} {'m':>5} {'ours':>8} {'bf16':>8} {'ratio':>6}  per-round ratios"
    )
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        w = cold_bf16(gen, k, n)
        layers = cold_layers(gen, k, n, bits, cb)
        for m in args.m:
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            g_bf16 = warm_capture([lambda w_=w_, x=x: torch.matmul(x, w_) for w_ in w])
            g_ours = warm_capture([lambda L=L, x=x: L.linear(x) for L in layers])
            ours, bf16 = [], []
            for _ in range(INTERLEAVED_ROUNDS):
                bf16.append(
                    device_ceilings.median_ms(g_bf16.replay, REPLAYS) * 1e3 / len(w)
                )
                ours.append(
                    device_ceilings.median_ms(g_ours.replay, REPLAYS)
                    * 1e3
                    / len(layers)
                )
            ratios = [o / b for o, b in zip(ours, bf16)]
            row = {
                "k": k,
                "n": n,
                "m": m,
                "bits": bits,
                "codebook": cb,
                "ours_us": statistics.median(ours),
                "bf16_us": statistics.median(bf16),
                "ratio": statistics.median(ratios),
                "ours_rounds": ours,
                "bf16_rounds": bf16,
            }
            rows.append(row)
            print(
                f"{shape:>11} {m:5d} {row['ours_us']:8.1f} {row['bf16_us']:8.1f} "
                f"{row['ratio']:6.3f}  " + " ".join(f"{r:.3f}" for r in ratios),
                flush=True,
            )
            del g_bf16, g_ours
        del w, layers
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ext", default=None)
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "bench-results"))
    )
    ap.add_argument("--tag", default="bench_linear")
    ap.add_argument("--bits", type=float, nargs="+", default=[4, 6, 2, 3, 5])
    ap.add_argument("--codebooks", type=int, nargs="+", default=[1, 0, 2])
    ap.add_argument("--m", type=int, nargs="+", default=list(M_VALUES))
    ap.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES])
    ap.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="time the linear runs of these models (model_shapes.py names, or all) "
        "instead of --shapes",
    )
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--no-exl3", action="store_true")
    ap.add_argument("--no-marlin", action="store_true")
    ap.add_argument(
        "--exl3-state",
        type=Path,
        default=None,
        help="folder of exllamav3_anchor.py's background build (site/, torch_ext/)",
    )
    ap.add_argument(
        "--exl3-wait-s",
        type=float,
        default=300,
        help="how long to wait for that build to finish",
    )
    ap.add_argument("--exl3-import-timeout-s", type=float, default=120)
    ap.add_argument(
        "--sass-json",
        type=Path,
        default=None,
        help="instructions per weight from sass_loop.py",
    )
    ap.add_argument(
        "--budget-s", type=float, default=1e9, help="stop starting configs after this"
    )
    ap.add_argument(
        "--interleaved",
        action="store_true",
        help="only ours against bf16, timed in alternating rounds (large m)",
    )
    args = ap.parse_args(argv)
    if args.interleaved:
        load_extension(args.ext)
        rows = interleaved(args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.tag}_interleaved.json").write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "rounds": INTERLEAVED_ROUNDS,
                    "rows": rows,
                },
                indent=1,
            )
        )
        return 0
    t_start = time.monotonic()
    ext = load_extension(args.ext)
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(time.time_ns() % (1 << 31)))
    ceil = device_ceilings.measure()
    loops = {}
    if args.sass_json and args.sass_json.is_file():
        loops = json.loads(args.sass_json.read_text())
    exl3_cls = (
        None
        if args.no_exl3
        else exl3_module(args.exl3_state, args.exl3_wait_s, args.exl3_import_timeout_s)
    )
    # The caller's word first: on the device machine the tree's .git can be a stale
    # copy (the 2026-11-30 runs reported an older commit than the kernels they timed).
    commit = os.environ.get("EXL3_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
            ).stdout.strip()
        except OSError:
            commit = ""
    commit = commit or "unknown"
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "command": " ".join(["bench_linear.py", *(argv or sys.argv[1:])]),
        "extension": ext,
        "ceilings": ceil,
        "pool_bytes": POOL_BYTES,
        "replays": REPLAYS,
        "exllamav3": "1.6.5" if exl3_cls else "unavailable",
    }
    print(json.dumps(meta, default=str), flush=True)
    rows, paths = [], {}
    args.out.mkdir(parents=True, exist_ok=True)

    for k, widths, where in bench_shapes(args):
        n = sum(widths)
        shape = f"{k}x{n}" + (f"/{len(widths)}" if len(widths) > 1 else "")
        if time.monotonic() - t_start > args.budget_s:
            break
        bf16_us = bf16_times(gen, k, n, args.m)
        marlin_us = None if args.no_marlin else marlin_times(gen, k, n, args.m)
        shape_rows = []
        for bits in args.bits:
            for cb in args.codebooks:
                if bits % 1 and cb != 2:
                    continue
                if time.monotonic() - t_start > args.budget_s:
                    print("time budget reached, stopping", flush=True)
                    break
                layers = cold_layers(gen, k, n, bits, cb, widths)
                plans_arg, plan_source = vllm_plans(k, widths, bits, cb)
                exl3_lins = (
                    exl3_linears(exl3_cls, layers, k, n, cb) if exl3_cls else None
                )
                for m in args.m:
                    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
                    ours, mode = graph_time_us(
                        [
                            lambda L=L, x=x, p=plans_arg: exl3_op(
                                x,
                                L.trellis,
                                L.suh,
                                L.svh,
                                None,
                                L.widths,
                                L.codebook,
                                p,
                            )
                            for L in layers
                        ],
                        m,
                    )
                    ex_us, ex_mode = None, None
                    if exl3_lins:
                        xh = x.half()
                        try:
                            ex_us, ex_mode = graph_time_us(
                                [
                                    lambda lin=lin, xh=xh: lin.forward(xh, {})
                                    for lin in exl3_lins
                                ],
                                m,
                            )
                            # Which of its paths ran (kernel names), per shape, cb,
                            # bits, m.
                            key = (shape, cb, bits, m)
                            if key not in paths:
                                paths[key] = exl3_kernels(exl3_lins[0], xh)
                        except Exception as e:  # noqa: BLE001
                            ex_mode = f"failed: {type(e).__name__}: {str(e)[:100]}"
                    sol = sol_us(k, n, m, bits, ceil, loops.get(f"{bits:g}:{cb}"))
                    mar = marlin_us[m] if marlin_us else None
                    row = {
                        "k": k,
                        "n": n,
                        "shards": len(widths),
                        "where": where,
                        "plans": plan_source,
                        "bits": bits,
                        "codebook": CB_NAMES[cb],
                        "m": m,
                        "ours_us": round(ours, 2),
                        "exllamav3_us": round(ex_us, 2) if ex_us else None,
                        "bf16_us": round(bf16_us[m], 2),
                        "ratio_bf16": round(ours / bf16_us[m], 3),
                        "ratio_exl3": round(ours / ex_us, 3) if ex_us else None,
                        "marlin_us": round(mar, 2) if mar else None,
                        "ratio_marlin": round(ours / mar, 3) if mar else None,
                        "pct_sol": round(100 * sol / ours, 1),
                        "sol_us": round(sol, 2),
                        "copies": len(layers),
                        "timing": mode,
                        "exl3_timing": ex_mode,
                        "exl3_path": paths.get((shape, cb, bits, m)) if ex_us else None,
                    }
                    rows.append(row)
                    shape_rows.append(row)
                    print(json.dumps(row), flush=True)
                del layers, exl3_lins
                torch.cuda.empty_cache()
                # Rewritten after every configuration: a run stopped at its time limit
                # keeps what it measured.
                write_results(args.out, args.tag, meta, rows, paths)
        if shape_rows:
            rebase_on_second_bf16(shape_rows, bf16_times(gen, k, n, args.m))
            write_results(args.out, args.tag, meta, rows, paths)

    stamp = write_results(args.out, args.tag, meta, rows, paths)
    print(f"\nwrote {args.out}/{stamp}.json/.csv ({time.monotonic() - t_start:.0f} s)")
    print(
        f"{'shape':>12} {'b':>3} {'cb':>5} {'m':>5} {'ours':>8} {'exl3':>8} "
        f"{'bf16':>8} {'marlin':>8} "
        f"{'/bf16':>6} {'/exl3':>6} {'/marl':>6} {'%SOL':>5} plans"
    )
    nan = float("nan")
    for r in rows:
        if r["m"] in (1, 16, 32, 64, 256, 1024, 4096):
            print(
                f"{r['k']}x{r['n']:>6} {r['bits']:>3g} {r['codebook']:>5} {r['m']:>5} "
                f"{r['ours_us']:8.1f} {r['exllamav3_us'] or nan:8.1f} "
                f"{r['bf16_us']:8.1f} {r['marlin_us'] or nan:8.1f} "
                f"{r['ratio_bf16']:6.2f} {r['ratio_exl3'] or nan:6.2f} "
                f"{r['ratio_marlin'] or nan:6.2f} {r['pct_sol']:5.0f} {r['plans']}"
            )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    sys.exit(main())
