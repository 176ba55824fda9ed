# SPDX-License-Identifier: Apache-2.0
"""One pinned exl3_linear configuration run a few times, for Nsight Compute (ncu) to profile.

All plan knobs are pinned (BM, split, no reconstruct) so no autotuning launch is profiled:
    ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 \
        --metrics smsp__sass_thread_inst_executed.sum python scripts/bench/ncu_probe.py 4 1 1
thread instructions / (k*n) = executed instructions per decoded weight (BM = 16, m <= 16).
`--reconstruct original|rotated` pins the large-m path instead (reconstruct + cuBLAS), e.g. with
`-k regex:exl3_reconstruct` to profile the reconstruct kernel alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_kernels import load_extension, random_layer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bits", type=float)
    ap.add_argument("codebook", type=int)
    ap.add_argument("m", type=int)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--bm", type=int, default=16)
    ap.add_argument("--split", type=int, default=1, help="k-splits; 0 leaves the tuner free")
    ap.add_argument("--reconstruct", choices=("original", "rotated"), default=None)
    ap.add_argument("--ext", default=None)
    args = ap.parse_args()
    load_extension(args.ext)
    if args.reconstruct:
        os.environ.update(VLLM_EXL3_RECONSTRUCT_M="1", VLLM_EXL3_RECONSTRUCT_BASIS=args.reconstruct)
    else:
        os.environ.update(VLLM_EXL3_BM=str(args.bm), VLLM_EXL3_RECONSTRUCT_M="0")
        if args.split > 0:
            os.environ["VLLM_EXL3_SPLIT_K"] = str(args.split)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    layer = random_layer(gen, args.k, [args.n], args.bits, args.codebook)
    x = torch.randn(args.m, args.k, generator=gen, device="cuda").bfloat16()
    for _ in range(3):
        torch.ops._C.exl3_linear(x, layer.trellis, layer.suh, layer.svh, None, layer.widths,
                                 layer.codebook)
    torch.cuda.synchronize()
    print(f"k*n = {args.k * args.n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
