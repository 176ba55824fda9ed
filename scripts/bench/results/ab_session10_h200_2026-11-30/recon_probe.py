# SPDX-License-Identifier: Apache-2.0
"""Session 10 call 13: the original-basis reconstruct on several layers in one process, for ncu.

    ncu -k regex:exl3_reconstruct_original --metrics ... python recon_probe.py EXT
Each layer runs the op twice with the large-m path pinned to the original basis; ncu times every
reconstruct launch (cold: ncu flushes the caches before each).
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from verify_kernels import load_extension, random_layer  # noqa: E402

LAYERS = [(5120, 12288, 4.0, 1), (5120, 17408, 4.0, 1), (5120, 17408, 6.0, 1),
          (5120, 17408, 2.0, 0), (5120, 17408, 3.0, 2), (17408, 5120, 4.0, 1)]

load_extension(sys.argv[1])
os.environ.update(VLLM_EXL3_RECONSTRUCT_M="1", VLLM_EXL3_RECONSTRUCT_BASIS="original")
gen = torch.Generator(device="cuda")
gen.manual_seed(0)
for k, n, bits, cb in LAYERS:
    layer = random_layer(gen, k, [n], bits, cb)
    x = torch.randn(1024, k, generator=gen, device="cuda").bfloat16()
    for _ in range(2):
        torch.ops._C.exl3_linear(x, layer.trellis, layer.suh, layer.svh, None, layer.widths,
                                 layer.codebook)
    torch.cuda.synchronize()
    print(f"layer {k}x{n} {bits}-bit cb {cb}", flush=True)
