# SPDX-License-Identifier: Apache-2.0
"""Error of the large-m paths against the float64 reference, per output dtype: the relative
Frobenius error of exl3_linear with the plan pinned to each reconstruct basis, worst and median
over every rate x codebook on fresh random layers (verify_kernels.py reports one worst figure
over all plans; this splits it, to see what a change inside one path costs).

    python scripts/bench/recon_error.py --ext build/exl3/_exl3_C.abi3.so
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_kernels import (RECONSTRUCT_PLANS, combos, errors, knobs,  # noqa: E402
                            load_extension, random_layer, reference_y, run_op)

K, N, M = 512, 384, 64


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ext", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load_extension(args.ext)
    gen = torch.Generator(device="cuda").manual_seed(2024)
    errs: dict[str, list[float]] = {}
    for bits, cb in combos():
        layer = random_layer(gen, K, [N], bits, cb)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(M, K, generator=gen, device="cuda").to(dtype)
            ref = reference_y(x, layer, None)
            for plan in RECONSTRUCT_PLANS:
                with knobs(**plan):
                    rel, _ = errors(run_op(x, layer, None), ref)
                key = f"{plan['reconstruct_basis']} {str(dtype)[6:]}"
                errs.setdefault(key, []).append(rel)
    out = {k: {"cases": len(v), "worst": max(v), "median": statistics.median(v)}
           for k, v in errs.items()}
    for k, s in out.items():
        print(f"{k:20s} cases {s['cases']:3d}  worst rel {s['worst']:.3e}  median {s['median']:.3e}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
