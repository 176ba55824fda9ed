# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ours against bf16 torch.matmul at large m, timed in alternation.

At m >= 1024 the H200 runs at its power cap (~690 of 700 W) and its SM clock drifts with
the load's history (1455-1530 MHz sustained against 1980 boost, graph_kernels.py), so a
bf16 time taken minutes before ours measures a different card. Here both graphs are
built once and timed in ROUNDS alternating rounds (cold rotation as in bench_linear.py,
CUDA-event medians); the ratio is the median of the per-round ratios.

    python scripts/bench/interleaved.py --ext build/exl3/_exl3_C.abi3.so --m 1024 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
import bench_linear  # noqa: E402
import device_ceilings  # noqa: E402
from exl3_oracle import load_extension  # noqa: E402

ROUNDS = 5


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ext", default=None)
    ap.add_argument(
        "--shapes", nargs="+", default=[f"{k}x{n}" for k, n in bench_linear.SHAPES]
    )
    ap.add_argument("--m", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--codebook", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load_extension(args.ext)
    gen = torch.Generator(device="cuda").manual_seed(77)
    rows = []
    print(
        f"{'shape':>11} {'m':>5} {'ours':>8} {'bf16':>8} {'ratio':>6}  per-round ratios"
    )
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        w = bench_linear.cold_bf16(gen, k, n)
        layers = bench_linear.cold_layers(gen, k, n, args.bits, args.codebook)
        for m in args.m:
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            capture = bench_linear.warm_capture
            g_bf16 = capture([lambda w_=w_, x=x: torch.matmul(x, w_) for w_ in w])
            g_ours = capture([lambda L=L, x=x: L.linear(x) for L in layers])
            ours, bf16 = [], []
            for _ in range(ROUNDS):
                bf16.append(
                    device_ceilings.median_ms(g_bf16.replay, bench_linear.REPLAYS)
                    * 1e3
                    / len(w)
                )
                ours.append(
                    device_ceilings.median_ms(g_ours.replay, bench_linear.REPLAYS)
                    * 1e3
                    / len(layers)
                )
            ratios = [o / b for o, b in zip(ours, bf16)]
            row = {
                "k": k,
                "n": n,
                "m": m,
                "bits": args.bits,
                "codebook": args.codebook,
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
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "rounds": ROUNDS,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
