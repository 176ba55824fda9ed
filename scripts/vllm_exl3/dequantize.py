# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm-exl3 dequantize <exl3 dir> <out dir>`: a plain Hugging Face checkpoint whose
weights are the reconstructed EXL3 weights.

Every EXL3 linear becomes `<module>.weight` (out, in) = W^T from the reference codec
(computed in fp32, then cast to --dtype), with the 128-padding trimmed to the model's
real dims (vocab, hidden, ...); its bias likewise. Other tensors are copied as they are
(padded unquantized linears trimmed). config.json loses its quantization_config block
and names the new dtype; tokenizer, generation and other small files are copied. For
evaluating an EXL3 model in tools that do not read EXL3, and as the end-to-end oracle of
the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from . import ToolError
from .architecture import PlanError, plan_model, round_up
from .codec import checkpoint, reference
from .codec import exl3_format as fmt

DTYPES = ("bfloat16", "float16", "float32")
# Output shard cap (MiB): safetensors shards of a few GiB are what HF tooling expects.
DEFAULT_SHARD_MIB = 4096
# Weight files a converted directory may hold besides ours; never copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
NOT_COPIED = {"config.json", "quantization_config.json", fmt.SAFETENSORS_INDEX}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dequantize",
        help="write a plain HF checkpoint with the reconstructed weights",
        description=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("checkpoint", help="EXL3 checkpoint directory")
    p.add_argument("out", help="output directory (created; must be empty if it exists)")
    p.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="output weight dtype"
    )
    p.add_argument(
        "--device", default="cpu", help="where to decode (cpu, cuda, cuda:1, ...)"
    )
    p.add_argument(
        "--shard-size", type=int, default=DEFAULT_SHARD_MIB, help="shard cap in MiB"
    )
    p.add_argument("--quiet", action="store_true", help="no per-tensor progress lines")
    p.set_defaults(func=run)


def _real_dims(config: dict) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """{module: (real in, real out)} for every linear, from the architecture plan; falls
    back to the vocab and hidden size for architectures the plan does not know."""
    try:
        plan = plan_model(config)
        return {s.name: (s.in_features, s.out_features) for s in plan.linears}, []
    except PlanError as e:
        return {}, [str(e)]


def _trim(
    name: str, k_pad: int, n_pad: int, dims: dict, config: dict, warnings: list[str]
) -> tuple[int, int]:
    if name in dims:
        return dims[name]
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    k = hidden if hidden and round_up(hidden) == k_pad else k_pad
    n = (
        vocab
        if name == "lm_head" and vocab
        else (hidden if hidden and round_up(hidden) == n_pad else n_pad)
    )
    if (k, n) == (k_pad, n_pad) and name != "lm_head":
        warnings.append(f"{name}: real dims unknown, kept the stored {k_pad} x {n_pad}")
    return k, n


def dequantize(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: str = "bfloat16",
    device: str = "cpu",
    shard_mib: int = DEFAULT_SHARD_MIB,
    progress: bool = True,
) -> dict:
    """Write the dequantized checkpoint; return a summary (tensors, warnings)."""
    import torch
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ToolError(f"{src}: no config.json (not a checkpoint directory?)")
    if dst.resolve() == src.resolve():
        raise ToolError(
            "the output directory must differ from the checkpoint directory"
        )
    if dst.exists() and any(dst.iterdir()):
        raise ToolError(f"{dst}: exists and is not empty")
    # The verdict vLLM's loader gives on the same directory, before any weight is read:
    # the headers and JSON files, then the markers and suh/svh values it checks while
    # loading.
    try:
        description = checkpoint.validate_checkpoint(src)
    except fmt.Exl3FormatError as e:
        raise ToolError(str(e)) from e
    if description.embeddings:
        raise ToolError(
            f"{next(iter(description.embeddings))}: a quantized token embedding "
            "(--embed_bits); dequantize does not decode it yet"
        )
    config, index, specs = description.config, description.tensors, description.modules
    for w in description.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not specs:
        raise ToolError(f"{src}: no EXL3 tensors found (nothing to dequantize)")
    out_dtype = getattr(torch, dtype)
    dims, warnings = _real_dims(config)
    warnings = list(description.warnings) + warnings
    real = {
        prefix: _trim(prefix, spec.in_features, spec.out_features, dims, config, [])
        for prefix, spec in specs.items()
    }
    problems, notes = checkpoint.value_problems(description, real)
    if problems:
        more = (
            f" (and {checkpoint.more_problems(len(problems) - 1)})"
            if len(problems) > 1
            else ""
        )
        raise ToolError(problems[0] + more)
    warnings += notes
    dst.mkdir(parents=True, exist_ok=True)

    exl3_names = {n for s in specs.values() for n in s.tensor_names}
    plain = [n for n in index if n not in exl3_names]
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = [0]
    cap = shard_mib << 20

    def put(name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if shards[-1] and shard_bytes[-1] + size > cap:
            shards.append({})
            shard_bytes.append(0)
        shards[-1][name] = t.contiguous().cpu()
        shard_bytes[-1] += size

    total = len(specs)
    t0 = time.monotonic()
    try:
        for i, (prefix, spec) in enumerate(specs.items()):
            weights = fmt.load_module(src, spec, device=device, index=index)
            w = reference.reconstruct(
                weights.trellis,
                weights.suh,
                weights.svh,
                weights.codebook,
                weights.bits,
            )
            k, n = _trim(
                prefix, spec.in_features, spec.out_features, dims, config, warnings
            )
            put(f"{prefix}.weight", w[:k, :n].t().to(out_dtype))
            if weights.bias is not None:
                put(f"{prefix}.bias", weights.bias[:n].to(out_dtype))
            if progress:
                print(
                    f"[{i + 1}/{total}] {prefix}: {spec.bits} bits "
                    f"{spec.codebook.name.lower()}, "
                    f"{spec.in_features}x{spec.out_features} -> "
                    f"weight [{n}, {k}] ({time.monotonic() - t0:.1f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    except fmt.Exl3FormatError as e:
        raise ToolError(str(e)) from e
    for name in plain:
        t = fmt.read_tensor(src, name, index[name])
        prefix, suffix = fmt.split_name(name)
        if prefix in dims and suffix in ("weight", "bias") and t.dim() in (1, 2):
            k, n = dims[
                prefix
            ]  # padded unquantized linear (e.g. lm_head at head_bits 16)
            t = t[:n, :k] if t.dim() == 2 else t[:n]
        put(name, t)

    names_in_shards = [list(s) for s in shards]
    count = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if count == 1
            else f"model-{i + 1:05}-of-{count:05}.safetensors"
        )
        save_file(shard, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names_in_shards[i]})
    if count > 1:
        with open(dst / fmt.SAFETENSORS_INDEX, "w") as f:
            json.dump(
                {
                    "metadata": {"total_size": sum(shard_bytes)},
                    "weight_map": weight_map,
                },
                f,
                indent=2,
            )

    config.pop("quantization_config", None)
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = dtype
    if "torch_dtype" not in config and "dtype" not in config:
        config["torch_dtype"] = dtype
    with open(dst / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    copied = []
    for item in sorted(src.iterdir()):
        if (
            item.is_file()
            and item.name not in NOT_COPIED
            and not item.name.endswith(WEIGHT_SUFFIXES)
        ):
            shutil.copy2(item, dst / item.name)
            copied.append(item.name)
    for w in warnings[len(description.warnings) :]:
        print(f"warning: {w}", file=sys.stderr)
    return {
        "exl3_modules": total,
        "tensors": sum(len(s) for s in names_in_shards),
        "shards": count,
        "copied": copied,
        "warnings": warnings,
    }


def run(args: argparse.Namespace) -> int:
    summary = dequantize(
        args.checkpoint,
        args.out,
        args.dtype,
        args.device,
        args.shard_size,
        progress=not args.quiet,
    )
    print(
        f"dequantized {summary['exl3_modules']} EXL3 linears; wrote "
        f"{summary['tensors']} "
        f"tensors in {summary['shards']} shard(s) to {args.out}; copied "
        f"{', '.join(summary['copied']) or 'no other files'}"
    )
    return 0
