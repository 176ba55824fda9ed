# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Print the plan `_C::exl3_linear` runs for every linear of a checkpoint at every
token-count bucket, one line each, as the layers' load-time preparation resolves them
(the checked-in table for this GPU if the overlay is installed, else the cost model).
Two processes' outputs must be identical (test_kernels.py runs it twice).

    python tests/gpu/plan_log.py [CHECKPOINT_DIR] [--max-tokens 8192] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import exl3_oracle as vk  # noqa: E402

FIXTURE = HERE.parent / "fixtures" / "qwen3-tiny" / "exl3-4.0bpw"


def codebook_of(tensors, prefix: str) -> int:
    if f"{prefix}.mul1" in tensors:
        return 2
    if f"{prefix}.mcg" in tensors:
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", default=str(FIXTURE))
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--ext")
    args = ap.parse_args(argv)
    vk.load_extension(args.ext)
    dtype = getattr(torch, args.dtype)
    try:
        from vllm.model_executor.layers.quantization.exl3 import plans as overlay_plans
    except ImportError:
        overlay_plans = None
    device = torch.device("cuda", torch.cuda.current_device())
    buckets = []
    m = 1
    while True:
        buckets.append(m)
        if m >= args.max_tokens:
            break
        m *= 2
    for f in sorted(Path(args.checkpoint).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names = set(st.keys())
            for name in sorted(n for n in names if n.endswith(".trellis")):
                prefix = name.removesuffix(".trellis")
                trellis = st.get_tensor(name).to(device)
                cb = codebook_of(names, prefix)
                k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
                bits = trellis.shape[2] / 16
                if overlay_plans is not None:
                    key = overlay_plans.layer_key(k, n, bits, cb, 1, dtype)
                    table = overlay_plans.layer_plans(key, device)
                else:
                    key, table = f"k={k},n={n},bits={bits:g},codebook={cb}", vk.header()
                for m in buckets:
                    plan = torch.ops._C.exl3_plan(
                        trellis, 1, cb, dtype == torch.bfloat16, m, table, 1 << 27
                    )
                    print(f"{prefix} {key} m<={m}: {list(plan)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
