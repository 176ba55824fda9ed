# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write the per-GPU plan table of `_C::exl3_linear` (as fused_moe's benchmark_moe.py
--tune writes its configs): for each layer shape, dtype and token-count bucket, time the
op's candidate plans on this GPU (`_C::exl3_time_plans`) and keep the fastest.

Shapes: the layers of the given EXL3 checkpoints (each linear as one shard, and the
q/k/v and gate/up groups fused as vLLM runs them when their bitrate and codebook match),
the 4.0bpw fixture by default, plus the benchmark shapes (--bench-shapes). The output is
`device_name=<GPU>.json`, named as the overlay's plans.py looks it up; commit it under
overlay/vllm/model_executor/layers/quantization/exl3/configs/.

    python scripts/bench/tune_plans.py [CHECKPOINT_DIR ...] [--bench-shapes] \
        [--max-tokens 8192] [--dtype bfloat16 --dtype float16] [--out DIR] [--merge
        FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from vllm_exl3.testing import exl3_oracle as vk

REPO = Path(__file__).resolve().parents[2]

FIXTURE = REPO / "tests" / "fixtures" / "qwen3-tiny" / "exl3-4.0bpw"
# Modules vLLM fuses into one linear, in shard order.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def codebook_of(names: set[str], prefix: str) -> int:
    return 2 if f"{prefix}.mul1" in names else 1 if f"{prefix}.mcg" in names else 0


def checkpoint_shapes(path: Path) -> set[tuple[int, tuple[int, ...], float, int]]:
    """(k, shard widths, bits, codebook) of every linear of an EXL3 checkpoint."""
    modules: dict[str, tuple[int, int, float, int]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names = set(st.keys())
            for name in names:
                if name.endswith(".trellis"):
                    prefix = name.removesuffix(".trellis")
                    shape = st.get_slice(name).get_shape()
                    modules[prefix] = (
                        shape[0] * 16,
                        shape[1] * 16,
                        shape[2] / 16,
                        codebook_of(names, prefix),
                    )
    shapes = set()
    for prefix, (k, n, bits, cb) in modules.items():
        shapes.add((k, (n,), bits, cb))
        parent, _, leaf = prefix.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf == group[0]:
                members = [modules.get(f"{parent}.{g}") for g in group]
                if all(
                    m is not None and m[0] == k and m[2:] == (bits, cb) for m in members
                ):
                    shapes.add((k, tuple(m[1] for m in members), bits, cb))
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="*", type=Path)
    ap.add_argument(
        "--bench-shapes",
        action="store_true",
        help="also the benchmark shapes (exl3_oracle.real_layers)",
    )
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--dtype", action="append", choices=("bfloat16", "float16"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--merge", type=Path, help="an existing table to extend")
    ap.add_argument("--ext")
    args = ap.parse_args(argv)
    vk.load_extension(args.ext)
    from vllm.model_executor.layers.quantization.exl3 import plans

    dtypes = [getattr(torch, d) for d in (args.dtype or ["bfloat16"])]
    shapes: set = set()
    for ckpt in args.checkpoints or [FIXTURE]:
        shapes |= checkpoint_shapes(ckpt)
    if args.bench_shapes:
        shapes |= {(k, tuple(w), float(b), cb) for k, w, b, cb in vk.real_layers()}
    device = torch.device("cuda", torch.cuda.current_device())
    name = plans.config_file_name(plans.device_file_name(device))
    table = json.loads(args.merge.read_text()) if args.merge else {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Modes and pins off: the table serves the default mode (the op drops entries that
    # a mode forbids, and VLLM_EXL3_PLAN bypasses the table).
    header = vk.header()
    buckets = [
        1 << i
        for i in range(args.max_tokens.bit_length() + 1)
        if (1 << (i - 1) if i else 0) < args.max_tokens
    ]
    start = time.perf_counter()
    for k, widths, bits, cb in sorted(shapes):
        layer = vk.random_layer(gen, k, widths, bits, cb)
        for dtype in dtypes:
            key = plans.layer_key(k, layer.n, bits, cb, len(widths), dtype)
            entries = {}
            for m in buckets:
                x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
                ws = vk.workspace(m * layer.n)
                timed = torch.ops._C.exl3_time_plans(
                    x,
                    layer.trellis,
                    layer.suh,
                    layer.svh,
                    None,
                    list(widths),
                    cb,
                    header,
                    ws,
                )
                rows = [timed[i : i + 9] for i in range(0, len(timed), 9)]
                if not rows:
                    raise SystemExit(
                        f"tune_plans: {key} m<={m}: the op offered no candidate"
                    )
                best = min(rows, key=lambda r: r[8])
                entries[str(m)] = plans.entry_to_json(best[:8])
                print(
                    f"{key} m<={m}: {plans.describe(best[:8])} {best[8] / 1e3:.1f} us "
                    f"({len(rows)} candidates)",
                    flush=True,
                )
            table[key] = entries
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / name
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    plans.load_table.cache_clear()
    plans.load_table(path)  # the loader accepts what was written
    print(
        f"wrote {path}: {len(table)} layer shapes in {time.perf_counter() - start:.0f} "
        "s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
