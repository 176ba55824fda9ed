# SPDX-License-Identifier: Apache-2.0
"""Where each kernel of the op starts and ends inside the benchmark's CUDA graphs.

graph_kernels.py gives each kernel's mean duration, but with programmatic dependent launch a
kernel starts before its producer ends, so durations overlap and do not say what the op waits
on. This replays the same cold graph (bench_linear's rotation over weight copies) under the
profiler and reports, per op in the steady state, the times of each kernel's start and end
relative to the op's input-transform start: the mean over the middle ops of the graph.

    VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=8 python scripts/bench/graph_timeline.py \
        --ext build/exl3/_exl3_C.abi3.so --case 4096x4096:4:1:1 --case 4096x4096:4:1:16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_linear  # noqa: E402
from verify_kernels import load_extension  # noqa: E402

ROLES = {"exl3_input_transform": "T", "exl3_gemm": "G", "exl3_splitk_finish": "F"}


def role(name: str) -> str | None:
    for key, r in ROLES.items():
        if key in name:
            return r
    return None


def kernel_spans(calls: list) -> list[tuple[str, float, float]]:
    """(role, start µs, end µs) of every op kernel in one profiled replay, in start order."""
    graph = bench_linear.warm_capture(calls)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    spans = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel" and (r := role(e["name"])):
            spans.append((r, float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return sorted(spans, key=lambda s: s[1])


def op_timeline(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """Mean offsets (µs) from each op's T start, over the middle half of the ops."""
    ops, cur = [], {}
    for r, s, e in spans:
        if r == "T" and cur:
            ops.append(cur)
            cur = {}
        cur[r] = (s, e)
    if cur:
        ops.append(cur)
    full = [o for o in ops if {"T", "G"} <= o.keys()]
    first, last = len(full) // 4, max(len(full) // 4 + 1, 3 * len(full) // 4)
    out: dict[str, list[float]] = {}
    for i in range(first, min(last, len(full))):
        t0 = full[i]["T"][0]
        for r, (s, e) in full[i].items():
            out.setdefault(f"{r} start", []).append(s - t0)
            out.setdefault(f"{r} end", []).append(e - t0)
        if i + 1 < len(full):
            out.setdefault("next T start", []).append(full[i + 1]["T"][0] - t0)
    return {k: statistics.mean(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ext", default=None)
    ap.add_argument("--case", action="append", required=True, help="KxN:BITS:CODEBOOK:M")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load_extension(args.ext)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    for case in args.case:
        shape, bits, cb, m = case.split(":")
        k, n = (int(v) for v in shape.split("x"))
        layers = bench_linear.cold_layers(gen, k, n, float(bits), int(cb))
        x = torch.randn(int(m), k, generator=gen, device="cuda").bfloat16()
        calls = [lambda L=L: L.linear(x) for L in layers]
        tl = op_timeline(kernel_spans(calls))
        rows.append({"case": case, "timeline_us": tl})
        order = sorted(tl.items(), key=lambda kv: kv[1])
        print(f"{case}: " + "  ".join(f"{name} {v:.2f}" for name, v in order), flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
