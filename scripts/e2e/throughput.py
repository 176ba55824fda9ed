#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Throughput on a CUDA host where the built wheel (or the offline bundle) is installed:
a synthetic EXL3 checkpoint at real dims (vllm_exl3.testing.synthetic_checkpoint,
preset qwen3-8b or qwen3-30b-a3b, 4 bpw, written here on the host) next to the same dims
in bf16 and as GPTQ int4 group 128 (both load_format="dummy"), vLLM offline generation
with fixed input/output lengths (ignore_eos) at several concurrencies, the engines one
after another in one process: output tok/s and TPOT. vLLM's defaults (torch.compile +
CUDA graphs).

`--write-only` writes the synthetic checkpoint and exits (needs torch, not vLLM): start
it in the background early so that the measuring run finds it ready. The checkpoint is
always written by a child process, so that no torch thread has run in this one when
vLLM forks its engine (ensure_checkpoint).

Prints a table; writes throughput.json to --out (default $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from vllm_exl3.e2e.measures import free_llm

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Presets of vllm_exl3.testing.synthetic_checkpoint with their decoder layer count.
PRESETS = {"qwen3-8b": 36, "qwen3-30b-a3b": 48}
MODELS = ("exl3", "bf16", "gptq")
CONCURRENCY = (1, 4, 16, 64)
INPUT_LEN = 512
OUTPUT_LEN = 256
# Per preset: an 8B model at bf16 is 16 GB, half the H200 leaves ample KV cache for 64 x
# 768 tokens; Qwen3-30B-A3B at bf16 is 61 GB, so it gets 0.8 (113 GB).
GPU_MEMORY_UTILIZATION = {"qwen3-8b": 0.5, "qwen3-30b-a3b": 0.8}
# GPTQ int4 group 128, symmetric, no act-order: vLLM's Marlin kernels (dense and MoE).
GPTQ_BITS = 4
GPTQ_GROUP = 128
# With dummy weights vLLM cannot infer from safetensors which linears are quantized, so
# the config lists them (substrings of module names); routed experts are always GPTQ,
# the MoE router stays bf16 as in real GPTQ MoE checkpoints.
GPTQ_ATTENTION = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
]
GPTQ_DENSE_MLP = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
# Output tokens of the warm-up pass run at every concurrency before any is timed: the
# first prefill of a new size compiles Triton kernels for it (vLLM's fused MoE among
# them), a one-time stall of up to a second that would otherwise land in that
# concurrency's timed pass.
WARMUP_TOKENS = 8
# Seconds assumed for one engine (start-up with compile + graph capture of an 8B model,
# plus the passes) when deciding whether the next one still fits the budget.
ENGINE_COST_S = 180
WRITER_POLL_S = 2
HOST_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}  # flashinfer is not on the host


def log(msg: str) -> None:
    print(f"[throughput {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def checkpoint_dir(
    work: Path, preset: str, layers: int | None, bits: float, codebook: str
) -> Path:
    return work / f"exl3-{preset}-L{layers or 'all'}-{bits:g}bpw-{codebook}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def writer_command(
    out: Path, preset: str, layers: int | None, bits: float, codebook: str
) -> list[str]:
    """The synthetic checkpoint writer as a command of its own (see ensure_checkpoint
    for why it never runs in this process)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm_exl3.testing.synthetic_checkpoint",
        "--config",
        preset,
        "--out",
        str(out),
        "--bits",
        f"{bits:g}",
        "--codebook",
        codebook,
    ]
    return cmd + (["--layers", str(layers)] if layers is not None else [])


def ensure_checkpoint(
    target: Path, preset: str, layers: int | None, bits: float, codebook: str
) -> Path:
    """The synthetic checkpoint at `target`: reuse it, wait for a writer already at work
    on it (a background --write-only), or write it (into target.partial, renamed when
    complete).

    The writer runs in a child process: it runs torch ops, which start torch's intra-op
    worker threads, and vLLM's engine, started later from this process, is forked by
    default (VLLM_WORKER_MULTIPROC_METHOD=fork); a process forked after those threads
    ran inherits their locks but not the threads, and the engine hung there in futex
    waits. So this process runs no torch op of its own before its engines start."""
    partial = target.with_name(target.name + ".partial")
    pidfile = partial / "writer.pid"
    while not target.exists() and pidfile.exists():
        # The writing process and its writer child, either of which still works on
        # it (none listed yet: the file is being written).
        pids = [int(p) for p in pidfile.read_text().split()]
        if pids and not any(_pid_alive(p) for p in pids):
            log(f"stale partial checkpoint (writer {pids} gone): rewriting")
            break
        log(f"waiting for writer {pids} of {target}")
        time.sleep(WRITER_POLL_S)
    if target.exists():
        return target
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    pidfile.write_text(str(os.getpid()))
    t0 = time.monotonic()
    cmd = writer_command(partial, preset, layers, bits, codebook)
    writer = subprocess.Popen(cmd)
    pidfile.write_text(f"{os.getpid()} {writer.pid}")
    if writer.wait():
        raise RuntimeError(
            f"throughput: the checkpoint writer exited with {writer.returncode} "
            f"({' '.join(cmd)}); {partial} is left as it stopped"
        )
    pidfile.unlink()
    partial.rename(target)
    size = sum(f.stat().st_size for f in target.iterdir())
    log(f"wrote {target} ({size / 1e9:.2f} GB) in {time.monotonic() - t0:.0f} s")
    return target


def bf16_dir(exl3_dir: Path, work: Path) -> Path:
    """Same config without the quantization block: weights come from
    load_format='dummy'."""
    cfg = json.loads((exl3_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    out = work / (exl3_dir.name.replace("exl3-", "bf16-dummy-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def gptq_dir(exl3_dir: Path, work: Path) -> Path:
    """Same config as GPTQ int4 (dummy weights)."""
    cfg = json.loads((exl3_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    moe = bool(cfg.get("num_experts") or cfg.get("n_routed_experts"))
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": GPTQ_BITS,
        "group_size": GPTQ_GROUP,
        "desc_act": False,
        "sym": True,
        "modules_in_block_to_quantize": [
            GPTQ_ATTENTION + ([] if moe else GPTQ_DENSE_MLP)
        ],
    }
    out = work / (exl3_dir.name.replace("exl3-", "gptq-int4-dummy-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def make_llm(
    model_dir: Path, *, dummy: bool, max_len: int, max_seqs: int, memory: float
):
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        load_format="dummy" if dummy else "auto",
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        gpu_memory_utilization=memory,
        enable_prefix_caching=False,
        disable_log_stats=False,
        seed=0,
    )


def prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[dict]:
    return [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}
        for _ in range(count)
    ]


def measure(llm, batch: list[dict], output_len: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=output_len,
        min_tokens=output_len,
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
    )
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != output_len * len(batch):
        raise RuntimeError(
            f"generated {tokens} tokens, expected {output_len} x {len(batch)}"
        )
    tpots, ttfts = [], []
    for o in outs:
        m = o.metrics
        if (
            m is not None
            and getattr(m, "last_token_ts", 0)
            and m.num_generation_tokens > 1
        ):
            tpots.append(
                (m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1)
            )
            ttfts.append(m.first_token_latency)
    out = {
        "concurrency": len(batch),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        # Upper bound of TPOT when vLLM gives no per-request timestamps (includes
        # prefill).
        "wall_ms_per_step": 1e3 * elapsed / output_len,
    }
    if tpots:
        out["tpot_ms"] = 1e3 * sum(tpots) / len(tpots)
        out["ttft_ms"] = 1e3 * sum(ttfts) / len(ttfts)
    return out


def run_model(
    label: str, model_dir: Path, *, dummy: bool, args: argparse.Namespace, vocab: int
) -> dict:
    t0 = time.monotonic()
    llm = make_llm(
        model_dir,
        dummy=dummy,
        max_len=args.input_len + args.output_len + 16,
        max_seqs=max(args.concurrency),
        memory=args.gpu_memory_utilization,
    )
    result: dict = {"start_s": round(time.monotonic() - t0, 1), "runs": []}
    try:
        rng = random.Random(0)
        for c in args.concurrency:
            measure(llm, prompts(rng, c, args.input_len, vocab), WARMUP_TOKENS)
        for c in args.concurrency:
            # Repeats follow each other in the same engine: a one-time cost the
            # warm-up missed shows as the first repeat alone being slow.
            for rep in range(args.repeat):
                r = measure(
                    llm, prompts(rng, c, args.input_len, vocab), args.output_len
                )
                r["repeat"] = rep
                log(
                    f"{label} c={c} #{rep}: {r['output_tok_s']:.0f} tok/s, TPOT "
                    f"{r.get('tpot_ms', float('nan')):.2f} ms, TTFT "
                    f"{r.get('ttft_ms', float('nan')):.1f} ms"
                )
                result["runs"].append(r)
    finally:
        free_llm(llm)
    result["total_s"] = round(time.monotonic() - t0, 1)
    return result


def print_table(models: dict[str, dict]) -> None:
    print(
        f"\n{'model':8s} {'conc':>5s} {'out tok/s':>10s} {'TPOT ms':>8s} "
        f"{'TTFT ms':>8s}"
    )
    for label, m in models.items():
        for r in m.get("runs", []):
            print(
                f"{label:8s} {r['concurrency']:5d} {r['output_tok_s']:10.0f} "
                f"{r.get('tpot_ms', float('nan')):8.2f} "
                f"{r.get('ttft_ms', float('nan')):8.1f}"
            )
    for other in ("bf16", "gptq"):
        if "exl3" in models and other in models:
            for a, b in zip(models["exl3"]["runs"], models[other]["runs"]):
                ratio = a["output_tok_s"] / b["output_tok_s"]
                print(f"exl3/{other} c={a['concurrency']}: output tok/s x{ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", REPO / ".e2e" / "results")),
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/vx/throughput"),
        help="where the synthetic checkpoint and the bf16 config are written",
    )
    ap.add_argument("--preset", default="qwen3-8b", choices=list(PRESETS))
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: all of the preset's, "
        + ", ".join(f"{k} {v}" for k, v in PRESETS.items())
        + "); fewer to fit a budget",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="default per preset: "
        + ", ".join(f"{k} {v}" for k, v in GPU_MEMORY_UTILIZATION.items()),
    )
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument(
        "--codebook",
        default="mul1",
        choices=("3inst", "mcg", "mul1"),
        help="mul1: ExLlamaV3 1.6.5's default",
    )
    ap.add_argument("--input-len", type=int, default=INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each concurrency this many times in a row (same engine)",
    )
    ap.add_argument(
        "--models",
        default="exl3,bf16",
        help=f"which of {','.join(MODELS)} to run, in order",
    )
    ap.add_argument(
        "--write-only",
        action="store_true",
        help="write the synthetic checkpoint and exit (no vLLM needed)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=540,
        help="skip an engine that would not finish within this many seconds",
    )
    args = ap.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    models = [m for m in args.models.split(",") if m]
    if set(models) - set(MODELS) or not models:
        ap.error(f"--models takes some of {','.join(MODELS)}, got {args.models}")
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = GPU_MEMORY_UTILIZATION[args.preset]
    end = time.monotonic() + args.budget_s
    t0 = time.monotonic()
    args.work.mkdir(parents=True, exist_ok=True)
    exl3 = ensure_checkpoint(
        checkpoint_dir(args.work, args.preset, args.layers, args.bits, args.codebook),
        args.preset,
        args.layers,
        args.bits,
        args.codebook,
    )
    if args.write_only:
        return 0
    for k, v in HOST_ENV.items():
        os.environ.setdefault(k, v)
    vocab = json.loads((exl3 / "config.json").read_text())["vocab_size"]
    dirs = {
        "exl3": (exl3, False),
        "bf16": (bf16_dir(exl3, args.work), True),
        "gptq": (gptq_dir(exl3, args.work), True),
    }
    results: dict[str, dict] = {}
    skipped = []
    for label in models:
        if end - time.monotonic() < ENGINE_COST_S:
            skipped.append(f"{label} (time budget)")
            continue
        path, dummy = dirs[label]
        results[label] = run_model(label, path, dummy=dummy, args=args, vocab=vocab)
    import torch
    import vllm

    record = {
        "preset": args.preset,
        "layers": args.layers or "all",
        "bits": args.bits,
        "codebook": args.codebook,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "models": results,
        "skipped": skipped,
        "seconds": round(time.monotonic() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = (
        "throughput.json"
        if args.preset == "qwen3-8b" and models == ["exl3", "bf16"]
        else f"throughput-{args.preset}-{'+'.join(models)}.json"
    )
    (args.out / name).write_text(json.dumps(record, indent=1))
    print_table(results)
    for s in skipped:
        print(f"  SKIPPED {s}")
    log(f"wrote {args.out / name} ({record['seconds']} s)")
    return 0 if not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
