#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Serving as users measure it, on a CUDA host where the built wheel (or the offline
bundle) is installed: `vllm serve` + `vllm bench serve`, 8k tokens in / 1k out, prefix
caching off, a distinct seed per run, concurrency 1, 4, 16, 64, at Qwen3-8B and
Qwen3-30B-A3B dimensions: EXL3 4 bpw (the synthetic checkpoint of throughput.py, real
dims, random trellis codes) against GPTQ int4 g128 (Marlin), vLLM's dynamic FP8
(`--quantization fp8` on the bf16 model) and bf16, all three on load_format dummy; and
`exllamav3`: the same load on ExLlamaV3 1.6.5's own generator with the EXL3 checkpoint
(exllamav3_serve.py, one child process per row; with --exl3-state or in --variants).

One server at a time, each in its own process group on a free port of 127.0.0.1,
stopped with SIGTERM to the group (SIGKILL after a bounded wait). `--budget-s` stops
starting servers and rows that would not fit (with `--paired`, past a server's first
row, also rows whose partners the later variants' servers could not measure in the same
call); `--resume FILE` skips the rows FILE
already holds, so the matrix spans several calls. Prints a table; writes
serve_bench.json to --out (default $OUT), after every row.

`--soak`: `vllm serve` on the EXL3 Qwen3-30B-A3B checkpoint for --soak-s (600) under
our own client at concurrency 64: mixed lengths (256-8192 in, 64-1024 out), a tenth of
the requests cancelled by the client mid-stream, the server's GPU memory sampled every
few seconds. Verdicts: no failed request other than the cancelled ones, memory flat
after warm-up, /health and a last completion answered at the end, no request left
running and no KV cache left in use. `--detach` starts the soak in a session of its own
and returns (it outlives the call that started it); a later `--soak --collect` waits
for its verdicts. Writes serve_soak.json.

The model directories hold no tokenizer: the servers and `vllm bench serve` share one
written beside the checkpoints (model_tokenizer), one word per id of the model's whole
vocabulary, so every id the random weights sample decodes to text in one step, as with
a real model's tokenizer. (A tokenizer smaller than the vocabulary makes most sampled
ids decode to nothing, and the API server's incremental detokenizer then decodes the
request's whole undecoded tail again at every step: its CPU, not the engine, paces the
streams at high concurrency; scripts/e2e/README.md has the measurement.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_exl3.bench import exllamav3_anchor
from vllm_exl3.e2e.run_fixture_e2e import free_port
from vllm_exl3.e2e.throughput import (
    GPU_MEMORY_UTILIZATION,
    HOST_ENV,
    PRESETS,
    bf16_dir,
    checkpoint_dir,
    ensure_checkpoint,
    gptq_dir,
)
from vllm_exl3.repo import ROOT as REPO
from vllm_exl3.testing.fixtures import TOKENIZER as FIXTURE_TOKENIZER

# The vLLM servers (the default matrix), then ExLlamaV3's own generator on the EXL3
# checkpoint (exllamav3_serve.py): a row of its own, run where ExLlamaV3 is built.
VLLM_VARIANTS = ("exl3", "gptq", "fp8", "bf16")
VARIANTS = (*VLLM_VARIANTS, "exllamav3")
CONCURRENCY = (1, 4, 16, 64)
INPUT_LEN = 8192
OUTPUT_LEN = 1024
# Room past input + output for the random dataset's re-encoded prompts, which may come
# out a few tokens longer than asked (decode then encode of random ids).
MODEL_LEN_SLACK = 256
MAX_MODEL_LEN = INPUT_LEN + OUTPUT_LEN + MODEL_LEN_SLACK
EXL3_BITS = 4.0
EXL3_CODEBOOK = "mul1"  # ExLlamaV3 1.6.5's default
# Prompts per run: two waves of `concurrency` requests. With fixed lengths and no
# request rate limit the first wave starts together and the second starts as the first
# finishes, its prefills interleaved with the first wave's last decodes: two waves hold
# both regimes, and a one-time cost shows as the waves differing (the result's TTFT
# spread). At least four, so concurrency 1 averages over several requests (four 8k/1k
# requests take about 35 s there). Every wave is a minute or more at concurrency 64, and
# the whole matrix is 32 rows: more waves cost calls, not information; --prompt-waves
# raises it.
PROMPT_WAVES = 2
MIN_PROMPTS = 4
# Seeds of the random dataset: SEED_BASE plus the row's index in the full matrix, so no
# two rows (or calls that resume) send the same prompts.
SEED_BASE = 1000
# Rough upper guesses of one row's seconds at Qwen3-8B dims on an H100/H200 (prefill of
# about 20k tok/s, 7-30 ms per decode step from concurrency 1 to 64, the waves above,
# plus `vllm bench serve`'s one ready-check request), used to skip a row that would not
# fit the budget until a row of the same preset and concurrency has been measured (then
# its time is the estimate). A row that runs longer is cut at the budget and stays
# unmeasured for a later --resume.
EST_ROW_S = {1: 50, 4: 40, 16: 70, 64: 200}
EST_ROW_DEFAULT_S = 200
# Seconds a server start is allowed (compile + CUDA graph capture of a 30B MoE model at
# real dims, cold caches), and the guess the budget keeps back for one until a server
# of the same preset has started (then its time is the estimate).
SERVER_READY_TIMEOUT_S = 420
EST_SERVER_START_S = 150
SERVER_STOP_TIMEOUT_S = 30
HEALTH_POLL_S = 1.0
# Seconds kept back at the end of the budget for stopping the server and writing.
STOP_MARGIN_S = SERVER_STOP_TIMEOUT_S + 5
SERVED_NAME = "model"
# Qwen3's vocabulary (config.json's vocab_size), both presets'.
QWEN3_VOCAB = 151936
# model_tokenizer's word for an id.
TOKENIZER_WORD = "t{}"
# The word boundary model_tokenizer's tokens carry (sentencepiece's metaspace): vLLM's
# API server refuses, unread, a prompt of more characters than its longest token's
# length times the input tokens it allows, so a prompt's separators must be counted
# inside its tokens (with bare words and spaces between them, a prompt of 8192
# six-digit words was 400 Bad Request).
TOKENIZER_SPACE = "\u2581"
# What serve_bench.json says of the tokenizer its rows were measured with; --resume
# keeps only rows measured with this one (rows of the fixtures' smaller tokenizer were
# paced by the API server's detokenizer, see the module docstring; rows of the bare
# words' tokenizer lost every prompt with a six-digit word).
TOKENIZER_KIND = "model vocabulary, one metaspace word per id"
RESULT_NAME = "serve_bench.json"
SOAK_RESULT_NAME = "serve_soak.json"

# The soak.
SOAK_PRESET = "qwen3-30b-a3b"
SOAK_CONCURRENCY = 64
SOAK_S = 600
SOAK_INPUT = (256, 8192)
SOAK_OUTPUT = (64, 1024)
# A tenth of the requests are cut by the client after a random wait within
# SOAK_CANCEL_AFTER_S: cancellation lands in prefill, queueing and decode alike.
SOAK_CANCEL_FRACTION = 0.1
SOAK_CANCEL_AFTER_S = (0.2, 20.0)
# A request that takes longer is a failure (1024 tokens at concurrency 64 take well
# under a minute; queueing behind 63 8k prompts adds tens of seconds).
SOAK_REQUEST_TIMEOUT_S = 300
# After the soak's time no new request starts; those in flight get this long.
SOAK_DRAIN_S = SOAK_REQUEST_TIMEOUT_S
# Bounds the client's traffic whatever the server's speed.
SOAK_MAX_REQUESTS = 20000
MEMORY_SAMPLE_S = 5.0
# Memory is judged on the samples after the first fifth of the soak (warm-up:
# first-seen batch shapes JIT-compile Triton kernels, the caching allocator grows to
# its working set).
SOAK_WARMUP_FRACTION = 0.2
# Flat: max - min of the judged samples within 256 MiB. vLLM reserves its KV cache and
# activation peak at start-up, so after warm-up only allocator segments for odd
# shapes (2-20 MiB each) come and go; a per-request leak of even 1 MiB over the
# several hundred requests of a ten-minute soak exceeds it, and one leaked 8k-token
# activation (8192 x 2048 x 2 bytes = 32 MiB at Qwen3-30B-A3B's hidden size) per
# cancelled request does after nine.
MEMORY_FLAT_MIB = 256
MIN_MEMORY_SAMPLES = 10
# The completion sent after the soak to show the engine still serves.
FINAL_PROBE_TOKENS = 16


def log(msg: str) -> None:
    print(f"[serve_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def vllm_cli() -> list[str]:
    """vLLM's CLI through this interpreter (the `vllm` script may belong to another)."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


# ---- command lines ---------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One engine: the model directory, whether its weights are dummy, extra flags."""

    name: str
    model_dir: Path
    dummy: bool
    extra: tuple[str, ...] = ()


def variants(exl3: Path, work: Path, names: list[str]) -> list[Variant]:
    bf16 = bf16_dir(exl3, work)
    table = {
        "exl3": Variant("exl3", exl3, False),
        "gptq": Variant("gptq", gptq_dir(exl3, work), True),
        # vLLM's dynamic FP8: bf16 weights quantized per tensor at load, fp8 GEMMs.
        "fp8": Variant("fp8", bf16, True, ("--quantization", "fp8")),
        "bf16": Variant("bf16", bf16, True),
        # Not a server: exllamav3_serve.py loads the EXL3 checkpoint with ExLlamaV3.
        "exllamav3": Variant("exllamav3", exl3, False),
    }
    return [table[n] for n in names]


def model_tokenizer(work: Path, model_dir: Path) -> Path:
    """The tokenizer of `model_dir`'s runs: vocab_tokenizer of its config.json's
    vocab_size."""
    size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return vocab_tokenizer(work, size)


def vocab_tokenizer(work: Path, size: int) -> Path:
    """A tokenizer of `size` ids, written once under `work`: a word-level vocabulary of
    TOKENIZER_SPACE + TOKENIZER_WORD.format(id) for every id, text split at its
    spaces (every id decodes alone, a decoded prompt encodes back to the same ids, and
    no prompt has more characters than its tokens have)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = work / f"tokenizer-metaspace-{size}"
    if (out / "tokenizer_config.json").exists():
        return out
    vocab = {TOKENIZER_SPACE + TOKENIZER_WORD.format(i): i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(TOKENIZER_SPACE, "always")
    tok.decoder = decoders.Metaspace(TOKENIZER_SPACE, "always")
    staging = out.with_name(out.name + f".tmp{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    tok.save(str(staging / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_MODEL_LEN,
        "clean_up_tokenization_spaces": False,
    }
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    try:
        staging.rename(out)
    except OSError:  # another process wrote it first
        shutil.rmtree(staging, ignore_errors=True)
    return out


def detokenizer_ms(tokenizer: Path, sampled: list[int], seed: int = 0) -> float:
    """Milliseconds the API server's incremental detokenizer (tokenizers' DecodeStream,
    primed with an INPUT_LEN-id prompt as vLLM primes it) spends on one request's
    `sampled` ids."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    prompt = random.Random(seed).choices(prompt_token_ids(tokenizer), k=INPUT_LEN)
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    t0 = time.perf_counter()
    for i in sampled:
        stream.step(tok, i)
    return (time.perf_counter() - t0) * 1e3


def detokenizer_cost(work: Path) -> str:
    """detokenizer_ms of the fixtures' tokenizer and of model_tokenizer's for a Qwen3
    vocabulary, on OUTPUT_LEN ids drawn uniformly from it and on one id repeated (greedy
    decoding of random weights often settles on one id)."""
    uniform = random.Random(1).choices(range(QWEN3_VOCAB), k=OUTPUT_LEN)
    repeated = [QWEN3_VOCAB - 1] * OUTPUT_LEN
    lines = [f"detokenizer, ms per request of {OUTPUT_LEN} ids after {INPUT_LEN}:"]
    for name, tok in (
        ("fixtures' tokenizer", FIXTURE_TOKENIZER),
        ("model_tokenizer", vocab_tokenizer(work, QWEN3_VOCAB)),
    ):
        size = len(prompt_token_ids(tok))
        lines.append(
            f"  {name} ({size} ids): uniform {detokenizer_ms(tok, uniform):.1f}, "
            f"one id repeated {detokenizer_ms(tok, repeated):.1f}"
        )
    return "\n".join(lines)


def serve_command(v: Variant, port: int, memory: float, tokenizer: Path) -> list[str]:
    cmd = [
        *vllm_cli(),
        "serve",
        str(v.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--tokenizer",
        str(tokenizer),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        f"{memory:g}",
        "--max-num-seqs",
        str(max(CONCURRENCY + (SOAK_CONCURRENCY,))),
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        *v.extra,
    ]
    if v.dummy:
        cmd += ["--load-format", "dummy"]
    return cmd


def num_prompts(concurrency: int, waves: int = PROMPT_WAVES) -> int:
    return max(waves * concurrency, MIN_PROMPTS)


def row_seed(preset: str, variant: str, concurrency: int) -> int:
    """Distinct for every (preset, variant, concurrency) of the full matrix."""
    index = (
        list(PRESETS).index(preset) * len(VARIANTS) + VARIANTS.index(variant)
    ) * len(CONCURRENCY) + CONCURRENCY.index(concurrency)
    return SEED_BASE + index


def result_filename(preset: str, variant: str, concurrency: int) -> str:
    return f"bench-{preset}-{variant}-c{concurrency}.json"


def bench_command(
    port: int,
    concurrency: int,
    seed: int,
    result_dir: Path,
    filename: str,
    tokenizer: Path,
    waves: int = PROMPT_WAVES,
) -> list[str]:
    return [
        *vllm_cli(),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        SERVED_NAME,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--ignore-eos",
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts(concurrency, waves)),
        "--seed",
        str(seed),
        "--temperature",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
    ]


# ---- results ---------------------------------------------------------------------

# Fields taken from `vllm bench serve`'s result JSON (vllm/benchmarks/serve.py: the
# result dict of benchmark() merged into result_json by main()).
BENCH_FIELDS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "output_throughput",
    "request_throughput",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_ttft_ms",
    "median_ttft_ms",
    "max_concurrency",
    "num_prompts",
)


def parse_bench_result(path: Path) -> dict:
    """The row's numbers from one saved `vllm bench serve` result; a field missing is
    an error naming it (another vLLM's writer)."""
    data = json.loads(path.read_text())
    missing = [f for f in BENCH_FIELDS if f not in data]
    if missing:
        raise ValueError(f"{path}: vllm bench serve result lacks {missing}")
    return {f: data[f] for f in BENCH_FIELDS}


def row_key(row: dict) -> tuple[str, str, int]:
    return (row["preset"], row["variant"], int(row["concurrency"]))


# What each row says of where it was measured (host_facts' keys): a resumed file's rows
# keep theirs beside the rows of later calls.
ROW_HOST_KEYS = ("gpu", "vllm", "commit")


def row_host(host: dict) -> dict:
    return {k: host[k] for k in ROW_HOST_KEYS if k in host}


def load_rows(path: Path | None, gpu: str | None = None) -> list[dict]:
    """The rows of an earlier serve_bench.json: none when there is no file yet or its
    rows were measured with another tokenizer than TOKENIZER_KIND. With `gpu`, only
    the rows measured on that GPU: one table compares rows of one kind of card."""
    if path is None or not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if earlier.get("tokenizer") != TOKENIZER_KIND:
        log(f"{path}: measured with another tokenizer; its rows are measured again")
        return []
    # Rows written before rows named their host carry it in the record's: the record
    # written now names only this call's host.
    theirs = row_host(earlier.get("host", {}))
    rows = [{**theirs, **r} for r in earlier.get("rows", [])]
    if gpu:
        kept = [r for r in rows if r.get("gpu") == gpu]
        if len(kept) < len(rows):
            log(
                f"{path}: {len(rows) - len(kept)} rows were measured on another GPU "
                f"than {gpu}; they are measured again"
            )
        rows = kept
    return rows


def pending(
    done: list[dict], presets: list[str], names: list[str], conc: list[int]
) -> list[tuple[str, str, int]]:
    """The (preset, variant, concurrency) still to measure, in run order."""
    have = {row_key(r) for r in done}
    return [
        (p, v, c) for p in presets for v in names for c in conc if (p, v, c) not in have
    ]


KV_TOKENS_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
KV_CONC_RE = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")


def estimate_start_s(rows: list[dict], preset: str) -> float:
    """Seconds to budget for a server of `preset`: the slowest start measured."""
    seen = [
        r["server_ready_s"]
        for r in rows
        if r["preset"] == preset and "server_ready_s" in r
    ]
    return max(seen, default=EST_SERVER_START_S)


def estimate_row_s(rows: list[dict], preset: str, concurrency: int) -> float:
    """Seconds to budget for one row: the slowest measured at this preset and
    concurrency (any variant), else the guess of EST_ROW_S."""
    seen = [
        r["bench_s"]
        for r in rows
        if r["preset"] == preset and r["concurrency"] == concurrency and "bench_s" in r
    ]
    return max(seen, default=EST_ROW_S.get(concurrency, EST_ROW_DEFAULT_S))


def partner_reserve_s(
    rows: list[dict], preset: str, later: list[list[int]], conc: list[int]
) -> float:
    """Seconds the later servers of `preset` need to measure the rows of `conc` they
    still lack (`later`: each one's pending concurrencies): a start and a stop each,
    and those rows."""
    total = 0.0
    for theirs in later:
        need = [c for c in conc if c in theirs]
        if need:
            total += estimate_start_s(rows, preset) + STOP_MARGIN_S
            total += sum(estimate_row_s(rows, preset, c) for c in need)
    return total


def kv_capacity(log_text: str) -> dict:
    """What the server's log says its KV cache holds: a concurrency above
    kv_max_concurrency queues requests for cache, not for compute."""
    out: dict = {}
    if m := KV_TOKENS_RE.search(log_text):
        out["kv_tokens"] = int(m.group(1).replace(",", ""))
    if m := KV_CONC_RE.search(log_text):
        out["kv_max_concurrency"] = float(m.group(1))
    return out


def nan_get(row: dict, key: str) -> float:
    v = row.get(key)
    return float("nan") if v is None else float(v)


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'preset':14s} {'variant':9s} {'conc':>4s} {'prompts':>7s} "
        f"{'out tok/s':>9s} {'TPOT mean':>9s} {'TPOT med':>8s} {'TTFT mean':>9s} "
        f"{'TTFT med':>9s} {'done':>5s} {'failed':>6s} {'KV conc':>7s}"
    )
    lines = [head]
    order = {v: i for i, v in enumerate(VARIANTS)}
    for r in sorted(
        rows, key=lambda r: (r["preset"], order.get(r["variant"], 99), r["concurrency"])
    ):
        lines.append(
            f"{r['preset']:14s} {r['variant']:9s} {r['concurrency']:4d} "
            f"{r['num_prompts']:7d} {nan_get(r, 'output_throughput'):9.1f} "
            f"{nan_get(r, 'mean_tpot_ms'):9.2f} {nan_get(r, 'median_tpot_ms'):8.2f} "
            f"{nan_get(r, 'mean_ttft_ms'):9.1f} {nan_get(r, 'median_ttft_ms'):9.1f} "
            f"{r['completed']:5d} {r['failed']:6d} "
            f"{nan_get(r, 'kv_max_concurrency'):7.1f}"
        )
    by = {row_key(r): r for r in rows}
    for p, v, c in sorted(by):
        if v != "exl3":
            continue
        ratios = []
        for other in ("gptq", "fp8", "bf16", "exllamav3"):
            o = by.get((p, other, c))
            if o and o.get("output_throughput"):
                x = by[(p, v, c)]["output_throughput"] / o["output_throughput"]
                ratios.append(f"/{other} x{x:.2f}")
        if ratios:
            lines.append(f"exl3 {p} c={c}: output tok/s " + ", ".join(ratios))
    # What a row's numbers do not say: an ExLlamaV3 cache holding fewer requests than
    # the concurrency, or none (the row then measured nothing).
    for key in sorted(by):
        r = by[key]
        for what in ("not_run", "note"):
            if r.get(what):
                lines.append(f"{key[1]} {key[0]} c={key[2]}: {what}: {r[what]}")
    return "\n".join(lines)


# ---- the server ------------------------------------------------------------------


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Server:
    """One server subprocess in its own process group (so that stopping it reaches
    the engine processes it forks): start, wait for /health, stop."""

    def __init__(self, cmd: list[str], port: int, logfile: Path, env=None):
        self.cmd = cmd
        self.port = port
        self.logfile = logfile
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        with open(self.logfile, "w") as logf:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        self.started = time.monotonic()

    def healthy(self) -> bool:
        try:
            return http_get(self.base + "/health", timeout=2)[0] == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start to the first healthy /health; raises naming the log when
        the process exits first or the timeout passes."""
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before it was ready; "
                    f"{self.logfile} ends:\n{tail(self.logfile)}"
                )
            if self.healthy():
                return time.monotonic() - self.started
            if time.monotonic() - self.started > timeout:
                raise TimeoutError(
                    f"server not healthy after {timeout:.0f} s; {self.logfile} "
                    f"ends:\n{tail(self.logfile)}"
                )
            time.sleep(HEALTH_POLL_S)

    def group_pids(self) -> list[int]:
        """The pids of the server's process group (the API server and the engine
        core and workers it starts)."""
        if self.proc is None:
            return []
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.getpgid(int(d.name)) == self.proc.pid:
                        pids.append(int(d.name))
        return pids

    def stop(self, timeout: float = SERVER_STOP_TIMEOUT_S) -> str:
        """SIGTERM to the group, then SIGKILL after `timeout`; how it ended."""
        if self.proc is None or self.proc.poll() is not None:
            return "exited"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
            how = "terminated"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            how = "killed"
        # Engine processes outlive the API server's exit briefly: leave none behind
        # holding GPU memory for the next server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return how

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_env() -> dict:
    env = dict(os.environ)
    for k, v in HOST_ENV.items():
        env.setdefault(k, v)
    return env


# ---- the benchmark ---------------------------------------------------------------


@dataclass
class Budget:
    seconds: float
    t0: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)


def host_facts() -> dict:
    facts: dict = {}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        facts["vllm"] = importlib.metadata.version("vllm")
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        facts["torch"] = importlib.metadata.version("torch")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        facts["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        facts["commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    return facts


def save(out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (RESULT_NAME + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(out / RESULT_NAME)


def run_matrix(args: argparse.Namespace) -> int:
    budget = Budget(args.budget_s)
    host = host_facts()
    rows = load_rows(args.resume, host.get("gpu"))
    todo = pending(rows, args.presets, args.variants, args.concurrency)
    record = {
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "max_model_len": MAX_MODEL_LEN,
        "exl3": {"bits": EXL3_BITS, "codebook": EXL3_CODEBOOK},
        "tokenizer": TOKENIZER_KIND,
        "host": host,
        "rows": rows,
        "errors": [],
        "skipped": [],
    }
    if rows:
        log(f"resuming from {args.resume}: {len(rows)} rows measured")
    bench_dir = args.out / "bench_results"
    for preset in args.presets:
        mine = [t for t in todo if t[0] == preset]
        if not mine:
            continue
        exl3 = ensure_checkpoint(
            checkpoint_dir(args.work, preset, None, EXL3_BITS, EXL3_CODEBOOK),
            preset,
            None,
            EXL3_BITS,
            EXL3_CODEBOOK,
        )
        memory = args.gpu_memory_utilization or GPU_MEMORY_UTILIZATION[preset]
        tokenizer = model_tokenizer(args.work, exl3)
        todo_of = {n: [c for p, name, c in mine if name == n] for n in args.variants}
        for i, v in enumerate(variants(exl3, args.work, args.variants)):
            conc = todo_of[v.name]
            if not conc:
                continue
            # The servers after this one, whose rows pair with this one's.
            later = [
                todo_of[n]
                for n in args.variants[i + 1 :]
                if n != "exllamav3" and todo_of[n]
            ]
            if v.name == "exllamav3":
                run_exllamav3(preset, v, conc, memory, budget, rows, record, args)
                continue
            first = estimate_row_s(rows, preset, conc[0])
            if budget.left() < estimate_start_s(rows, preset) + first + STOP_MARGIN_S:
                record["skipped"] += [f"{preset} {v.name} c={c} (budget)" for c in conc]
                continue
            port = free_port()
            server = Server(
                serve_command(v, port, memory, tokenizer),
                port,
                args.out / "logs" / f"serve-{preset}-{v.name}.log",
                env=server_env(),
            )
            log(f"{preset} {v.name}: starting {' '.join(server.cmd)}")
            with server:
                try:
                    ready = server.wait_ready(
                        min(SERVER_READY_TIMEOUT_S, budget.left() - STOP_MARGIN_S)
                    )
                except (RuntimeError, TimeoutError) as e:
                    record["errors"].append(f"{preset} {v.name}: {e}")
                    record["skipped"] += [
                        f"{preset} {v.name} c={c} (server)" for c in conc
                    ]
                    log(f"{preset} {v.name}: server did not start")
                    save(args.out, record)
                    continue
                kv = kv_capacity(server.logfile.read_text(errors="replace"))
                log(f"{preset} {v.name}: ready in {ready:.0f} s, {kv}")
                ran: list[int] = []
                for c in conc:
                    left = budget.left() - STOP_MARGIN_S
                    if left < estimate_row_s(rows, preset, c):
                        record["skipped"].append(f"{preset} {v.name} c={c} (budget)")
                        continue
                    # --paired: past this server's first row, a row runs only if the
                    # later servers can still measure its partners, so a ratio's two
                    # rows come from one call (one machine where each lease is new).
                    reserve = partner_reserve_s(rows, preset, later, ran + [c])
                    if (
                        args.paired
                        and ran
                        and left < estimate_row_s(rows, preset, c) + reserve
                    ):
                        why = "budget kept for the partner rows"
                        record["skipped"].append(f"{preset} {v.name} c={c} ({why})")
                        continue
                    ran.append(c)
                    row = run_row(
                        preset, v.name, c, port, tokenizer, bench_dir, left, args
                    )
                    if "error" in row:
                        record["errors"].append(row["error"])
                        record["skipped"].append(f"{preset} {v.name} c={c} (error)")
                    else:
                        row.update(kv, server_ready_s=round(ready, 1), **row_host(host))
                        rows.append(row)
                    save(args.out, record)
                log(f"{preset} {v.name}: server {server.stop()}")
    record["seconds"] = round(time.monotonic() - budget.t0, 1)
    save(args.out, record)
    print(format_table(rows))
    for s in record["skipped"]:
        print(f"  NOT MEASURED {s}")
    for e in record["errors"]:
        print(f"  ERROR {e.splitlines()[0]}")
    log(f"wrote {args.out / RESULT_NAME}")
    failed = [r for r in rows if r["failed"]]
    for r in failed:
        print(f"  FAILED REQUESTS {row_key(r)}: {r['failed']}")
    return 0 if not (record["skipped"] or record["errors"] or failed) else 1


def run_exllamav3(
    preset: str,
    v: Variant,
    conc: list[int],
    memory: float,
    budget: Budget,
    rows: list[dict],
    record: dict,
    args: argparse.Namespace,
) -> None:
    """The `exllamav3` rows of one preset: each a child process that loads the EXL3
    checkpoint with ExLlamaV3 (exllamav3_serve.py), warms up and measures, so each pays
    its own start. Rows are added to `rows` and saved as they come."""
    # Imported here: exllamav3_serve builds on this module's definition of the load.
    from vllm_exl3.e2e import exllamav3_serve

    for c in conc:
        start = max(
            (
                r["server_ready_s"]
                for r in rows
                if r["preset"] == preset
                and r["variant"] == v.name
                and "server_ready_s" in r
            ),
            default=exllamav3_serve.EST_START_S,
        )
        left = budget.left() - STOP_MARGIN_S
        if left < start + estimate_row_s(rows, preset, c):
            record["skipped"].append(f"{preset} {v.name} c={c} (budget)")
            continue
        row = exllamav3_serve.measure_in_child(
            preset, c, v.model_dir, memory, left, args
        )
        if "error" in row:
            record["errors"].append(row["error"])
            record["skipped"].append(f"{preset} {v.name} c={c} (error)")
        else:
            row.update(row_host(record["host"]))
            rows.append(row)
        save(args.out, record)


def run_row(
    preset: str,
    variant: str,
    c: int,
    port: int,
    tokenizer: Path,
    bench_dir: Path,
    timeout: float,
    args: argparse.Namespace,
) -> dict:
    seed = row_seed(preset, variant, c)
    name = result_filename(preset, variant, c)
    bench_dir.mkdir(parents=True, exist_ok=True)
    (bench_dir / name).unlink(missing_ok=True)
    cmd = bench_command(
        port, c, seed, bench_dir, name, tokenizer, waves=args.prompt_waves
    )
    logfile = args.out / "logs" / name.replace(".json", ".log")
    n = num_prompts(c, args.prompt_waves)
    log(f"{preset} {variant} c={c}: {n} prompts, seed {seed}")
    t0 = time.monotonic()
    with open(logfile, "w") as logf:
        try:
            rc = subprocess.run(
                cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            cut = f"cut at the budget ({timeout:.0f} s)"
            return {"error": f"{preset} {variant} c={c}: {cut}"}
    if rc != 0 or not (bench_dir / name).exists():
        return {
            "error": f"{preset} {variant} c={c}: vllm bench serve exited with {rc}; "
            f"{logfile} ends:\n{tail(logfile)}"
        }
    try:
        measured = parse_bench_result(bench_dir / name)
    except (ValueError, KeyError) as e:
        return {"error": f"{preset} {variant} c={c}: {e}"}
    row = {
        "preset": preset,
        "variant": variant,
        "concurrency": c,
        "seed": seed,
        **measured,
        "bench_s": round(time.monotonic() - t0, 1),
    }
    log(
        f"{preset} {variant} c={c}: {row['output_throughput']:.1f} tok/s, TPOT "
        f"{row['mean_tpot_ms']:.2f} ms, TTFT {row['mean_ttft_ms']:.0f} ms, "
        f"failed {row['failed']}"
    )
    return row


# ---- the soak --------------------------------------------------------------------


@dataclass
class Outcome:
    """One soak request: status ok, cancelled (cut by the client on purpose) or
    failed (anything else: an HTTP error, a broken stream, fewer tokens than asked,
    a timeout)."""

    status: str
    input_len: int
    output_len: int
    tokens: int = 0
    error: str = ""


def memory_verdict(
    samples: list[tuple[float, float]], duration: float
) -> tuple[bool, dict]:
    """samples: (seconds since the soak began, MiB). Flat when max - min over the
    samples after the warm-up fraction is within MEMORY_FLAT_MIB."""
    judged = [m for t, m in samples if t >= SOAK_WARMUP_FRACTION * duration]
    facts = {
        "samples": len(samples),
        "judged": len(judged),
        "limit_mib": MEMORY_FLAT_MIB,
    }
    if len(judged) < MIN_MEMORY_SAMPLES:
        facts["why"] = f"fewer than {MIN_MEMORY_SAMPLES} samples after warm-up"
        return False, facts
    facts.update(
        min_mib=min(judged), max_mib=max(judged), spread_mib=max(judged) - min(judged)
    )
    return facts["spread_mib"] <= MEMORY_FLAT_MIB, facts


def soak_verdicts(
    outcomes: list[Outcome],
    samples: list[tuple[float, float]],
    duration: float,
    health_ok: bool,
    probe_ok: bool,
    metrics: dict,
) -> dict:
    """Each verdict with its facts and an overall `passed`."""
    counts = {
        s: sum(o.status == s for o in outcomes) for s in ("ok", "cancelled", "failed")
    }
    mem_ok, mem = memory_verdict(samples, duration)
    idle = metrics.get("vllm:num_requests_running") == 0 and (
        metrics.get("vllm:kv_cache_usage_perc") == 0
    )
    v = {
        "requests": {**counts, "total": len(outcomes)},
        "no_failed_request": counts["failed"] == 0,
        "cancellation_exercised": counts["cancelled"] > 0,
        "completed_some": counts["ok"] > 0,
        "memory_flat": mem_ok,
        "memory": mem,
        "healthy_at_end": health_ok,
        "answers_at_end": probe_ok,
        "idle_at_end": idle,
        "metrics_at_end": metrics,
        "failures": [o.error for o in outcomes if o.status == "failed"][:20],
    }
    v["passed"] = all(
        v[k]
        for k in (
            "no_failed_request",
            "cancellation_exercised",
            "completed_some",
            "memory_flat",
            "healthy_at_end",
            "answers_at_end",
            "idle_at_end",
        )
    )
    return v


def parse_metrics(text: str, names: tuple[str, ...]) -> dict:
    """Prometheus text: each named gauge summed over its label sets."""
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                out[n] = out.get(n, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def prompt_token_ids(tokenizer: Path) -> list[int]:
    """The tokenizer's ordinary token ids: prompts stay inside its vocabulary (vLLM
    refuses prompt ids above it) and clear of its special tokens."""
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    special = {t["id"] for t in data.get("added_tokens", [])}
    return [i for i in range(len(data["model"]["vocab"])) if i not in special]


def gpu_memory_mib(pids: list[int]) -> tuple[float, str] | None:
    """The GPU memory of `pids` (nvidia-smi per-process used memory); the whole GPU's
    used memory when nvidia-smi lists none of them (a container whose pid namespace
    nvidia-smi does not see; the soak is the GPU's only user there)."""
    try:
        apps = subprocess.run(
            [
                "nvidia-smi",
                "--query-compute-apps=pid,used_memory",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        mine = [
            float(m)
            for p, m in (line.split(",") for line in apps.splitlines() if "," in line)
            if int(p) in set(pids)
        ]
        if mine:
            return sum(mine), "per-process"
        used = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.split()
        return (float(used[0]), "whole-gpu") if used else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class MemorySampler(threading.Thread):
    def __init__(self, server: Server):
        super().__init__(daemon=True)
        self.server = server
        self.period = MEMORY_SAMPLE_S
        self.samples: list[tuple[float, float]] = []
        self.source = ""
        self.t0 = time.monotonic()
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            got = gpu_memory_mib(self.server.group_pids())
            if got is not None:
                self.samples.append((time.monotonic() - self.t0, got[0]))
                self.source = got[1]
            self.halt.wait(self.period)


async def soak_request(
    session, base: str, rng: random.Random, ids: list[int], cancel: bool
) -> Outcome:
    n_in = rng.randint(*SOAK_INPUT)
    n_out = rng.randint(*SOAK_OUTPUT)
    prompt = rng.choices(ids, k=n_in)
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": n_out,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = Outcome("failed", n_in, n_out)

    async def stream() -> None:
        async with session.post(base + "/v1/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return
            done = False
            async for raw in r.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {chunk['error']}"
                    return
                if usage := chunk.get("usage"):
                    out.tokens = usage.get("completion_tokens", 0)
            if not done:
                out.error = "stream ended without [DONE]"
            elif out.tokens != n_out:
                out.error = f"{out.tokens} tokens, asked {n_out}"
            else:
                out.status = "ok"

    task = asyncio.ensure_future(stream())
    limit = rng.uniform(*SOAK_CANCEL_AFTER_S) if cancel else SOAK_REQUEST_TIMEOUT_S
    try:
        await asyncio.wait_for(asyncio.shield(task), limit)
    except asyncio.TimeoutError:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if cancel:
            out.status, out.error = "cancelled", ""
        else:
            out.error = f"no answer within {SOAK_REQUEST_TIMEOUT_S} s"
    except Exception as e:  # any error of one request is that request's failure
        out.error = f"{type(e).__name__}: {e}"
    return out


async def soak_client(
    base: str, seconds: float, seed: int, ids: list[int]
) -> list[Outcome]:
    """SOAK_CONCURRENCY workers sending mixed requests of prompt ids drawn from `ids`
    until `seconds` pass (then the ones in flight finish), at most SOAK_MAX_REQUESTS in
    all."""
    import aiohttp

    outcomes: list[Outcome] = []
    end = time.monotonic() + seconds
    rng = random.Random(seed)

    async def worker(k: int) -> None:
        wrng = random.Random(rng.random() + k)
        while time.monotonic() < end and len(outcomes) < SOAK_MAX_REQUESTS:
            cancel = wrng.random() < SOAK_CANCEL_FRACTION
            outcomes.append(await soak_request(session, base, wrng, ids, cancel))

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=SOAK_CONCURRENCY)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(worker(k) for k in range(SOAK_CONCURRENCY)))
    return outcomes


def final_probe(base: str, ids: list[int]) -> bool:
    body = json.dumps(
        {
            "model": SERVED_NAME,
            "prompt": ids[:16],
            "max_tokens": FINAL_PROBE_TOKENS,
            "ignore_eos": True,
        }
    ).encode()
    req = urllib.request.Request(
        base + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            usage = json.loads(r.read()).get("usage", {})
            return (
                r.status == 200 and usage.get("completion_tokens") == FINAL_PROBE_TOKENS
            )
    except (urllib.error.URLError, OSError, ValueError):
        return False


def run_soak(args: argparse.Namespace) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    exl3 = ensure_checkpoint(
        checkpoint_dir(args.work, SOAK_PRESET, None, EXL3_BITS, EXL3_CODEBOOK),
        SOAK_PRESET,
        None,
        EXL3_BITS,
        EXL3_CODEBOOK,
    )
    memory = args.gpu_memory_utilization or GPU_MEMORY_UTILIZATION[SOAK_PRESET]
    port = free_port()
    (v,) = variants(exl3, args.work, ["exl3"])
    tokenizer = model_tokenizer(args.work, exl3)
    ids = prompt_token_ids(tokenizer)
    server = Server(
        serve_command(v, port, memory, tokenizer),
        port,
        out / "logs" / "serve-soak.log",
        server_env(),
    )
    record: dict = {"preset": SOAK_PRESET, "soak_s": args.soak_s, "host": host_facts()}
    log(f"soak: starting {' '.join(server.cmd)}")
    with server:
        try:
            record["ready_s"] = round(server.wait_ready(SERVER_READY_TIMEOUT_S), 1)
        except (RuntimeError, TimeoutError) as e:
            record["error"] = str(e)
            record["verdicts"] = {"passed": False, "server": str(e)}
            (out / SOAK_RESULT_NAME).write_text(json.dumps(record, indent=1))
            print(f"soak FAILED: {e}")
            return 1
        sampler = MemorySampler(server)
        sampler.start()
        t0 = time.monotonic()
        outcomes = asyncio.run(soak_client(server.base, args.soak_s, args.seed, ids))
        duration = time.monotonic() - t0
        sampler.halt.set()
        sampler.join()
        health = server.healthy()
        probe = final_probe(server.base, ids)
        status, text = http_get(server.base + "/metrics", timeout=10)
        metrics = (
            parse_metrics(
                text, ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")
            )
            if status == 200
            else {}
        )
        record["server_stop"] = server.stop()
    v = soak_verdicts(outcomes, sampler.samples, args.soak_s, health, probe, metrics)
    record.update(
        duration_s=round(duration, 1),
        memory_source=sampler.source,
        memory_samples=sampler.samples,
        verdicts=v,
    )
    (out / SOAK_RESULT_NAME).write_text(json.dumps(record, indent=1))
    r = v["requests"]
    print(
        f"soak {duration:.0f} s: {r['total']} requests, {r['ok']} ok, "
        f"{r['cancelled']} cancelled, {r['failed']} failed; memory "
        f"({sampler.source}) {v['memory']}; health {health}, probe {probe}, "
        f"metrics {metrics}"
    )
    print("soak PASSED" if v["passed"] else "soak FAILED")
    return 0 if v["passed"] else 1


SOAK_PIDFILE = "soak.pid"


def detach_soak(args: argparse.Namespace, argv: list[str]) -> int:
    """The soak in a session of its own (it survives the caller's exit); its output
    in --out/soak.log."""
    args.out.mkdir(parents=True, exist_ok=True)
    pidfile = args.out / SOAK_PIDFILE
    if pidfile.exists() and soak_alive(pidfile):
        log(f"a soak is already running (pid {pidfile.read_text().strip()})")
        return 0
    if (args.out / SOAK_RESULT_NAME).exists():
        # So that repeating the same command collects instead of soaking again.
        log(f"{args.out / SOAK_RESULT_NAME} holds a finished soak: remove it to rerun")
        return 0
    rest = [a for a in argv if a != "--detach"]
    with open(args.out / "soak.log", "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_exl3.e2e.serve_bench", *rest],
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pidfile.write_text(str(proc.pid))
    log(
        f"soak started (pid {proc.pid}); collect with --soak --collect --out {args.out}"
    )
    return 0


def soak_alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def collect_soak(args: argparse.Namespace) -> int:
    """Waits (up to --budget-s) for a detached soak's verdicts; 3 when it still runs."""
    result = args.out / SOAK_RESULT_NAME
    pidfile = args.out / SOAK_PIDFILE
    end = time.monotonic() + args.budget_s
    while not result.exists():
        if not (pidfile.exists() and soak_alive(pidfile)):
            log(f"no soak running and no {result}; its log:")
            if (args.out / "soak.log").exists():
                print(tail(args.out / "soak.log"))
            return 1
        if time.monotonic() > end:
            log("the soak still runs: collect again")
            return 3
        time.sleep(5)
    v = json.loads(result.read_text())["verdicts"]
    print(json.dumps({k: x for k, x in v.items() if k != "metrics_at_end"}, indent=1))
    print("soak PASSED" if v["passed"] else "soak FAILED")
    return 0 if v["passed"] else 1


# ---- main ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", REPO / ".e2e" / "serve"))
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/vx/throughput"),
        help="where the synthetic checkpoints are (shared with throughput.py)",
    )
    ap.add_argument(
        "--preset",
        dest="presets",
        action="append",
        choices=list(PRESETS),
        help="repeatable; default both",
    )
    ap.add_argument(
        "--variants",
        default=None,
        help=f"some of {','.join(VARIANTS)}; default {','.join(VLLM_VARIANTS)}, and "
        "exllamav3 with --exl3-state",
    )
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="default per preset: "
        + ", ".join(f"{k} {v}" for k, v in GPU_MEMORY_UTILIZATION.items()),
    )
    ap.add_argument(
        "--prompt-waves",
        type=int,
        default=PROMPT_WAVES,
        help=f"prompts per row: this many times the concurrency, at least "
        f"{MIN_PROMPTS} (fewer: a KV-limited row, e.g. bf16 Qwen3-30B-A3B on an "
        "80 GB card, fits a call)",
    )
    exllamav3_anchor.add_state_arguments(ap, "the exllamav3 rows")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="an earlier serve_bench.json: its rows are kept and not measured again",
    )
    ap.add_argument(
        "--paired",
        action="store_true",
        help="past a server's first row, measure a row only if the later variants' "
        "servers can still measure the same concurrency in this call (more server "
        "starts per row; for hosts that are new at every call)",
    )
    ap.add_argument(
        "--write-only", action="store_true", help="write the checkpoints and exit"
    )
    ap.add_argument(
        "--detokenizer-cost",
        action="store_true",
        help="time the API server's detokenizer on random ids with the fixtures' "
        "tokenizer and with model_tokenizer's (CPU only) and exit",
    )
    ap.add_argument("--soak", action="store_true")
    ap.add_argument("--soak-s", type=float, default=SOAK_S)
    ap.add_argument("--seed", type=int, default=0, help="the soak client's seed")
    ap.add_argument("--detach", action="store_true", help="--soak in the background")
    ap.add_argument("--collect", action="store_true", help="a detached soak's verdicts")
    args = ap.parse_args(argv)
    args.presets = args.presets or list(PRESETS)
    if args.variants is None:
        args.variants = ",".join(
            VLLM_VARIANTS + (("exllamav3",) if args.exl3_state else ())
        )
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants or set(args.variants) - set(VARIANTS):
        ap.error(f"--variants takes some of {','.join(VARIANTS)}, got {args.variants}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if set(args.concurrency) - set(CONCURRENCY):
        ap.error(f"--concurrency takes some of {CONCURRENCY}, got {args.concurrency}")
    if args.detokenizer_cost:
        print(detokenizer_cost(args.work))
        return 0
    if args.write_only:
        for p in {SOAK_PRESET} if args.soak else args.presets:
            ensure_checkpoint(
                checkpoint_dir(args.work, p, None, EXL3_BITS, EXL3_CODEBOOK),
                p,
                None,
                EXL3_BITS,
                EXL3_CODEBOOK,
            )
        return 0
    if args.soak:
        if args.collect:
            return collect_soak(args)
        if args.detach:
            return detach_soak(args, argv)
        return run_soak(args)
    return run_matrix(args)


if __name__ == "__main__":
    sys.exit(main())
