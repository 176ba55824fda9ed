# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cold benchmark of one EXL3 MoE layer (torch.ops._C.exl3_moe through
CudaExl3MoEKernel) against vLLM's bf16 fused MoE (`fused_experts`) and its int4 Marlin
MoE (`fused_marlin_moe`, GPTQ 4-bit, group 128), at real model shapes, uniform random
routing.

Method (as bench_linear.py): each variant rotates through enough copies of the layer's
weights that one pass reads >= POOL_BYTES of the experts the routing touches (several
times the 60 MB L2), every call of a pass is captured in one CUDA graph, and the time is
the median over graph replays divided by the calls per pass. Routing (top-k) is outside
the timed op for every variant; each variant's own expert alignment is inside it.
Weights are random (timing only).

ExLlamaV3 1.6.5's own MoE block (BlockSparseMLP) is the fourth anchor when ExLlamaV3
imports: a synthetic checkpoint in its layout (vllm_exl3.testing.synthetic_checkpoint;
Qwen3-MoE architecture at the shape's dims, one decoder layer per weight copy, written
once into --exllamav3-work and reused) loaded by its own Config/Model; each call is that
block's forward on fp16 input, its own router (a 128-expert gate GEMM and top-k, uniform
for random weights) included. Without ExLlamaV3 the column says why.

    python scripts/bench/bench_moe.py --out bench-results/moe [--bits 4] \
        [--shapes qwen3-30b-a3b] [--tokens 1 16 256] [--exl3-state DIR]
    python scripts/bench/bench_moe.py --write-exllamav3-only  # checkpoints only, CPU

--profile adds each kernel's GPU time per call to the log, so the graph time splits into
kernel work and the latency between dependent launches.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from vllm_exl3.bench import exllamav3_anchor
from vllm_exl3.bench import moe_layers as ml
from vllm_exl3.bench.bench_linear import graph_time_us
from vllm_exl3.testing.exl3_oracle import load_extension

# name: (hidden, expert width, experts, top-k)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "glm-4.5-air": (4096, 1408, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
# One pass reads at least this many bytes of touched expert weights: > 4x the H200's L2.
POOL_BYTES = 256 << 20
MIN_COPIES = 2
MARLIN_GROUP = 128
MARLIN_BITS = 4
# Random bf16 weights scaled so the outputs stay finite (timing does not depend on
# values).
WEIGHT_SCALE = 0.02
# ExLlamaV3 runs its MoE block on fp16 hidden states.
EXLLAMAV3_DTYPE = torch.float16
# The anchor checkpoints' vocabulary: embedding and head are not timed, keep them small
# (a multiple of 128, as EXL3 output widths must be).
EXLLAMAV3_VOCAB = 1024
EXLLAMAV3_HEAD_DIM = 128
EXLLAMAV3_KV_HEADS = 4
CODEBOOK_NAMES = ("3inst", "mcg", "mul1")


def copies_for(expert_bytes: int, top_k: int) -> int:
    """Copies so that a pass at one token (top_k experts touched per call) reads
    POOL_BYTES."""
    return max(MIN_COPIES, math.ceil(POOL_BYTES / (expert_bytes * top_k)))


def routing(gen: torch.Generator, m: int, top_k: int, experts: int):
    return ml.random_routing(gen, m, top_k, experts)


def exl3_variant(
    gen,
    h,
    i,
    e,
    top_k,
    bits,
    codebook,
    deterministic,
    reconstruct=False,
    force_splits=None,
    force_wgmma=None,
    force_pairs=None,
    force_block=None,
):
    """The kernel class with its choices fixed as asked (moe_plans.Exl3MoEOverrides).

    reconstruct=False: the grouped GEMM at every size (the op's path below the
    reconstruct threshold, Exl3MoEThresholds.reconstruct_min_rows_per_expert); True:
    the large-batch path at every size (every local expert reconstructed into the
    shared scratch, then vLLM's fused_experts), so the two rows place the threshold.
    force_splits: the grouped GEMMs' k-splits (gate/up, down) at the decode tiers
    instead of the few-token rule's (moe_plans.moe_splits): (1, 1) is the unsplit
    kernel, so the rows exl3 and exl3_unsplit measure the rule. force_wgmma: the
    grouped GEMMs' engine instead of the op's choice (wgmma on Hopper for the 64- and
    128-row blocks): False is mma.sync everywhere, so the rows exl3 and exl3_mma
    measure the wgmma engine. force_pairs: the row layout instead of the few-token
    rule's (moe_plans.pairs_layout): False is vLLM's alignment at every size, so the
    rows exl3 and exl3_aligned measure the pairs layout where the rule takes it; True
    is the pairs layout at every size (row exl3_pairs), which places the rule's
    limit. force_block: the aligned layout's row block instead of the block-size
    rule's (moe_plans.block_size; rows exl3_blockB)."""
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        CudaExl3MoEKernel,
        Exl3MoEWeights,
        reconstruct_scratch_bytes,
        reserve_reconstruct_scratch,
    )
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        Exl3MoEOverrides,
        Exl3MoEPath,
    )

    expert_bytes = int(3 * h * i * bits / 8)
    layers = [
        ml.random_moe_layer(gen, e, h, i, [bits], codebook, gap=False)
        for _ in range(copies_for(expert_bytes, top_k))
    ]
    if reconstruct:
        path = Exl3MoEPath.RECONSTRUCT
    elif force_pairs is None:
        path = None
    else:
        path = Exl3MoEPath.PAIRS if force_pairs else Exl3MoEPath.ALIGNED
    kernel = CudaExl3MoEKernel(
        Exl3MoEOverrides(
            path=path, splits=force_splits, wgmma=force_wgmma, block=force_block
        )
    )
    weights = [
        Exl3MoEWeights(*lay.tensors(), num_experts=e, hidden=h, width=i)
        for lay in layers
    ]
    if reconstruct:
        # Reserved here regardless of the device-memory cap, so every shape is measured.
        reserve_reconstruct_scratch(
            weights[0].w13_trellis.device,
            reconstruct_scratch_bytes(weights[0], torch.bfloat16),
        )

    def call(x, w, ids, j):
        return kernel.apply(
            x,
            w,
            ids,
            weights[j],
            activation="silu",
            apply_router_weight_on_input=False,
            expert_map=None,
            global_num_experts=e,
            codebook=codebook,
            deterministic=deterministic,
        )

    return call, len(layers)


def bf16_variant(gen, h, i, e, top_k):
    from vllm.model_executor.layers.fused_moe import fused_experts

    copies = copies_for(3 * h * i * 2, top_k)

    def weights(*shape):  # drawn in bf16: DeepSeek-V3's layer is 22.5 GB per copy
        return torch.randn(
            shape, generator=gen, device="cuda", dtype=torch.bfloat16
        ).mul_(WEIGHT_SCALE)

    w1 = [weights(e, 2 * i, h) for _ in range(copies)]
    w2 = [weights(e, h, i) for _ in range(copies)]

    def call(x, w, ids, j):
        return fused_experts(x, w1[j], w2[j], w, ids)

    return call, copies


def marlin_variant(gen, h, i, e, top_k):
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.scalar_type import scalar_types

    copies = copies_for(3 * h * i * MARLIN_BITS // 8, top_k)
    pack = (
        MARLIN_BITS // 2
    )  # gptq_marlin_moe_repack's int32 words per 16 k-rows and column

    def words(*shape):
        return torch.randint(
            -(2**31), 2**31 - 1, shape, generator=gen, device="cuda", dtype=torch.int32
        )

    def scales(*shape):
        return (
            torch.rand(shape, generator=gen, device="cuda") * WEIGHT_SCALE
        ).bfloat16()

    w1 = [words(e, h // 16, 2 * i * pack) for _ in range(copies)]
    w2 = [words(e, i // 16, h * pack) for _ in range(copies)]
    s1 = [scales(e, h // MARLIN_GROUP, 2 * i) for _ in range(copies)]
    s2 = [scales(e, i // MARLIN_GROUP, h) for _ in range(copies)]

    def call(x, w, ids, j):
        return fused_marlin_moe(
            x,
            w1[j],
            w2[j],
            None,
            None,
            s1[j],
            s2[j],
            w,
            ids,
            quant_type_id=scalar_types.uint4b8.id,
            global_num_experts=e,
            is_k_full=True,
        )

    return call, copies


def exllamav3_checkpoint(
    work: Path, h: int, i: int, e: int, top_k: int, copies: int, bits: float, cb: int
) -> Path:
    """A Qwen3-MoE checkpoint in ExLlamaV3's layout with `copies` decoder layers at the
    shape's MoE dims, written once (into a .partial folder renamed when complete)."""
    target = work / f"qwen3moe-h{h}-i{i}-e{e}-k{top_k}-L{copies}-{bits:g}bpw-cb{cb}"
    if target.exists():
        return target
    import shutil

    from synthetic_checkpoint import load_config, write_checkpoint

    cfg = load_config("qwen3-moe-tiny")
    cfg.update(
        hidden_size=h,
        intermediate_size=i,
        moe_intermediate_size=i,
        num_experts=e,
        num_local_experts=e,
        num_experts_per_tok=top_k,
        head_dim=EXLLAMAV3_HEAD_DIM,
        num_attention_heads=h // EXLLAMAV3_HEAD_DIM,
        num_key_value_heads=EXLLAMAV3_KV_HEADS,
        vocab_size=EXLLAMAV3_VOCAB,
        max_window_layers=copies,
    )
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_checkpoint(
        cfg, partial, bits=bits, codebook=CODEBOOK_NAMES[cb], layers=copies
    )
    partial.rename(target)
    return target


def exllamav3_variant(args, h, i, e, top_k):
    """ExLlamaV3 1.6.5's BlockSparseMLP, one loaded decoder layer per weight copy."""
    if args.exl3_state is not None:
        exllamav3_anchor.load_linear_class(
            args.exl3_state, args.exl3_wait_s, args.exl3_import_timeout_s
        )
    elif importlib.util.find_spec("exllamav3") is None:
        raise exllamav3_anchor.AnchorUnavailable("exllamav3 is not importable")
    from exllamav3 import Config, Model

    copies = copies_for(int(3 * h * i * args.bits / 8), top_k)
    ckpt = exllamav3_checkpoint(
        args.exllamav3_work, h, i, e, top_k, copies, args.bits, args.codebook
    )
    model = Model.from_config(Config.from_directory(str(ckpt)))
    model.load(device="cuda:0")
    blocks = [model.find_module(f"model.layers.{j}.mlp") for j in range(copies)]

    def call(x, w, ids, j):
        return blocks[j].forward(x, {})

    call.close = model.unload
    return call, copies


def time_variant(make, gen, h, e, top_k, tokens, dtype=torch.bfloat16, profile=False):
    from vllm.model_executor.layers.quantization.exl3 import moe_kernels

    call, copies = make()
    try:
        out, copies = _time_calls(
            call, copies, gen, h, e, top_k, tokens, dtype, profile
        )
    finally:
        close = getattr(call, "close", None)
        if close is not None:
            close()
        del call
    # The variant's weights went with _time_calls's frame; give their memory back (and
    # the reconstruct scratch, which outlives it).
    moe_kernels._reconstruct_scratch.clear()
    torch.cuda.empty_cache()
    return out, copies


def aggregate_kernels(kernels, calls: int) -> list[tuple[str, float]]:
    """(name, µs per call) of (name, µs) kernel records over `calls` calls, summed by
    name, longest first."""
    total: dict[str, float] = {}
    for name, us in kernels:
        total[name] = total.get(name, 0.0) + us
    return sorted(
        ((n, t / calls) for n, t in total.items()), key=lambda r: r[1], reverse=True
    )


def kernel_breakdown(calls) -> list[tuple[str, float]]:
    """Each kernel's GPU time per call of one pass through `calls`, run eagerly under
    torch.profiler (kernel durations as inside the graph; the graph's time minus their
    sum is what the launches and the gaps between dependent kernels cost)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for c in calls:
        c()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for c in calls:
            c()
        torch.cuda.synchronize()
    kernels = [
        (ev.name, ev.time_range.elapsed_us())
        for ev in prof.events()
        if ev.device_type == DeviceType.CUDA
    ]
    return aggregate_kernels(kernels, len(calls))


def _time_calls(call, copies, gen, h, e, top_k, tokens, dtype, profile=False):
    out = {}
    for m in tokens:
        x = (torch.randn(m, h, generator=gen, device="cuda") / math.sqrt(h)).to(dtype)
        w, ids = routing(gen, m, top_k, e)
        calls = [
            lambda j=j, x=x, w=w, ids=ids, call=call: call(x, w, ids, j)
            for j in range(copies)
        ]
        us, mode = graph_time_us(calls, m)
        out[m] = (us, mode)
        print(f"    m={m:5d} {us:9.1f} us ({mode})", flush=True)
        if profile:
            kernels = kernel_breakdown(calls)
            busy = sum(t for _, t in kernels)
            print(
                f"      kernels {busy:.1f} us of {us:.1f} ({len(kernels)} kinds): "
                + "; ".join(f"{n[:60]} {t:.1f}" for n, t in kernels),
                flush=True,
            )
    return out, copies


class SplitEntry(NamedTuple):
    """One --split-sweep entry: its row label and the two grouped GEMMs' k-splits."""

    label: str
    gate_up: int
    down: int


def split_entry(text: str) -> SplitEntry:
    """A --split-sweep entry: "S" (both GEMMs S ways, row exl3_splitS) or "GxD"
    (gate/up G ways, down D ways, row exl3_splitGxD)."""
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"--split-sweep entry {text!r}: want S or GxD with positive integers "
            "(e.g. 2 or 3x1)"
        )
    g, d = int(parts[0]), int(parts[-1])
    return SplitEntry(f"{g}x{d}" if len(parts) == 2 else str(g), g, d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--ext", default=None, help="path of _exl3_C.abi3.so (default: build/exl3)"
    )
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--codebook", type=int, default=1, help="0 3INST, 1 MCG, 2 MUL1")
    ap.add_argument("--deterministic", action="store_true")
    exllamav3_anchor.add_state_arguments(ap, "its MoE anchor")
    ap.add_argument(
        "--exllamav3-work",
        type=Path,
        default=Path("/tmp/vx/bench_moe_exllamav3"),
        help="where the ExLlamaV3 anchor checkpoints are written (and reused)",
    )
    ap.add_argument(
        "--write-exllamav3-only",
        action="store_true",
        help="write the anchor checkpoints of --shapes and exit (CPU, no vLLM)",
    )
    ap.add_argument(
        "--no-exllamav3", action="store_true", help="skip the ExLlamaV3 anchor"
    )
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument(
        "--no-reconstruct",
        action="store_true",
        help="skip the exl3_reconstruct row (the large-batch path at every size)",
    )
    ap.add_argument(
        "--no-aligned",
        action="store_true",
        help="skip the exl3_aligned row (the grouped GEMM over vLLM's alignment at "
        "every size; the exl3 row runs the pairs layout where the few-token rule takes "
        "it)",
    )
    ap.add_argument(
        "--no-pairs",
        action="store_true",
        help="skip the exl3_pairs row (the pairs layout at every size, past the "
        "few-token rule's limit too)",
    )
    ap.add_argument(
        "--no-unsplit",
        action="store_true",
        help="skip the exl3_unsplit row (the grouped GEMM without the few-token "
        "split-k)",
    )
    ap.add_argument(
        "--no-mma",
        action="store_true",
        help="skip the exl3_mma row (the grouped GEMM on mma.sync at every block "
        "size; the exl3 row runs Hopper's 64- and 128-row blocks on wgmma)",
    )
    ap.add_argument(
        "--split-sweep",
        nargs="*",
        type=split_entry,
        default=[],
        metavar="S|GxD",
        help="also rows exl3_splitS (both grouped GEMMs' k cut S ways at the decode "
        "tiers) and exl3_splitGxD (gate/up G ways, down D ways), each capped at its "
        "k's 64-deep stages, to place the split rule",
    )
    ap.add_argument(
        "--block-sweep",
        nargs="*",
        type=int,
        default=[],
        metavar="B",
        help="also rows exl3_blockB: the aligned layout with B-row blocks at every "
        "size (where the rule takes the pairs layout too), to place the block-size "
        "rule",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after each timing, print every kernel's GPU time per call (an eager "
        "pass under torch.profiler) beside the graph time",
    )
    args = ap.parse_args(argv)
    if args.write_exllamav3_only:
        for name in args.shapes:
            h, i, e, top_k = SHAPES[name]
            copies = copies_for(int(3 * h * i * args.bits / 8), top_k)
            print(
                exllamav3_checkpoint(
                    args.exllamav3_work,
                    h,
                    i,
                    e,
                    top_k,
                    copies,
                    args.bits,
                    args.codebook,
                ),
                flush=True,
            )
        return 0

    ext = load_extension(args.ext)
    from vllm.config import VllmConfig, set_current_vllm_config

    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    with set_current_vllm_config(VllmConfig()):
        for name in args.shapes:
            h, i, e, top_k = SHAPES[name]
            print(
                f"{name}: hidden {h}, width {i}, {e} experts, top-{top_k}", flush=True
            )
            shape = (h, i, e, top_k)
            exl3 = functools.partial(
                exl3_variant, gen, *shape, args.bits, args.codebook, args.deterministic
            )
            variants = [("exl3", exl3)]
            if not args.no_aligned:
                variants.append(
                    ("exl3_aligned", functools.partial(exl3, force_pairs=False))
                )
            if not args.no_pairs:
                variants.append(
                    ("exl3_pairs", functools.partial(exl3, force_pairs=True))
                )
            if not args.no_mma:
                variants.append(
                    ("exl3_mma", functools.partial(exl3, force_wgmma=False))
                )
            if not args.no_unsplit:
                variants.append(
                    ("exl3_unsplit", functools.partial(exl3, force_splits=(1, 1)))
                )
            variants += [
                (
                    f"exl3_split{sp.label}",
                    functools.partial(exl3, force_splits=(sp.gate_up, sp.down)),
                )
                for sp in args.split_sweep
            ]
            variants += [
                (
                    f"exl3_block{b}",
                    functools.partial(exl3, force_pairs=False, force_block=b),
                )
                for b in args.block_sweep
            ]
            if not args.no_reconstruct:
                variants.append(
                    ("exl3_reconstruct", functools.partial(exl3, reconstruct=True))
                )
            if not args.no_anchors:
                variants += [
                    (
                        "bf16_fused_experts",
                        functools.partial(bf16_variant, gen, *shape),
                    ),
                    (
                        "marlin_int4_g128",
                        functools.partial(marlin_variant, gen, *shape),
                    ),
                ]
            if not args.no_anchors and not args.no_exllamav3:
                variants.append(
                    ("exllamav3", functools.partial(exllamav3_variant, args, *shape))
                )
            times = {}
            for vname, make in variants:
                print(f"  {vname}", flush=True)
                dtype = EXLLAMAV3_DTYPE if vname == "exllamav3" else torch.bfloat16
                try:
                    times[vname], copies = time_variant(
                        make, gen, h, e, top_k, args.tokens, dtype, args.profile
                    )
                except Exception as ex:  # noqa: BLE001 - an anchor that cannot run is recorded
                    why = (
                        f"unavailable: {ex}"
                        if isinstance(ex, exllamav3_anchor.AnchorUnavailable)
                        else f"failed: {type(ex).__name__}: {ex}"
                    )[:300]
                    print(f"    {why}", flush=True)
                    times[vname] = {m: (None, why) for m in args.tokens}
                    copies = 0
                    from vllm.model_executor.layers.quantization.exl3 import (
                        moe_kernels,
                    )

                    moe_kernels._reconstruct_scratch.clear()
                    torch.cuda.empty_cache()
                for m in args.tokens:
                    us, mode = times[vname][m]
                    rows.append(
                        dict(
                            shape=name,
                            hidden=h,
                            width=i,
                            experts=e,
                            top_k=top_k,
                            tokens=m,
                            variant=vname,
                            us=us,
                            mode=mode,
                            copies=copies,
                        )
                    )
            for r in rows:
                if r["shape"] == name and r["variant"].startswith("exl3"):
                    base = times.get("bf16_fused_experts", {}).get(
                        r["tokens"], (None,)
                    )[0]
                    r["vs_bf16"] = (r["us"] / base) if (r["us"] and base) else None
                    ex = times.get("exllamav3", {}).get(r["tokens"], (None,))[0]
                    r["vs_exllamav3"] = (r["us"] / ex) if (r["us"] and ex) else None

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        extension=ext,
        bits=args.bits,
        codebook=args.codebook,
        deterministic=args.deterministic,
        # exl3_split<label>: the (gate_up, down) k-splits forced at the decode tiers.
        split_sweep={sp.label: [sp.gate_up, sp.down] for sp in args.split_sweep},
        # exl3_block<B>: the aligned layout's row block forced.
        block_sweep=args.block_sweep,
        pool_bytes=POOL_BYTES,
        timing="CUDA-graph replay median / calls per pass",
        exllamav3=(
            "skipped (--no-exllamav3 / --no-anchors)"
            if args.no_exllamav3 or args.no_anchors
            else "BlockSparseMLP forward, fp16 input, its own router included"
        ),
    )
    (args.out / f"bench_moe_{stamp}.json").write_text(
        json.dumps(dict(meta=meta, rows=rows), indent=1)
    )
    lines = [
        "| shape | tokens | exl3 us | exl3 aligned us | exl3 pairs us | exl3 mma us | "
        "exl3 unsplit us | exl3 reconstruct us | bf16 us | marlin us | exllamav3 us | "
        "exl3/bf16 | best exl3/bf16 |"
        + "".join(f" split {sp.label} us |" for sp in args.split_sweep)
        + "".join(f" block {b} us |" for b in args.block_sweep),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + "---:|" * (len(args.split_sweep) + len(args.block_sweep)),
    ]
    for name in args.shapes:
        for m in args.tokens:
            get = {
                r["variant"]: r for r in rows if r["shape"] == name and r["tokens"] == m
            }

            def fmt(v, get=get):
                u = get.get(v, {}).get("us")
                return f"{u:.1f}" if u else "-"

            ratio = get.get("exl3", {}).get("vs_bf16")
            best = min(
                (
                    get[v]["vs_bf16"]
                    for v in ("exl3", "exl3_reconstruct")
                    if get.get(v, {}).get("vs_bf16")
                ),
                default=None,
            )
            lines.append(
                f"| {name} | {m} | {fmt('exl3')} | {fmt('exl3_aligned')} | "
                f"{fmt('exl3_pairs')} | {fmt('exl3_mma')} | "
                f"{fmt('exl3_unsplit')} | "
                f"{fmt('exl3_reconstruct')} | "
                f"{fmt('bf16_fused_experts')} | {fmt('marlin_int4_g128')} | "
                f"{fmt('exllamav3')} | {f'{ratio:.2f}' if ratio else '-'} | "
                f"{f'{best:.2f}' if best else '-'} |"
                + "".join(
                    f" {fmt(f'exl3_split{sp.label}')} |" for sp in args.split_sweep
                )
                + "".join(f" {fmt(f'exl3_block{b}')} |" for b in args.block_sweep)
            )
    table = "\n".join(lines)
    (args.out / f"bench_moe_{stamp}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
