# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Perplexity of the real ExLlamaV3 fixture checkpoints with every EXL3 linear run by
our CUDA op.

No vLLM: transformers' Qwen3 model in bf16 on the GPU, each EXL3 nn.Linear replaced by a
module that calls torch.ops._C.exl3_linear on the checkpoint's own trellis/suh/svh. The
windows and the scoring are the fixtures README's (tests/codec/qwen3_tiny.py), so the
result compares directly with the ExLlamaV3 1.6.5 value recorded there. Also checks that
one fused q/k/v call (3 shards) equals the three separate calls. Usage (GPU host, repo
root):
    python3 scripts/e2e/kernel_fixture_ppl.py --ext build/exl3/_exl3_C.abi3.so [--json
    OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "codec"))
sys.path.insert(0, str(REPO / "tests" / "gpu"))

import exl3_oracle as vk  # noqa: E402
from qwen3_tiny import WINDOW, model_from_state_dict, validation_windows  # noqa: E402
from vllm_exl3.codec import exl3_format  # noqa: E402

# ExLlamaV3 1.6.5's perplexities on the same windows (tests/fixtures/README.md).
RECORDED = {"exl3-4.0bpw": 6.5847, "exl3-3.0bpw-mcg": 7.0024}
# Windows per forward pass on the GPU.
BATCH = 40


class Exl3OpLinear(torch.nn.Module):
    def __init__(self, w) -> None:
        super().__init__()
        self.trellis = w.trellis.cuda()
        self.suh = w.suh.cuda().view(1, -1)
        self.svh = w.svh.cuda()
        self.n = self.svh.numel()
        self.codebook = int(w.codebook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = vk.exl3_op(
            x.reshape(-1, shape[-1]).contiguous(),
            self.trellis,
            self.suh,
            self.svh,
            None,
            [self.n],
            self.codebook,
        )
        return y.view(*shape[:-1], self.n)


def perplexity(model: torch.nn.Module, windows: torch.Tensor) -> float:
    nll, scored = 0.0, 0
    with torch.inference_mode():
        for start in range(0, windows.shape[0], BATCH):
            batch = windows[start : start + BATCH].cuda()
            logits = model(batch).logits[:, :-1].float()
            if not torch.isfinite(logits).all():
                raise RuntimeError("non-finite logits")
            targets = batch[:, 1:]
            nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                targets.reshape(-1),
                reduction="sum",
            ).item()
            scored += targets.numel()
    return math.exp(nll / scored)


def run(name: str, fmt, windows: torch.Tensor) -> dict:
    ckpt = REPO / "tests" / "fixtures" / "qwen3-tiny" / name
    index = fmt.read_safetensors_index(ckpt)
    specs = fmt.find_exl3_modules(index)
    owned = {n for s in specs.values() for n in s.tensor_names}
    state = {n: fmt.read_tensor(ckpt, n, e) for n, e in index.items() if n not in owned}
    weights = {p: fmt.load_module(ckpt, s, index=index) for p, s in specs.items()}
    # Placeholders so the model builds; every one is replaced by the op module below.
    for p, w in weights.items():
        state[f"{p}.weight"] = torch.zeros(w.svh.numel(), w.suh.numel())
    model = (
        model_from_state_dict(ckpt / "config.json", state)
        .to(torch.bfloat16)
        .cuda()
        .eval()
    )
    for p, w in weights.items():
        parent, _, leaf = p.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Exl3OpLinear(w))
    t0 = time.time()
    ppl = perplexity(model, windows)
    # One fused q/k/v call (3 shards, one trellis concatenated along n) vs three calls.
    attn = "model.layers.0.self_attn"
    parts = [weights[f"{attn}.{x}_proj"] for x in "qkv"]
    x = torch.randn(37, parts[0].suh.numel(), device="cuda", dtype=torch.bfloat16)
    fused = vk.exl3_op(
        x,
        torch.cat([p.trellis for p in parts], 1).cuda(),
        torch.stack([p.suh for p in parts]).cuda(),
        torch.cat([p.svh for p in parts]).cuda(),
        None,
        [p.svh.numel() for p in parts],
        int(parts[0].codebook),
    )
    separate = torch.cat([Exl3OpLinear(p)(x) for p in parts], 1)
    fused_diff = (fused.float() - separate.float()).abs().max().item()
    rel = ppl / RECORDED[name] - 1
    return {
        "checkpoint": name,
        "ppl_ours_cuda_bf16": round(ppl, 4),
        "ppl_exllamav3": RECORDED[name],
        "rel_diff": round(rel, 6),
        "fused_qkv_vs_separate_max_abs": fused_diff,
        "seconds": round(time.time() - t0, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ext", required=True, help="path of _exl3_C.abi3.so")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    torch.ops.load_library(args.ext)
    fmt = exl3_format
    windows = validation_windows()
    assert windows.shape[1] == WINDOW
    results = [run(name, fmt, windows) for name in RECORDED]
    print(
        f"{'checkpoint':18} {'ours (CUDA op, bf16)':>21} {'ExLlamaV3':>10} {'diff':>8}"
    )
    for r in results:
        print(
            f"{r['checkpoint']:18} {r['ppl_ours_cuda_bf16']:21.4f} "
            f"{r['ppl_exllamav3']:10.4f} "
            f"{100 * r['rel_diff']:+7.3f}%  fused-qkv "
            f"max|d|={r['fused_qkv_vs_separate_max_abs']:.2e}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
