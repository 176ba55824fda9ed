# SPDX-License-Identifier: Apache-2.0
"""Where exl3_linear's time goes, per path: each (shape, m) is run with the plan pinned to every
path the op has (fused GEMM at each BM tier, reconstruct in the original basis, reconstruct in
the rotated basis) and with the autotuner free; for each, the kernels one cold call launches
(L2 flushed before every call) and their median device times, read from the profiler.

    python scripts/bench/profile_paths.py --ext build/exl3/_exl3_C.abi3.so \
        --shapes 4096x4096 4096x11008 --m 64 256 1024 4096 --json out.json

VLLM_EXL3_LOG_PLANS=1 is set, so the free run also prints the autotuner's timed candidates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_kernels import load_extension, random_layer  # noqa: E402

# Bigger than the H200's 60 MB L2 several times over: writing it evicts every weight.
FLUSH_BYTES = 256 << 20
CALLS = 5
# Pins per path (read by the op on every call, see exl3_plan.cpp).
PATHS = {
    "auto": {},
    # RECONSTRUCT_M = 0 keeps the reconstruct paths out of the tuner's candidates, so these rows
    # time the fused GEMM itself (the 76c291d profile lacked it: its fused rows above m = 64
    # fell back to reconstruct).
    "fused_bm16": {"VLLM_EXL3_BM": "16", "VLLM_EXL3_RECONSTRUCT_M": "0"},
    "fused_bm32": {"VLLM_EXL3_BM": "32", "VLLM_EXL3_RECONSTRUCT_M": "0"},
    "fused_bm64": {"VLLM_EXL3_BM": "64", "VLLM_EXL3_RECONSTRUCT_M": "0"},
    "fused_bm128": {"VLLM_EXL3_BM": "128", "VLLM_EXL3_RECONSTRUCT_M": "0"},
    "recon_original": {"VLLM_EXL3_RECONSTRUCT_M": "1", "VLLM_EXL3_RECONSTRUCT_BASIS": "original"},
    "recon_rotated": {"VLLM_EXL3_RECONSTRUCT_M": "1", "VLLM_EXL3_RECONSTRUCT_BASIS": "rotated"},
}
PIN_NAMES = {n for pins in PATHS.values() for n in pins}


def profile_call(fn, flush: torch.Tensor) -> dict[str, float]:
    """Median device microseconds per kernel name over CALLS cold calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flush.fill_(1)
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or "fill" in e.name.lower():
            continue
        per_kernel.setdefault(e.name[:90], []).append(e.device_time)
    return {k: statistics.median(v) * len(v) / CALLS for k, v in per_kernel.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ext", default=None)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x11008"])
    ap.add_argument("--m", nargs="+", type=int, default=[64, 256, 1024, 4096])
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--codebook", type=int, default=1)
    ap.add_argument("--paths", nargs="+", default=list(PATHS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load_extension(args.ext)
    os.environ["VLLM_EXL3_LOG_PLANS"] = "1"
    gen = torch.Generator(device="cuda").manual_seed(1234)
    flush = torch.empty(FLUSH_BYTES // 4, device="cuda", dtype=torch.float32)
    rows = []
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        layer = random_layer(gen, k, [n], args.bits, args.codebook)
        w_bf16 = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = profile_call(lambda: torch.matmul(x, w_bf16), flush)
            print(f"\n{k}x{n} m={m}: bf16 matmul {sum(bf16.values()):.1f} us")
            for path in args.paths:
                for name in PIN_NAMES:
                    os.environ.pop(name, None)
                os.environ.update(PATHS[path])

                def call():
                    return torch.ops._C.exl3_linear(x, layer.trellis, layer.suh, layer.svh,
                                                    None, layer.widths, layer.codebook)
                kernels = profile_call(call, flush)
                total = sum(kernels.values())
                print(f"  {path:15s} {total:8.1f} us  x{total / sum(bf16.values()):.2f} bf16  "
                      + "  ".join(f"{v:.1f} {k[:40]}" for k, v in
                                  sorted(kernels.items(), key=lambda kv: -kv[1])))
                rows.append({"k": k, "n": n, "m": m, "bits": args.bits,
                             "codebook": args.codebook, "path": path, "total_us": total,
                             "bf16_us": sum(bf16.values()), "kernels_us": kernels})
    for name in PIN_NAMES:
        os.environ.pop(name, None)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
