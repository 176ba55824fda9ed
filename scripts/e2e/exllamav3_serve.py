#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""serve_bench.py's load on ExLlamaV3 1.6.5's own generator: one row (a preset at one
concurrency) per process, the `exllamav3` variant of serve_bench.py.

The synthetic EXL3 checkpoint the `exl3` variant serves (throughput.py's, in ExLlamaV3's
own on-disk layout) loaded by ExLlamaV3's Config / Model / Cache and driven by its
Generator, one Job per request: max(2 C, 4) prompts of 8192 random token ids of the
model's vocabulary (which the vLLM rows' tokenizer, serve_bench.model_tokenizer, covers
whole), 1024 output tokens each, greedy (serve_bench's `--temperature 0`), no stop
condition (its `--ignore-eos`), a distinct seed per row. At most C jobs are in the
generator at once: a new one is enqueued as one finishes, as `vllm bench serve
--max-concurrency C` sends requests. Per request: TTFT (enqueue to the first token
returned by Generator.iterate()) and TPOT ((latency - TTFT) / (output tokens - 1)); per
row: output tokens over the row's wall time, completed and failed, in `vllm bench
serve`'s result fields (serve_bench.BENCH_FIELDS), so the row sits in serve_bench.json
beside the vLLM variants.

The cache is sized for C requests of 9472 tokens (8192 + 1024 + 1, rounded up to
ExLlamaV3's 256-token pages) within the share of the GPU that the preset's vLLM servers
get (serve_bench's --gpu-memory-utilization). Where fewer fit, the cache holds as many
as fit and the row says so (`kv_max_concurrency`, as vLLM's KV conc column, and
`note`); where none fits, the row says why (`not_run`: the requirement and the memory)
and measures nothing.

No tokenizer: the model directory holds none, and ExLlamaV3's generator asks its
tokenizer only for the text of each sampled id when no stop strings, banned strings,
filters or token healing are used. NullTokenizer answers with empty text for every id:
no id is masked from sampling (all 151936 are sampled, as vLLM samples them) and nothing
is decoded.

serve_bench.py runs this file in a fresh interpreter per row (child_command; child_env
gives it ExLlamaV3's JIT build environment from exllamav3_anchor.py when --exl3-state
is given), one engine at a time on the GPU. Alone (one row, its JSON to --result):
    python scripts/e2e/exllamav3_serve.py --model DIR --preset qwen3-8b \
        --concurrency 16 --result row.json [--exl3-state STATE]
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import importlib.util
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_exl3.bench import exllamav3_anchor
from vllm_exl3.e2e import serve_bench as sb
from vllm_exl3.e2e.throughput import GPU_MEMORY_UTILIZATION, PRESETS

VARIANT = "exllamav3"
# ExLlamaV3's fixed cache page (exllamav3/constants.py PAGE_SIZE): cache sizes are
# multiples of it, and a job reserves whole pages.
PAGE_SIZE = 256
# A job reserves pages for its prompt, max_new_tokens and one more token
# (Sequence.prepare in exllamav3/generator/pagetable.py): 9217 tokens, 37 pages.
TOKENS_PER_JOB = math.ceil((sb.INPUT_LEN + sb.OUTPUT_LEN + 1) / PAGE_SIZE) * PAGE_SIZE
# CacheLayer_fp16, ExLlamaV3's default cache layer, stores K and V as torch.half.
KV_ELEMENT_BYTES = 2
GIB = 1024**3
# Memory kept free beside the weights and the cache, for the forward passes: a
# 2048-token prefill chunk's activations (0.1-0.3 GB at these dims), the fp32 logits of
# a 64-row decode step (64 x 151936 x 4 B = 39 MB), kernel workspaces and allocator
# slack. ExLlamaV3's own autosplit keeps 0.5 GB per device; this keeps four times that,
# since a cache that leaves too little fails the row outright.
RESERVE_GIB = 2.0
# Warm-up before the timed requests (vLLM's servers are warm: compiled, CUDA graphs
# captured, before `vllm bench serve` sends its first request): Model.warmup (its
# kernels' first-use compilation and autotuning), then one wave of C short jobs through
# the generator, so decode runs at the row's batch sizes once before it is timed.
# Short: 512 tokens in, 32 out; prompts of their own, so no page of a timed prompt is
# in the cache.
WARMUP_INPUT = 512
WARMUP_OUTPUT = 32
# The first guess of one load + warm-up in seconds (import of the built extension, 5-16
# GB of weights from disk, Model.warmup's first Triton compiles), for the budget until
# a row of the preset has been measured.
EST_START_S = 120
# Seconds from SIGTERM (which makes the child dump its stacks into its log) to SIGKILL.
STOP_TIMEOUT_S = 30


def log(msg: str) -> None:
    print(f"[exllamav3_serve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the cache -------------------------------------------------------------------


def kv_bytes_per_token(cfg: dict) -> int:
    """Bytes of ExLlamaV3's fp16 cache per token: K and V of every layer."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (
        2
        * cfg["num_hidden_layers"]
        * cfg["num_key_value_heads"]
        * head_dim
        * KV_ELEMENT_BYTES
    )


def weights_bytes(model_dir: Path) -> int:
    """The checkpoint's tensors on disk: an upper bound of what the weights take on the
    GPU (ExLlamaV3 keeps an unquantized token embedding in host memory)."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


@dataclass(frozen=True)
class CachePlan:
    """The cache for `concurrency` jobs of TOKENS_PER_JOB tokens, or as many as fit."""

    concurrency: int
    kv_bytes_per_token: int
    weights_bytes: int
    free_bytes: int
    total_bytes: int
    memory_fraction: float
    reserve_bytes: int

    @property
    def job_bytes(self) -> int:
        return TOKENS_PER_JOB * self.kv_bytes_per_token

    @property
    def needed_bytes(self) -> int:
        return self.concurrency * self.job_bytes

    @property
    def usable_bytes(self) -> int:
        """What the process may hold: its share of the GPU as vLLM's
        gpu_memory_utilization gives it, and no more than is free."""
        return min(self.free_bytes, int(self.memory_fraction * self.total_bytes))

    @property
    def cache_budget_bytes(self) -> int:
        return max(0, self.usable_bytes - self.weights_bytes - self.reserve_bytes)

    @property
    def jobs(self) -> int:
        """Concurrent jobs whose whole length the cache holds, at most `concurrency`."""
        return min(self.concurrency, self.cache_budget_bytes // self.job_bytes)

    @property
    def cache_tokens(self) -> int:
        return self.jobs * TOKENS_PER_JOB

    def describe(self) -> str:
        return (
            f"cache for {self.concurrency} x {TOKENS_PER_JOB} tokens at "
            f"{self.kv_bytes_per_token / 1e3:.1f} KB/token needs "
            f"{self.needed_bytes / GIB:.1f} GiB; "
            f"{self.cache_budget_bytes / GIB:.1f} GiB left for it = "
            f"min({self.free_bytes / GIB:.1f} GiB free, {self.memory_fraction:g} x "
            f"{self.total_bytes / GIB:.1f} GiB) - {self.weights_bytes / GIB:.1f} GiB "
            f"weights - {self.reserve_bytes / GIB:.1f} GiB reserve: holds "
            f"{self.jobs} of {self.concurrency} requests"
        )

    def facts(self) -> dict:
        return {
            "tokens_per_request": TOKENS_PER_JOB,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "cache_needed_bytes": self.needed_bytes,
            "cache_budget_bytes": self.cache_budget_bytes,
            "weights_bytes": self.weights_bytes,
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
            "memory_fraction": self.memory_fraction,
            "reserve_bytes": self.reserve_bytes,
        }


# ---- the load and its measures ---------------------------------------------------


@dataclass
class Request:
    """One request's timestamps (seconds of one clock) and outcome."""

    index: int
    input_len: int
    enqueued: float
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.finished is not None and not self.error


def prompts(
    seed: int | str, count: int, length: int, ids: Sequence[int]
) -> list[list[int]]:
    """`count` prompts of `length` ids drawn uniformly from `ids` (the model's
    vocabulary, which vLLM's random dataset draws from through the rows' tokenizer)."""
    rng = random.Random(seed)
    return [rng.choices(ids, k=length) for _ in range(count)]


def drive(
    generator,
    make_job: Callable[[int, list[int]], object],
    prompt_ids: list[list[int]],
    concurrency: int,
    output_len: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[Request], float]:
    """Runs the prompts through `generator` (enqueue / iterate, ExLlamaV3's Generator
    interface) with at most `concurrency` in it at once; make_job(i, ids) builds the job
    of prompt i with identifier i. Returns the requests and the wall time from the first
    enqueue to the last result.

    A request fails when the generator reports an error for it, or when it ends with
    another count of tokens than `output_len` (vllm bench serve with --ignore-eos gets
    exactly that many); an exception from iterate() fails every request not finished."""
    todo = list(enumerate(prompt_ids))
    todo.reverse()
    requests: dict[int, Request] = {}
    in_flight: set[int] = set()
    t0 = clock()
    while todo or in_flight:
        while todo and len(in_flight) < concurrency:
            i, ids = todo.pop()
            job = make_job(i, ids)
            requests[i] = Request(i, len(ids), clock())
            generator.enqueue(job)
            in_flight.add(i)
        try:
            results = generator.iterate()
        except Exception as e:  # the generator's own failure ends the row
            now = clock()
            for i in in_flight:
                requests[i].finished, requests[i].error = now, f"iterate(): {e!r}"
            for i, ids in todo:
                requests[i] = Request(i, len(ids), now, finished=now, error="not run")
            todo, in_flight = [], set()
            break
        now = clock()
        for r in results:
            i = r.get("identifier")
            if i not in in_flight:
                continue
            req = requests[i]
            if r.get("stage") == "error":
                req.finished, req.error = now, f"generator: {r.get('error')!r}"
                in_flight.discard(i)
                continue
            if r.get("stage") != "streaming":
                continue
            got = r.get("token_ids")
            if got is not None and got.shape[-1] > 0:
                if req.first_token is None:
                    req.first_token = now
                req.output_tokens += got.shape[-1]
            if r.get("eos"):
                req.finished = now
                req.output_tokens = r.get("new_tokens", req.output_tokens)
                if req.output_tokens != output_len:
                    req.error = (
                        f"{req.output_tokens} tokens, asked {output_len} "
                        f"({r.get('eos_reason')})"
                    )
                in_flight.discard(i)
    return [requests[i] for i in sorted(requests)], clock() - t0


def _ms(values: list[float], how: Callable[[list[float]], float]) -> float | None:
    return how(values) * 1e3 if values else None


def row_metrics(
    requests: list[Request], duration: float, concurrency: int, num_prompts: int
) -> dict:
    """`vllm bench serve`'s result fields (serve_bench.BENCH_FIELDS) from the requests,
    as vllm/benchmarks/serve.py computes them: completed requests only, TPOT over those
    with more than one output token."""
    done = [r for r in requests if r.ok]
    ttft = [r.first_token - r.enqueued for r in done if r.first_token is not None]
    tpot = [
        (r.finished - r.first_token) / (r.output_tokens - 1)
        for r in done
        if r.first_token is not None and r.output_tokens > 1
    ]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(requests) - len(done),
        "duration": duration,
        "total_input_tokens": sum(r.input_len for r in done),
        "total_output_tokens": out_tokens,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "mean_tpot_ms": _ms(tpot, statistics.fmean),
        "median_tpot_ms": _ms(tpot, statistics.median),
        "mean_ttft_ms": _ms(ttft, statistics.fmean),
        "median_ttft_ms": _ms(ttft, statistics.median),
        "max_concurrency": concurrency,
        "num_prompts": num_prompts,
    }


class NullTokenizer:
    """The part of ExLlamaV3's Tokenizer its generator uses on this load (no stop
    strings, banned strings, filters or token healing): the text piece of every id,
    empty here, and the count of ids the sampler may pick (all of the model's)."""

    def __init__(self, vocab_size: int):
        self.actual_vocab_size = vocab_size
        # The generator pads the vocabulary to a multiple of 32 (padded_vocab_size).
        self._pieces = [""] * (-(-vocab_size // 32) * 32)

    def get_id_to_piece_list(self, include_special_tokens: bool = False) -> list[str]:
        return self._pieces

    def decode(self, ids, decode_special_tokens: bool = False) -> list[str]:
        return [""] * (ids.shape[0] if ids.dim() > 1 else 1)


# ---- one row, in its own process -----------------------------------------------


def base_row(preset: str, concurrency: int, seed: int, num_prompts: int) -> dict:
    return {
        "preset": preset,
        "variant": VARIANT,
        "concurrency": concurrency,
        "seed": seed,
        "num_prompts": num_prompts,
        "max_concurrency": concurrency,
    }


def not_run_row(
    preset: str, concurrency: int, seed: int, num_prompts: int, plan: CachePlan
) -> dict:
    """The row of a preset whose cache holds no request: why, nothing measured."""
    return {
        **base_row(preset, concurrency, seed, num_prompts),
        "completed": 0,
        "failed": 0,
        "kv_tokens": 0,
        "kv_max_concurrency": 0.0,
        "not_run": plan.describe(),
        "memory": plan.facts(),
    }


def import_exllamav3(args: argparse.Namespace) -> None:
    """ExLlamaV3 importable in this process: through exllamav3_anchor's guarded import
    when --exl3-state names its build, else as installed. Raises AnchorUnavailable."""
    if args.exl3_state is not None:
        exllamav3_anchor.load_linear_class(
            args.exl3_state, args.exl3_wait_s, args.exl3_import_timeout_s
        )
    elif importlib.util.find_spec("exllamav3") is None:
        raise exllamav3_anchor.AnchorUnavailable(
            "exllamav3 is not importable (no --exl3-state)"
        )


def exllamav3_version() -> str:
    """The imported ExLlamaV3's release; its package keeps it in `exllamav3.version`,
    not on the package itself."""
    try:
        return str(importlib.import_module("exllamav3.version").__version__)
    except (ImportError, AttributeError):
        return "unknown"


def measure(args: argparse.Namespace) -> dict:
    """One row on the GPU: {"row": ...}."""
    t_start = time.monotonic()
    cfg = json.loads((args.model / "config.json").read_text())
    n = args.num_prompts
    import_exllamav3(args)
    import torch
    from exllamav3 import Cache, Config, Generator, Job, Model
    from exllamav3.generator.sampler import ArgmaxSampler

    free, total = torch.cuda.mem_get_info(0)
    plan = CachePlan(
        concurrency=args.concurrency,
        kv_bytes_per_token=kv_bytes_per_token(cfg),
        weights_bytes=weights_bytes(args.model),
        free_bytes=free,
        total_bytes=total,
        memory_fraction=args.gpu_memory_utilization,
        reserve_bytes=int(args.reserve_gib * GIB),
    )
    log(plan.describe())
    if plan.jobs < 1:
        return {"row": not_run_row(args.preset, args.concurrency, args.seed, n, plan)}

    model = Model.from_config(Config.from_directory(str(args.model)))
    cache = Cache(model, max_num_tokens=plan.cache_tokens)
    model.load(device="cuda:0")
    warmup_failures = model.warmup(cache=cache, max_batch_size=plan.jobs)
    generator = Generator(
        model=model,
        cache=cache,
        tokenizer=NullTokenizer(cfg["vocab_size"]),
        max_batch_size=args.concurrency,
    )

    def make_job(i: int, ids: list[int], output_len: int = sb.OUTPUT_LEN):
        return Job(
            input_ids=torch.tensor([ids], dtype=torch.long),
            max_new_tokens=output_len,
            sampler=ArgmaxSampler(),
            stop_conditions=None,
            identifier=i,
        )

    ids = range(cfg["vocab_size"])
    warm = prompts(f"warm-up {args.seed}", args.concurrency, WARMUP_INPUT, ids)
    warmed, _ = drive(
        generator,
        lambda i, p: make_job(i, p, WARMUP_OUTPUT),
        warm,
        args.concurrency,
        WARMUP_OUTPUT,
    )
    ready_s = time.monotonic() - t_start
    bad = [r.error for r in warmed if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up requests failed: {bad[:3]}")
    free_after, _ = torch.cuda.mem_get_info(0)
    log(f"ready in {ready_s:.0f} s; {n} prompts, seed {args.seed}")

    t0 = time.monotonic()
    requests, duration = drive(
        generator,
        make_job,
        prompts(args.seed, n, sb.INPUT_LEN, ids),
        args.concurrency,
        sb.OUTPUT_LEN,
    )
    row = {
        **base_row(args.preset, args.concurrency, args.seed, n),
        **row_metrics(requests, duration, args.concurrency, n),
        "bench_s": round(time.monotonic() - t0, 1),
        "server_ready_s": round(ready_s, 1),
        "kv_tokens": plan.cache_tokens,
        "kv_max_concurrency": plan.cache_tokens / TOKENS_PER_JOB,
        "memory": {**plan.facts(), "free_after_warmup_bytes": free_after},
        "exllamav3": exllamav3_version(),
    }
    if plan.jobs < args.concurrency:
        row["note"] = plan.describe()
    if warmup_failures:
        row["warmup_failures"] = list(warmup_failures)
    failures = [f"{r.index}: {r.error}" for r in requests if not r.ok]
    if failures:
        row["failures"] = failures[:20]
    generator.close()
    model.unload()
    return {"row": row}


def write_result(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


# ---- the parent side: serve_bench's `exllamav3` rows -----------------------------


def child_command(
    model_dir: Path,
    preset: str,
    concurrency: int,
    num_prompts: int,
    seed: int,
    memory: float,
    result: Path,
    exl3_state: Path | None = None,
    exl3_wait_s: float | None = None,
    exl3_import_timeout_s: float | None = None,
) -> list[str]:
    """This module as a fresh interpreter: no torch thread of the parent is inherited
    (a fork would), and the GPU holds one engine at a time."""
    cmd = [
        sys.executable,
        "-m",
        "vllm_exl3.e2e.exllamav3_serve",
        "--model",
        str(model_dir),
        "--preset",
        preset,
        "--concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--gpu-memory-utilization",
        f"{memory:g}",
        "--result",
        str(result),
    ]
    if exl3_state is not None:
        cmd += ["--exl3-state", str(exl3_state)]
    if exl3_wait_s is not None:
        cmd += ["--exl3-wait-s", f"{exl3_wait_s:g}"]
    if exl3_import_timeout_s is not None:
        cmd += ["--exl3-import-timeout-s", f"{exl3_import_timeout_s:g}"]
    return cmd


def child_env(exl3_state: Path | None) -> dict[str, str]:
    """The child's environment: ExLlamaV3's build environment (exllamav3_anchor.env_for:
    its TORCH_EXTENSIONS_DIR, TORCH_CUDA_ARCH_LIST, the site folder on PYTHONPATH), so
    its import loads the extension the builder compiled instead of compiling again."""
    env = dict(os.environ)
    for k, v in sb.HOST_ENV.items():
        env.setdefault(k, v)
    if exl3_state is not None:
        env.update(exllamav3_anchor.env_for(exl3_state))
    return env


def run_child(cmd: list[str], env: dict, logfile: Path, timeout: float) -> int | None:
    """The child in its own process group, its output in `logfile`; its exit status,
    or None when it ran past `timeout` (then SIGTERM, which dumps its stacks into the
    log, and SIGKILL after STOP_TIMEOUT_S)."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "w") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        rc: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # Nothing of the row may outlive it holding GPU memory for the next engine.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return rc


def measure_in_child(
    preset: str,
    concurrency: int,
    model_dir: Path,
    memory: float,
    timeout: float,
    args: argparse.Namespace,
) -> dict:
    """One `exllamav3` row of serve_bench's matrix, measured in a child process: the
    row, or {"error": ...} naming the child's log."""
    seed = sb.row_seed(preset, VARIANT, concurrency)
    n = sb.num_prompts(concurrency, args.prompt_waves)
    name = sb.result_filename(preset, VARIANT, concurrency)
    result = args.out / "bench_results" / name
    result.unlink(missing_ok=True)
    logfile = args.out / "logs" / name.replace(".json", ".log")
    cmd = child_command(
        model_dir,
        preset,
        concurrency,
        n,
        seed,
        memory,
        result,
        args.exl3_state,
        args.exl3_wait_s,
        args.exl3_import_timeout_s,
    )
    what = f"{preset} {VARIANT} c={concurrency}"
    log(f"{what}: {n} prompts, seed {seed}: {' '.join(cmd)}")
    rc = run_child(cmd, child_env(args.exl3_state), logfile, timeout)
    if rc is None:
        return {"error": f"{what}: cut at the budget ({timeout:.0f} s); {logfile}"}
    got = json.loads(result.read_text()) if result.exists() else {}
    if "row" in got:
        return got["row"]
    why = got.get("error") or f"exited with {rc} and no result"
    return {"error": f"{what}: {why}; {logfile} ends:\n{sb.tail(logfile)}"}


# ---- main --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the EXL3 checkpoint")
    ap.add_argument("--preset", choices=list(PRESETS), required=True)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="default: serve_bench's, max(2 x concurrency, 4)",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the prompts' seed; default: serve_bench's seed of this row",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="the share of the GPU for weights, cache and activations; default per "
        "preset as serve_bench's vLLM servers: "
        + ", ".join(f"{k} {v}" for k, v in GPU_MEMORY_UTILIZATION.items()),
    )
    ap.add_argument("--reserve-gib", type=float, default=RESERVE_GIB)
    ap.add_argument("--result", type=Path, required=True, help="the row's JSON")
    exllamav3_anchor.add_state_arguments(ap, "its generator")
    args = ap.parse_args(argv)
    if args.concurrency < 1:
        ap.error("--concurrency must be at least 1")
    if args.num_prompts is None:
        args.num_prompts = sb.num_prompts(args.concurrency)
    if args.seed is None:
        args.seed = (
            sb.row_seed(args.preset, VARIANT, args.concurrency)
            if args.concurrency in sb.CONCURRENCY
            else sb.SEED_BASE
        )
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = GPU_MEMORY_UTILIZATION[args.preset]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM from the parent at its budget: the stacks go to the log before the exit.
    faulthandler.register(signal.SIGTERM, chain=True)
    try:
        result = measure(args)
    except exllamav3_anchor.AnchorUnavailable as e:
        result = {"error": f"ExLlamaV3 unavailable: {e}"}
    except Exception as e:  # any failure of the row is the row's error, with its trace
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    write_result(args.result, result)
    if "row" in result:
        r = result["row"]
        log(
            f"{r['preset']} c={r['concurrency']}: "
            + (
                f"not run: {r['not_run']}"
                if "not_run" in r
                else f"{r['output_throughput'] or float('nan'):.1f} tok/s, TPOT "
                f"{r['mean_tpot_ms'] or float('nan'):.2f} ms, TTFT "
                f"{r['mean_ttft_ms'] or float('nan'):.0f} ms, failed {r['failed']}"
            )
        )
        return 0
    log(result["error"])
    return 1


if __name__ == "__main__":
    sys.exit(main())
