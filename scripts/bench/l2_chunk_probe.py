# SPDX-License-Identifier: Apache-2.0
"""Feasibility probe: the large-m path run over column chunks, so each chunk's reconstructed W
is written to and read back from L2 instead of HBM.

At 5120x12288 m = 1024 the op is reconstruct 64.5 µs + cuBLAS 166.5 µs against bf16's 165.3
(ab_session10 §5); the reconstruct's memory floor (126 MB written to HBM) alone is ~38 µs, so
the <= 1.1x target is out of reach while W goes through HBM. Here every chunk of C columns is
its own layer (the trellis columns, svh slice), and the op runs once per chunk with the
reconstruct forced in the original basis: the caching allocator hands each chunk's scratch the
same block, so with k x C x 2 bytes well under the L2 the W bytes can stay there between the
reconstruct and the GEMM. Timed cold in CUDA graphs, alternating with the unchunked op and
bf16 torch.matmul (whole and chunked the same way), medians of ROUNDS rounds.

    python scripts/bench/l2_chunk_probe.py --ext build/exl3/_exl3_C.abi3.so
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("VLLM_EXL3_RECONSTRUCT_M", "1")
os.environ.setdefault("VLLM_EXL3_RECONSTRUCT_BASIS", "original")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_linear  # noqa: E402
import device_ceilings  # noqa: E402
from verify_kernels import Layer, load_extension  # noqa: E402

ROUNDS = 3


def chunks_of(n: int, width: int) -> list[tuple[int, int]]:
    return [(c, min(c + width, n)) for c in range(0, n, width)]


def split_layer(L: Layer, width: int) -> list[Layer]:
    out = []
    for c0, c1 in chunks_of(L.trellis.size(1) * 16, width):
        out.append(Layer(L.trellis[:, c0 // 16:c1 // 16].contiguous(), L.suh,
                         L.svh[c0:c1].contiguous(), [c1 - c0], L.codebook, L.bits))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ext", default=None)
    ap.add_argument("--shapes", nargs="+", default=["5120x12288", "17408x5120", "4096x4096"])
    ap.add_argument("--m", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 3072, 4096, 6144])
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--codebook", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    load_extension(args.ext)
    gen = torch.Generator(device="cuda").manual_seed(11)
    rows = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        w = bench_linear.cold_bf16(gen, k, n)
        layers = bench_linear.cold_layers(gen, k, n, args.bits, args.codebook)
        widths = [c for c in args.widths if c < n and c % 128 == 0]
        for m in args.m:
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()

            def ours(Ls):
                return [lambda L=L: L.linear(x) for L in Ls]

            capture = bench_linear.warm_capture
            graphs = {"bf16": (capture([lambda w_=w_: torch.matmul(x, w_) for w_ in w]),
                               len(w)),
                      "ours": (capture(ours(layers)), len(layers))}
            keep = []  # the graphs read these; they must outlive them
            for c in widths:
                parts = [p for L in layers for p in split_layer(L, c)]
                graphs[f"ours/{c}"] = (capture(ours(parts)), len(layers))
                wc = [w_[:, c0:c1].contiguous() for w_ in w for c0, c1 in chunks_of(n, c)]
                graphs[f"bf16/{c}"] = (capture([lambda w_=w_: torch.matmul(x, w_)
                                                 for w_ in wc]), len(w))
                keep += [parts, wc]
            times: dict[str, list[float]] = {name: [] for name in graphs}
            for _ in range(ROUNDS):
                for name, (g, count) in graphs.items():
                    times[name].append(device_ceilings.median_ms(g.replay, bench_linear.REPLAYS)
                                       * 1e3 / count)
            med = {name: statistics.median(t) for name, t in times.items()}
            row = {"k": k, "n": n, "m": m, "bits": args.bits, "codebook": args.codebook,
                   "us": med, "rounds": times}
            rows.append(row)
            base = med["bf16"]
            print(f"{shape} m={m}: " + "  ".join(f"{name} {v:.1f} ({v / base:.3f})"
                                                 for name, v in med.items()), flush=True)
            del graphs, keep
            torch.cuda.empty_cache()
        del w, layers
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
