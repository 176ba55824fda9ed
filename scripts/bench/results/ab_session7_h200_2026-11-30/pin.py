# Pinned cold A/B of exl3_linear configs across extensions: each ext in its own process.
# usage: python pin.py EXT LABEL "k n bits cb m bm split wgmma" ...
import os, sys, json
sys.path.insert(0, "scripts/bench"); sys.path.insert(0, "scripts")
import torch
from verify_kernels import load_extension, random_layer
import device_ceilings
ext, label = sys.argv[1], sys.argv[2]
load_extension(ext)
gen = torch.Generator(device="cuda"); gen.manual_seed(1)
out = []
for spec in sys.argv[3:]:
    k, n, bits, cb, m, bm, split, wg = spec.split()
    k, n, cb, m, bm, split, wg = map(int, (k, n, cb, m, bm, split, wg)); bits = float(bits)
    if bm == 0:  # the reconstruct + cuBLAS path, for reference in the same run
        for v in ("VLLM_EXL3_BM", "VLLM_EXL3_SPLIT_K", "VLLM_EXL3_WGMMA"):
            os.environ.pop(v, None)
        os.environ["VLLM_EXL3_RECONSTRUCT_M"] = "1"
    else:
        os.environ.update(VLLM_EXL3_BM=str(bm), VLLM_EXL3_SPLIT_K=str(split),
                          VLLM_EXL3_WGMMA=str(wg), VLLM_EXL3_RECONSTRUCT_M="0")
    wbytes = k * n * bits / 8
    copies = max(3, int(240e6 // wbytes) + 1)
    layers = [random_layer(gen, k, [n], bits, cb) for _ in range(copies)]
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    calls = [(lambda L=L: torch.ops._C.exl3_linear(x, L.trellis, L.suh, L.svh, None, L.widths, L.codebook)) for L in layers]
    for c in calls[:2]: c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls: c()
    us = device_ceilings.median_ms(g.replay, 30) * 1e3 / len(calls)
    flops = 2 * m * k * n
    print(f"{label:8s} {k}x{n} b{bits:g} cb{cb} m={m:5d} bm={bm:3d} s={split:2d} wg={wg}: {us:8.1f} us  {flops/us/1e6:6.0f} TFLOP/s", flush=True)
    out.append(dict(label=label, k=k, n=n, bits=bits, cb=cb, m=m, bm=bm, split=split, wgmma=wg, us=us))
    del layers, calls, g
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"pin_{label}.json"), "w"))
