# SPDX-License-Identifier: Apache-2.0
"""Pinned cold A/B timing of exl3_linear plans, one extension per process.

Each spec "k n bits cb m bm split wgmma" pins the fused GEMM's tier (BM), k-split and engine
(VLLM_EXL3_BM / _SPLIT_K / _WGMMA; split "sk" pins the wgmma engine's stream-k grid instead,
VLLM_EXL3_STREAM_K=1; bm 0 times the reconstruct + cuBLAS path instead), on random
layers rotated past the L2 (~240 MB of weights), inside one CUDA graph; the median of 30
replays per call is printed and written to $OUT/pin_LABEL.json. Run the extensions under
comparison alternately, in separate processes, in the same device call.

    python scripts/bench/pin.py EXT LABEL "5120 12288 4 1 256 256 1 1" ...
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_ceilings  # noqa: E402
from verify_kernels import load_extension, random_layer  # noqa: E402

# Weight bytes the rotation covers: several times the H200's 60 MB L2.
ROTATION_BYTES = 240e6
REPLAYS = 30


def pin(bm: int, split: str, wgmma: int) -> None:
    for v in ("VLLM_EXL3_BM", "VLLM_EXL3_SPLIT_K", "VLLM_EXL3_WGMMA", "VLLM_EXL3_STREAM_K"):
        os.environ.pop(v, None)
    if bm == 0:
        os.environ["VLLM_EXL3_RECONSTRUCT_M"] = "1"
        return
    os.environ.update(VLLM_EXL3_BM=str(bm), VLLM_EXL3_WGMMA=str(wgmma),
                      VLLM_EXL3_RECONSTRUCT_M="0")
    if split == "sk":
        os.environ["VLLM_EXL3_STREAM_K"] = "1"
    else:
        os.environ.update(VLLM_EXL3_SPLIT_K=split, VLLM_EXL3_STREAM_K="0")


def main(argv: list[str]) -> int:
    ext, label, specs = argv[0], argv[1], argv[2:]
    load_extension(ext)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    out = []
    for spec in specs:
        k, n, bits, cb, m, bm, split, wg = spec.split()
        k, n, cb, m, bm, wg = map(int, (k, n, cb, m, bm, wg))
        bits = float(bits)
        pin(bm, split, wg)
        copies = max(3, int(ROTATION_BYTES // (k * n * bits / 8)) + 1)
        layers = [random_layer(gen, k, [n], bits, cb) for _ in range(copies)]
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        calls = [(lambda L=L: L.linear(x)) for L in layers]
        for c in calls[:2]:
            c()  # the tuner, if anything is left free, runs here and not in the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        us = device_ceilings.median_ms(graph.replay, REPLAYS) * 1e3 / len(calls)
        tflops = 2 * m * k * n / us / 1e6
        print(f"{label:8s} {k}x{n} b{bits:g} cb{cb} m={m:5d} bm={bm:3d} s={split:>2s} wg={wg}: "
              f"{us:8.1f} us  {tflops:6.0f} TFLOP/s", flush=True)
        out.append(dict(label=label, k=k, n=n, bits=bits, cb=cb, m=m, bm=bm, split=split,
                        wgmma=wg, us=us))
        del layers, calls, graph
        torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "/tmp"), f"pin_{label}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
