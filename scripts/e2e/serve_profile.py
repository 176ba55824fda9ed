#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a decode step of `vllm serve` goes, per variant: serve_bench.py's server and
load (8k in / 1k out, its synthetic checkpoints and dummy variants), one wave of
`--concurrency` prompts through `vllm bench serve --profile`, and vLLM's own torch
profiler (`--profiler-config`) recording a window of engine iterations after the wave's
prefills. The trace is summarized per variant: the decode-only iterations (vLLM's
`execute_context_0(0)_generation_N(N)` annotations) with the wall time from one to the
next, the GPU kernels by total time per decode iteration, the CUDA runtime calls and
the host ops by self time. Side by side, the variants show whether a slower decode step
is kernel time or host time (a synchronization shows as a long runtime call). The
servers run with `VLLM_GPU_SYNC_CHECK=warn` (vLLM's check around each step's model and
sampler calls after warm-up): the code locations of the host-device synchronizations it
reports in the server's log are listed per variant.

    python3 scripts/e2e/serve_profile.py --preset qwen3-30b-a3b --variants exl3,gptq \
        --concurrency 16 --out OUT

Writes serve_profile.json and, per variant, vLLM's trace under OUT/profiles/; `--trace
FILE` (one per variant, in --variants' order) summarizes traces written earlier, on any
machine. Beside the totals: the median time of a decoder layer (attention start to the
next) and of the variant's MoE block (MOE_SPANS). The timings of a profiled wave are not
serving results (the profiler slows the steps it records); serve_bench.py measures
those.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from vllm_exl3.e2e import serve_bench as sb
from vllm_exl3.e2e.run_fixture_e2e import free_port
from vllm_exl3.e2e.throughput import (
    GPU_MEMORY_UTILIZATION,
    PRESETS,
    checkpoint_dir,
    ensure_checkpoint,
)

RESULT_NAME = "serve_profile.json"
# vLLM 0.26's `vllm serve` schedules at most this many tokens per iteration on these
# GPUs (its log: "Chunked prefill is enabled with max_num_batched_tokens=8192"), so a
# wave of C 8k prompts takes about C prefill iterations before decoding alone.
PREFILL_TOKENS_PER_ITERATION = 8192
# Iterations skipped after the wave's prefills (the first decode steps share the batch
# with the last prefill chunks) and iterations recorded: enough decode steps for stable
# medians, few enough that the trace stays tens of MB.
PROFILE_MARGIN_ITERATIONS = 16
PROFILE_ITERATIONS = 48
# Names kept per part of the summary: the heads of these lists hold nearly all the time.
TOP = 15
# Trace categories of torch's Chrome-trace export.
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CAT = "cuda_runtime"
HOST_CATS = ("cpu_op", "python_function", "user_annotation", "cuda_runtime")
STEP_PREFIX = "execute_context_"
# A decoder layer's attention kernel (FlashAttention 3, vLLM's default on Hopper, or
# FlashAttention 2's): one launch per layer and decode step, so the median gap between
# consecutive starts is one layer's time.
LAYER_KERNELS = ("FlashAttnFwdSm90", "flash_fwd_splitkv_kernel", "flash_fwd_kernel")
# Each variant's MoE block after the router's top-k and vLLM's block alignment (which
# every variant shares): the first kernel's start to the last one's end. EXL3: the
# routed rows' input transform to the combine; GPTQ: Marlin MoE's gate/up GEMM to
# vLLM's moe_sum.
MOE_SPANS = {
    "exl3": ("exl3_moe_input_transform", "exl3_moe_finish_sum"),
    "gptq": ("marlin_moe_wna16", "moe_sum"),
}
TRACE_POLL_S = 2.0
# What torch's sync debug mode (`warn`) prints for a synchronizing CUDA call, after the
# Python location that made it.
SYNC_WARNING = re.compile(
    r"(\S+\.py:\d+): UserWarning: called a synchronizing CUDA operation"
)


def sync_locations(log_text: str) -> list[str]:
    """The distinct code locations of the synchronizations a server's log reports, in
    order of first appearance."""
    return list(dict.fromkeys(SYNC_WARNING.findall(log_text)))


def profile_window(concurrency: int) -> tuple[int, int]:
    """(iterations to skip, iterations to record) for one wave at `concurrency`."""
    prefill = concurrency * math.ceil(sb.INPUT_LEN / PREFILL_TOKENS_PER_ITERATION)
    return prefill + PROFILE_MARGIN_ITERATIONS, PROFILE_ITERATIONS


def profiler_config(trace_dir: Path, concurrency: int) -> str:
    delay, iterations = profile_window(concurrency)
    return json.dumps(
        {
            "profiler": "torch",
            "torch_profiler_dir": str(trace_dir.resolve()),
            "delay_iterations": delay,
            "max_iterations": iterations,
            # Stacks multiply the trace's size; the op names are what is summarized.
            "torch_profiler_with_stack": False,
            # The API server's own trace covers the whole wave, not the window.
            "ignore_frontend": True,
        }
    )


def decode_step(name: str) -> int | None:
    """The sequence count of a decode-only iteration's annotation, else None."""
    if not name.startswith(STEP_PREFIX + "0(0)_generation_"):
        return None
    count = name.rsplit("_", 1)[1].split("(", 1)[0]
    return int(count) if count.isdigit() else None


def self_times(events: list[dict]) -> dict[str, float]:
    """Self time (µs) per name of host events: each event's duration less that of the
    events nested directly inside it on the same thread."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    totals: dict[str, float] = defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        own = [float(e["dur"]) for e in evs]
        stack: list[tuple[float, int]] = []  # (end, index) of the open events
        for i, e in enumerate(evs):
            while stack and e["ts"] >= stack[-1][0]:
                stack.pop()
            if stack:
                own[stack[-1][1]] -= e["dur"]
            stack.append((e["ts"] + e["dur"], i))
        for e, t in zip(evs, own):
            totals[e["name"]] += max(t, 0.0)
    return dict(totals)


def layer_us_median(kernels: list[dict]) -> float | None:
    """The median gap between consecutive starts of the first of LAYER_KERNELS found
    (kernels in start order)."""
    for pattern in LAYER_KERNELS:
        starts = [e["ts"] for e in kernels if pattern in e["name"]]
        if len(starts) > 1:
            return round(
                statistics.median(b - a for a, b in zip(starts, starts[1:])), 1
            )
    return None


def moe_us_median(kernels: list[dict], variant: str | None) -> float | None:
    """The median span of the variant's MoE block (MOE_SPANS) over the kernels in start
    order: a start kernel to the next end kernel (a start without an end, e.g. a layer
    that combined another way, is dropped at the next start, not spanned across
    layers)."""
    if variant not in MOE_SPANS:
        return None
    first, last = MOE_SPANS[variant]
    spans, start = [], None
    for e in kernels:
        if first in e["name"]:
            start = e["ts"]
        elif start is not None and last in e["name"]:
            spans.append(e["ts"] + e["dur"] - start)
            start = None
    return round(statistics.median(spans), 1) if spans else None


def summarize(trace: dict, variant: str | None = None) -> dict:
    """The window's decode iterations, kernels, runtime calls and host ops; the median
    layer and MoE block times (the latter for a variant of MOE_SPANS)."""
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and "dur" in e and "ts" in e
    ]
    steps = sorted(
        (
            e
            for e in events
            if e.get("cat") == "user_annotation" and e["name"].startswith("execute_")
        ),
        key=lambda e: e["ts"],
    )
    decode = [e for e in steps if decode_step(e["name"]) is not None]
    if not decode:
        raise ValueError(
            "serve_profile: the trace holds no decode-only iteration "
            f"({STEP_PREFIX}0(0)_generation_N(N)); the window missed the decode phase"
        )
    starts = [e["ts"] for e in steps]
    gaps = sorted(
        b - a
        for a, b, e in zip(starts, starts[1:], steps)
        if decode_step(e["name"]) is not None
    )
    span = (decode[0]["ts"], decode[-1]["ts"] + decode[-1]["dur"])
    inside = [e for e in events if span[0] <= e["ts"] < span[1]]

    def top(pairs: dict[str, float]) -> list[dict]:
        ranked = sorted(pairs.items(), key=lambda kv: -kv[1])[:TOP]
        return [
            {"name": n, "us_per_step": round(t / len(decode), 1)} for n, t in ranked
        ]

    in_order = sorted(
        (e for e in inside if e.get("cat") in KERNEL_CATS), key=lambda e: e["ts"]
    )
    kernels: dict[str, float] = defaultdict(float)
    runtime: dict[str, float] = defaultdict(float)
    for e in inside:
        if e.get("cat") in KERNEL_CATS:
            kernels[e["name"]] += e["dur"]
        elif e.get("cat") == RUNTIME_CAT:
            runtime[e["name"]] += e["dur"]
    host = self_times([e for e in inside if e.get("cat") in HOST_CATS])
    return {
        "decode_steps": len(decode),
        "sequences": sorted({decode_step(e["name"]) for e in decode}),
        "step_wall_us_median": round(gaps[len(gaps) // 2], 1) if gaps else None,
        "step_host_us_median": round(
            sorted(e["dur"] for e in decode)[len(decode) // 2], 1
        ),
        "kernel_us_per_step": round(sum(kernels.values()) / len(decode), 1),
        "layer_us_median": layer_us_median(in_order),
        "moe_us_median": moe_us_median(in_order, variant),
        "kernels": top(kernels),
        "runtime": top(runtime),
        "host_self": top(host),
    }


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def wait_for_trace(trace_dir: Path, timeout: float) -> Path:
    """The worker's trace once its size stops changing (vLLM writes it when the
    window's last iteration ends or at /stop_profile)."""
    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        found = sorted(trace_dir.rglob("*.pt.trace.json*"))
        sizes = [f.stat().st_size for f in found]
        if found and sizes == last:
            return found[-1]
        last = sizes
        time.sleep(TRACE_POLL_S)
    raise TimeoutError(
        f"serve_profile: no complete trace in {trace_dir} after {timeout:.0f} s"
    )


def profile_variant(
    preset: str,
    v: sb.Variant,
    c: int,
    memory: float,
    tokenizer: Path,
    budget: sb.Budget,
    out: Path,
) -> dict:
    trace_dir = out / "profiles" / f"{preset}-{v.name}-c{c}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = sb.serve_command(v, port, memory, tokenizer) + [
        "--profiler-config",
        profiler_config(trace_dir, c),
    ]
    logs, results = out / "logs", out / "bench_results"
    logs.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    env = sb.server_env() | {"VLLM_GPU_SYNC_CHECK": "warn"}
    server = sb.Server(cmd, port, logs / f"serve-{preset}-{v.name}.log", env)
    sb.log(f"{preset} {v.name}: starting {' '.join(cmd)}")
    with server:
        ready = server.wait_ready(
            min(sb.SERVER_READY_TIMEOUT_S, budget.left() - sb.STOP_MARGIN_S)
        )
        name = f"profile-{preset}-{v.name}-c{c}.json"
        bench = sb.bench_command(
            port,
            c,
            sb.row_seed(preset, v.name, c),
            results,
            name,
            tokenizer,
            waves=1,
        ) + ["--profile"]
        with open(logs / name.replace(".json", ".log"), "w") as logf:
            rc = subprocess.run(
                bench,
                stdout=logf,
                stderr=subprocess.STDOUT,
                timeout=max(budget.left() - sb.STOP_MARGIN_S, 1),
            ).returncode
        if rc != 0:
            raise RuntimeError(f"{preset} {v.name}: vllm bench serve exited with {rc}")
        trace = wait_for_trace(trace_dir, max(budget.left() - sb.STOP_MARGIN_S, 1))
    summary = summarize(read_trace(trace), v.name)
    syncs = sync_locations(server.logfile.read_text(errors="replace"))
    return {
        "preset": preset,
        "variant": v.name,
        "concurrency": c,
        "server_ready_s": round(ready, 1),
        "trace": str(trace),
        "gpu_syncs": syncs,
        **summary,
    }


def _us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} us"


def format_summary(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        wall = r["step_wall_us_median"]
        lines.append(
            f"{r['preset']} {r['variant']} c={r['concurrency']}: {r['decode_steps']} "
            f"decode steps of {r['sequences']} sequences, wall "
            f"{'n/a' if wall is None else f'{wall / 1e3:.2f}'} ms, host "
            f"{r['step_host_us_median'] / 1e3:.2f} ms, kernels "
            f"{r['kernel_us_per_step'] / 1e3:.2f} ms per step; a layer "
            f"{_us(r['layer_us_median'])}, its MoE block {_us(r['moe_us_median'])}"
        )
        for loc in r["gpu_syncs"]:
            lines.append(f"    sync      {loc}")
        for part in ("kernels", "runtime", "host_self"):
            for item in r[part][:6]:
                lines.append(
                    f"    {part:9s} {item['us_per_step']:9.1f} us  {item['name'][:90]}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", sb.REPO / ".e2e" / "profile")),
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/vx/throughput"))
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=list(PRESETS))
    ap.add_argument("--variants", default="exl3,gptq")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument(
        "--trace",
        type=Path,
        action="append",
        default=[],
        help="summarize this trace (of the first of --variants, the next trace of the "
        "next) and start nothing: no GPU needed; repeatable",
    )
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    if args.trace:
        if len(args.trace) > len(names):
            ap.error(f"{len(args.trace)} traces but {len(names)} --variants")
        rows = [
            {"preset": args.preset, "variant": v, "concurrency": args.concurrency}
            | {"trace": str(t), "gpu_syncs": []}
            | summarize(read_trace(t), v)
            for t, v in zip(args.trace, names)
        ]
        print(format_summary(rows))
        return 0
    if not names or set(names) - set(sb.VLLM_VARIANTS):
        ap.error(f"--variants takes some of {','.join(sb.VLLM_VARIANTS)}, got {names}")
    if args.concurrency < 1:
        ap.error(f"--concurrency must be at least 1, got {args.concurrency}")
    budget = sb.Budget(args.budget_s)
    exl3 = ensure_checkpoint(
        checkpoint_dir(args.work, args.preset, None, sb.EXL3_BITS, sb.EXL3_CODEBOOK),
        args.preset,
        None,
        sb.EXL3_BITS,
        sb.EXL3_CODEBOOK,
    )
    memory = args.gpu_memory_utilization or GPU_MEMORY_UTILIZATION[args.preset]
    tokenizer = sb.model_tokenizer(args.work, exl3)
    record: dict = {"host": sb.host_facts(), "rows": [], "errors": []}
    for v in sb.variants(exl3, args.work, names):
        try:
            record["rows"].append(
                profile_variant(
                    args.preset,
                    v,
                    args.concurrency,
                    memory,
                    tokenizer,
                    budget,
                    args.out,
                )
            )
        except (RuntimeError, TimeoutError, ValueError, subprocess.TimeoutExpired) as e:
            record["errors"].append(f"{args.preset} {v.name}: {e}")
            sb.log(f"{args.preset} {v.name}: {str(e).splitlines()[0]}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULT_NAME).write_text(json.dumps(record, indent=1))
    print(format_summary(record["rows"]))
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
