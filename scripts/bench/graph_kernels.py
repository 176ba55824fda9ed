# SPDX-License-Identifier: Apache-2.0
"""Per-kernel device time inside the benchmark's own CUDA graphs: the same cold rotation over
weight copies as bench_linear.py, replayed under the profiler, so each kernel's time is the one
it has in the benchmark (sustained load, no L2 flush between calls), not profile_paths.py's
isolated cold call. Also times bf16 torch.matmul on a weight that a copy kernel has just
written (the large-m path's GEMM reads a W the reconstruct has just written).

    python scripts/bench/graph_kernels.py --ext build/exl3/_exl3_C.abi3.so \
        --case 5120x17408:4:1:4096 --case 5120x12288:5:2:1 --splits 1 2 4 8 16

A case is KxN:BITS:CODEBOOK:M. --splits pins VLLM_EXL3_SPLIT_K per extra row (fused path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_linear  # noqa: E402
from verify_kernels import load_extension  # noqa: E402

REPLAYS = 10


def graph_kernels(calls: list, m: int) -> tuple[float, dict[str, float]]:
    """(median µs per call from CUDA events, {kernel: mean µs per call}) for a graph of calls."""
    total_us, _ = bench_linear.graph_time_us(calls, m)
    graph = bench_linear.capture(calls)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per.setdefault(e.name[:70], []).append(e.device_time)
    n_calls = REPLAYS * len(calls)
    return total_us, {k: sum(v) / n_calls for k, v in per.items()}


def clocks_during(calls: list, seconds: float = 1.0) -> dict[str, float]:
    """Median SM clock (MHz) and board power (W) that nvidia-smi samples while a graph of
    `calls` replays back to back for about `seconds` (the sustained state the timing sees)."""
    graph = bench_linear.capture(calls)
    graph.replay()
    torch.cuda.synchronize()
    t = time.monotonic()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(1, int(seconds / max(time.monotonic() - t, 1e-4)))
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    if not samples:
        return {}
    return {"sm_mhz": statistics.median(float(a) for a, _ in samples),
            "power_w": statistics.median(float(b) for _, b in samples)}


def show(label: str, total: float, kernels: dict[str, float]) -> dict:
    parts = "  ".join(f"{v:.1f} {k[:44]}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]))
    print(f"  {label:22s} {total:8.1f} us (kernels {sum(kernels.values()):8.1f})  {parts}",
          flush=True)
    return {"label": label, "total_us": total, "kernels_us": kernels}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ext", default=None)
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--splits", type=int, nargs="*", default=[])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load_extension(args.ext)
    os.environ["VLLM_EXL3_LOG_PLANS"] = "1"
    gen = torch.Generator(device="cuda").manual_seed(4321)
    out = []
    for case in args.case:
        shape, bits, cb, m = case.split(":")
        k, n = (int(v) for v in shape.split("x"))
        bits, cb, m = float(bits), int(cb), int(m)
        print(f"\n{k}x{n} {bits:g}-bit cb {cb} m={m}", flush=True)
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        w = bench_linear.cold_bf16(gen, k, n)
        rows = [show("bf16", *graph_kernels([lambda w=w_: torch.matmul(x, w) for w_ in w], m))]
        if m >= 1024:
            scratch = torch.empty_like(w[0])

            def fresh(w_):
                scratch.copy_(w_)
                return torch.matmul(x, scratch)
            rows.append(show("bf16 on a fresh copy", *graph_kernels(
                [lambda w_=w_: fresh(w_) for w_ in w], m)))
            del scratch
        del w
        torch.cuda.empty_cache()
        layers = bench_linear.cold_layers(gen, k, n, bits, cb)
        calls = [lambda L=L: L.linear(x) for L in layers]
        rows.append(show("ours (tuned)", *graph_kernels(calls, m)))
        if m >= 1024:
            rows[-1]["clocks"] = clocks_during(calls)
            # The same GEMM as the bf16 row on each layer's own W (original basis, read back
            # through the op: I @ W), so only the weights' values differ from that row.
            eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
            w_rec = [L.linear(eye) for L in layers]
            del eye
            gemm = [lambda w_=w_: torch.matmul(x, w_) for w_ in w_rec]
            rows.append(show("bf16 on the layers' W", *graph_kernels(gemm, m)))
            rows[-1]["clocks"] = clocks_during(gemm)
            w_rand = [torch.randn_like(w_) * w_.float().std().bfloat16() for w_ in w_rec]
            rand = [lambda w_=w_: torch.matmul(x, w_) for w_ in w_rand]
            rows.append(show("bf16 on randn, W's std", *graph_kernels(rand, m)))
            rows[-1]["clocks"] = clocks_during(rand)
            for r in rows[-3:]:
                print(f"  clocks {r['label']:22s} {r['clocks']}", flush=True)
            del w_rec, w_rand, gemm, rand
        for s in args.splits if m < 1024 else []:
            os.environ["VLLM_EXL3_SPLIT_K"] = str(s)
            os.environ["VLLM_EXL3_RECONSTRUCT_M"] = "0"
            for bm in (16, 32):
                os.environ["VLLM_EXL3_BM"] = str(bm)
                rows.append(show(f"ours bm{bm} split {s}", *graph_kernels(calls, m)))
            for name in ("VLLM_EXL3_SPLIT_K", "VLLM_EXL3_RECONSTRUCT_M", "VLLM_EXL3_BM"):
                os.environ.pop(name)
        out.append({"k": k, "n": n, "bits": bits, "codebook": cb, "m": m, "rows": rows})
        del layers, calls
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": out},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
