#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA (DeepSeek Sparse Attention) end to end through vLLM: the EXL3_MLA_SPARSE
backend against FlashMLA-sparse, on a CUDA host where the built wheel (or the offline
bundle) is installed; see scripts/e2e/README.md.

Writes a synthetic DeepSeek-V3.2-layout EXL3 checkpoint (`DeepseekV32ForCausalLM`: the
dsv3-tiny fixture's MoE body at DeepSeek-V3.2's MLA and indexer dims, index_topk 2048,
random weights with the attention and the logits sharpened so both carry information)
and its dense twin (the same files; config.json without the DSA keys, so vLLM builds
DeepSeek-V3's dense MLA and drops the indexer tensors). One engine at a time, vLLM's
defaults (torch.compile + CUDA graphs; max_num_seqs MAX_NUM_SEQS), the same requests
on each:

  sparse: EXL3_MLA_SPARSE and FLASHMLA_SPARSE, with the bf16 cache and with
          fp8_ds_mla;
  dense:  FLASHMLA and TRITON_MLA, bf16 cache (the baseline);
  anchor: EXL3_MLA_SPARSE with its sparse attention computed by the op wrapper's fp32
          reference (the VLLM_EXL3_FORCE_REFERENCE path), bf16 cache: the truth both
          sparse backends are measured against. Last, so the judged pairs come first.

Requests: prompt logprobs of PROMPTS prompts of PROMPT_TOKENS tokens (longer than
index_topk, so the indexer's selection drops tokens at every later position) and
greedy continuations of the same prompts. Measures (measures.py, as the dense record):
mean and max |dlogprob| over prompt positions and over the decoded tokens of each pair
of continuations' common prefix, identical continuations and the matched fraction.

Judged: each sparse pair (EXL3 vs FlashMLA-sparse, per cache dtype) agrees as closely as
the two dense backends do (mean |dlogprob| within AGREEMENT_FACTOR of theirs or under
AGREEMENT_FLOOR; matched fraction within CONTINUATION_SLACK). Why FLASHMLA and
TRITON_MLA: they are the two bf16 dense MLA decode kernels vLLM 0.26 has on Hopper for
a 576-wide latent head that are independent implementations (FlashMLA, the dense
sibling of the FlashMLA-sparse reference; Triton, a separately written kernel, as ours
is to FlashMLA). Dense MLA prefills every prompt through one shared FlashAttention MHA
path whatever the decode backend, so their prompt logprobs agree exactly; two different
attention kernels only meet in decode. The sparse prompt limit is therefore set by the
larger of the dense pair's prompt and decode differences. A further check shows the
top-k selection is real: FlashMLA-sparse against dense FlashMLA differs far more at
positions past index_topk than before it.

The dense pair is no noise floor for the sparse model, whose indexer can flip a token
at the edge of its top-k on a tiny hidden-state difference (FLASHMLA_SPARSE and dense
FLASHMLA already differ before index_topk, where the selection covers everything). The
reference run is the fair one: EXL3_MLA_SPARSE's distance to it (prompt and decode mean
|dlogprob|) must be at most REFERENCE_SLACK times FLASHMLA_SPARSE's, i.e. our kernel is
no less exact than FlashMLA-sparse. In that run only the attention changes: the engine
runs in its child process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which turns on the
backend's reference path and makes the op itself fail if called. The setting itself
(VLLM_EXL3_FORCE_REFERENCE=1) would also put the EXL3 linear and MoE layers on their
reference codecs: fp32 products that move the anchor away from both backends outside
attention, and a MoE path that reads expert ids on the host, which no CUDA graph
captures.

Before the first sparse engine, a warm-up compiles the DeepGEMM kernels vLLM's DSA
indexer uses (JIT, at first use; an engine would otherwise compile them inside its
decode CUDA graph capture) into a cache under --work that the engines share
(--warm-deepgemm only: just that). Each stage runs in a child process, its output in
sparse_mla_e2e.logs/ under --out and its progress lines echoed; a stage still running
at --budget-s has its stack dumped into its log and is stopped.

A backend this vLLM does not have (EXL3_MLA_SPARSE before its patch is installed) is a
failed row with the reason, not a crash. Raw runs are kept in --out
(sparse_mla_e2e.runs/); a later call reuses those it does not rerun (same checkpoint
digest; with --resume it reruns none), so the matrix can be split over calls (README).
Writes sparse_mla_e2e.json and sparse_mla_e2e.md to --out (default $OUT) after every
stage, and prints the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_exl3.e2e import run_fixture_e2e as fx
from vllm_exl3.e2e.measures import (
    continuation_agreement,
    decode_logprob_agreement,
    free_llm,
    logprob_agreement,
)
from vllm_exl3.e2e.run_moe_e2e import DEEPSEEK_V3_ROUTING
from vllm_exl3.e2e.run_mtp_e2e import BASE_CONFIG, MLA_DIMS

HERE = Path(__file__).resolve().parent

# DeepSeek-V3.2's DSA: the indexer selects index_topk tokens per query; 64 indexer heads
# of 128 (the dims vLLM's fused indexer-query path and DeepGEMM's logits kernels take).
DSA = {"index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}
# Query heads: DeepSeek-V3.2's 128 at tensor parallel 8.
HEADS = 16
LAYERS = 3  # one dense and two MoE decoder layers (the fixture's first_k_dense_replace)
BITS, CODEBOOK, SEED = 4, "mcg", 23
# Random weights give near-uniform attention (scores of std ~0.1) and logits (std
# ~0.3): every kernel would agree on them, right or wrong. The q_a and kv_a norms are
# scaled so scores spread over a few units, the final norm so logits spread over
# several nats.
ATTENTION_SHARPEN = 5.0
LOGIT_SPREAD = 4.0
SHARPENED = {
    ".q_a_layernorm.weight": ATTENTION_SHARPEN,
    ".kv_a_layernorm.weight": ATTENTION_SHARPEN,
    "model.norm.weight": LOGIT_SPREAD,
}
PROMPTS = 8
WINDOWS_PER_PROMPT = 6  # consecutive 512-token fixture windows: 3072-token prompts
PROMPT_TOKENS = WINDOWS_PER_PROMPT * 512
GEN_TOKENS = 32
MAX_MODEL_LEN = 4096  # a prompt plus its continuation, with room
GPU_MEMORY_UTILIZATION = 0.3
# The judging rule of the dense record (run_fixture_e2e.py).
AGREEMENT_FACTOR = fx.AGREEMENT_FACTOR
AGREEMENT_FLOOR = fx.AGREEMENT_FLOOR
CONTINUATION_SLACK = fx.CONTINUATION_SLACK
# Past index_topk the sparse model attends to a subset of the dense model's tokens;
# before it, to the same ones. The difference past it must exceed the difference before
# it by at least this factor, or the selection is not doing anything.
TOPK_EFFECT = 2.0
# An engine's seconds before any run of it was measured: load, torch.compile, CUDA graph
# capture and the requests, with cold compile caches (the DeepGEMM kernels come from
# the warm-up's cache). Once measured, the longest measured run of the same model times
# ESTIMATE_MARGIN.
FIRST_RUN_GUESS_S = {"sparse": 300.0, "dense": 240.0}
ESTIMATE_MARGIN = 1.25
# Seconds under which the warm-up is not started (CUDA init and one compile).
WARM_MIN_S = 60.0
RUNS_DIR = "sparse_mla_e2e.runs"
CHECKPOINTS = {"sparse": "dsa-exl3", "dense": "dsa-exl3-dense"}  # under --work
RESULT = "sparse_mla_e2e"


@dataclass(frozen=True)
class Run:
    model: str  # "sparse" (DeepSeek-V3.2 config) or "dense" (the twin)
    backend: str  # --attention-backend
    kv_cache_dtype: str  # --kv-cache-dtype
    # EXL3_MLA_SPARSE only: sparse attention by the fp32 reference, not the op.
    reference: bool = False


RUNS = {
    "exl3-sparse-bf16": Run("sparse", "EXL3_MLA_SPARSE", "auto"),
    "flashmla-sparse-bf16": Run("sparse", "FLASHMLA_SPARSE", "auto"),
    "exl3-sparse-fp8": Run("sparse", "EXL3_MLA_SPARSE", "fp8_ds_mla"),
    "flashmla-sparse-fp8": Run("sparse", "FLASHMLA_SPARSE", "fp8_ds_mla"),
    "flashmla-dense": Run("dense", "FLASHMLA", "auto"),
    "triton-dense": Run("dense", "TRITON_MLA", "auto"),
    "exl3-sparse-reference-bf16": Run(
        "sparse", "EXL3_MLA_SPARSE", "auto", reference=True
    ),
}
BASELINE = ("flashmla-dense", "triton-dense")
# (label, run a, run b): the sparse pairs judged against BASELINE's agreement.
JUDGED = (
    (
        "EXL3_MLA_SPARSE vs FLASHMLA_SPARSE, bf16 cache",
        "exl3-sparse-bf16",
        "flashmla-sparse-bf16",
    ),
    (
        "EXL3_MLA_SPARSE vs FLASHMLA_SPARSE, fp8_ds_mla cache",
        "exl3-sparse-fp8",
        "flashmla-sparse-fp8",
    ),
)
# Reported, not judged (the baseline itself, and what the fp8 cache costs).
INFORMATIONAL = (
    ("FLASHMLA vs TRITON_MLA, dense, bf16 cache (baseline)", *BASELINE),
    (
        "FLASHMLA_SPARSE, bf16 vs fp8_ds_mla cache",
        "flashmla-sparse-bf16",
        "flashmla-sparse-fp8",
    ),
    (
        "EXL3_MLA_SPARSE, bf16 vs fp8_ds_mla cache",
        "exl3-sparse-bf16",
        "exl3-sparse-fp8",
    ),
)
TOPK_PAIR = (
    "FLASHMLA_SPARSE vs dense FLASHMLA",
    "flashmla-sparse-bf16",
    "flashmla-dense",
)
REFERENCE_RUN = "exl3-sparse-reference-bf16"
# Each sparse backend against the fp32-reference attention: ours first, then the one
# whose distance bounds it.
REFERENCE_PAIRS = (
    ("EXL3_MLA_SPARSE vs reference", "exl3-sparse-bf16", REFERENCE_RUN),
    ("FLASHMLA_SPARSE vs reference", "flashmla-sparse-bf16", REFERENCE_RUN),
)
# Our distance to the reference may exceed FLASHMLA_SPARSE's by this factor: the
# prompt means cover the same positions (the decode means each pair's common prefix),
# and a few top-k flips at the selection's edge move either by several percent; a
# kernel with a systematic extra error lands well above it.
REFERENCE_SLACK = 1.1


# ---- the checkpoints


def dsa_config() -> dict:
    cfg = json.loads(BASE_CONFIG.read_text())
    for key in ("quantization_config", "num_nextn_predict_layers"):
        cfg.pop(key, None)
    cfg.update(DEEPSEEK_V3_ROUTING)
    cfg.update(MLA_DIMS)
    cfg.update(DSA)
    cfg.update(
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        qk_head_dim=MLA_DIMS["qk_nope_head_dim"] + MLA_DIMS["qk_rope_head_dim"],
        max_position_embeddings=2 * MAX_MODEL_LEN,
    )
    return cfg


def dense_config(sparse: dict) -> dict:
    """The sparse model's config.json as DeepSeek-V3's: no DSA keys, dense MLA."""
    cfg = {k: v for k, v in sparse.items() if k not in DSA}
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return cfg


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(directory.glob("*.safetensors")) + [directory / "config.json"]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def write_checkpoints(work: Path) -> tuple[Path, Path, str]:
    """(sparse checkpoint, dense twin, digest of the weights and config), rewritten
    every time (seconds; the seed makes them identical across calls)."""
    from safetensors.torch import load_file, save_file
    from vllm_exl3.testing import synthetic_checkpoint as synth

    sparse, dense = (work / CHECKPOINTS[m] for m in ("sparse", "dense"))
    for d in (sparse, dense):
        shutil.rmtree(d, ignore_errors=True)
    synth.write_checkpoint(
        dsa_config(), sparse, bits=BITS, codebook=CODEBOOK, layers=LAYERS, seed=SEED
    )
    weights = sparse / "model.safetensors"
    named = load_file(weights)
    for name in named:
        for suffix, factor in SHARPENED.items():
            if name.endswith(suffix):
                named[name] = (named[name].float() * factor).to(named[name].dtype)
    save_file(named, str(weights), metadata={"format": "pt"})
    for f in (fx.FIXTURES / "tokenizer").iterdir():
        shutil.copy2(f, sparse / f.name)
    dense.mkdir(parents=True)
    for f in sparse.iterdir():
        if f.name != "config.json":
            os.symlink(f.resolve(), dense / f.name)
    cfg = json.loads((sparse / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps(dense_config(cfg), indent=4))
    return sparse, dense, _digest(sparse)


def prompts() -> list[list[int]]:
    windows = fx.validation_windows()
    n = WINDOWS_PER_PROMPT
    return [sum(windows[i * n : (i + 1) * n], []) for i in range(PROMPTS)]


# ---- the child processes

# Every engine and the DeepGEMM warm-up run in a child process, each in a process group
# of its own: a stage that hangs (a JIT compile inside CUDA graph capture, an engine
# that never comes up) is stopped at the budget, with its stack dumped, and the stages
# before it keep their record. The child's whole output goes to a log under
# --out; its progress lines (CHILD_PROGRESS) are echoed as they come.
CHILD_PROGRESS = "[e2e "
LOGS_DIR = "sparse_mla_e2e.logs"
# Seconds kept back from the budget to stop a child and write the reports.
REPORT_RESERVE_S = 15.0
# Seconds a child is given to write its stack dump (SIGUSR1) before it is killed.
STACK_DUMP_WAIT_S = 5.0
# Seconds between the parent's "still running" lines, so a killed call shows where the
# child stood.
PROGRESS_EVERY_S = 30.0
# Lines of the child's log quoted in a failure's reason.
TAIL_LINES = 15


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
    # The engine core in the child itself: the stack dump shows where the engine
    # stood, and killing the child's process group leaves no engine behind.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def child_command(args: argparse.Namespace, child: list[str]) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *child]
    cmd += ["--out", str(args.out), "--work", str(args.work)]
    # DeepGEMM prints its compiler commands with C stdio, which a pipe buffers fully;
    # stdbuf line-buffers it so the log shows each compile as it starts.
    stdbuf = shutil.which("stdbuf")
    return [stdbuf, "-oL", "-eL", *cmd] if stdbuf else cmd


def supervise(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout_s: float,
    label: str,
) -> dict:
    """Runs cmd with its output in log_path, its progress lines echoed; past timeout_s
    asks it for a stack dump (SIGUSR1), then kills its process group. Returns rc,
    timed_out, seconds and the log's last lines."""
    import collections
    import contextlib
    import signal
    import subprocess
    import threading

    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    t0 = time.monotonic()
    fx.log(f"{label}: started, log {log_path}, stopped after {timeout_s:.0f} s")
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail.append(line.rstrip("\n"))
                if line.startswith(CHILD_PROGRESS):
                    print(line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        next_note = t0 + PROGRESS_EVERY_S
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > timeout_s:
                timed_out = True
                fx.log(f"{label}: past {timeout_s:.0f} s, dumping its stack, stopping")
                with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                    proc.send_signal(signal.SIGUSR1)
                    proc.wait(STACK_DUMP_WAIT_S)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            if now >= next_note:
                last = tail[-1][:200] if tail else "(no output yet)"
                fx.log(f"{label}: running {now - t0:.0f} s; last log line: {last}")
                next_note = now + PROGRESS_EVERY_S
            time.sleep(0.5)
        else:
            # The child is gone; what it left running in its group goes with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        reader.join(STACK_DUMP_WAIT_S)
    seconds = round(time.monotonic() - t0, 1)
    fx.log(f"{label}: exit {proc.returncode} after {seconds} s")
    return {
        "rc": proc.returncode,
        "timed_out": timed_out,
        "seconds": seconds,
        "tail": list(tail),
    }


def failure(label: str, got: dict, log_path: Path) -> str:
    """The reason a child failed: one line (with the log's last line, usually the
    exception), then the log's last lines."""
    why = (
        f"stopped at the time budget after {got['seconds']} s (stack dump in the log)"
        if got["timed_out"]
        else f"exit {got['rc']} after {got['seconds']} s"
    )
    last = next((line for line in reversed(got["tail"]) if line.strip()), "")
    tail = "\n".join(got["tail"])
    return (
        f"{label} {why}: {last.strip()[:200]}; log {log_path}\n"
        f"last lines of the log:\n{tail}"
    )


def in_child() -> None:
    """A child's setup: SIGUSR1 dumps every thread's stack into the log."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)


# ---- DeepGEMM's indexer kernels

# vLLM's DSA indexer runs DeepGEMM kernels that DeepGEMM JIT-compiles at first use, each
# specialized on its shapes: the paged-MQA scheduling kernel on the decode batch rounded
# up to SCHEDULE_ROWS, the paged (decode) and the ragged (prefill) MQA logits kernels on
# the indexer's heads, head dim and cache block. The first engine would compile them in
# its decode CUDA graph capture, one scheduling kernel per rounded capture size; the
# warm-up compiles them before any engine, into a cache the engines share.
SCHEDULE_ROWS = 32  # DeepGEMM rounds the batch of its scheduling kernel up to this
INDEXER_BLOCK = 64  # vLLM's indexer cache block on CUDA
# A cached indexer key: head_dim fp8 values and one fp32 scale.
INDEXER_SCALE_BYTES = 4
# The requests are PROMPTS sequences; vLLM captures decode graphs up to twice
# max_num_seqs. 16 keeps DeepGEMM to one scheduling-kernel variant and graph capture to
# 7 sizes (vLLM's default, 256 sequences, captures 51 and compiles 16 variants).
MAX_NUM_SEQS = 16
JIT_CACHE = "deep_gemm"  # under --work; DG_JIT_CACHE_DIR for every child
WARM_RECORD = "warm.json"  # in the JIT cache: what the warm-up compiled, and how
COMPILERS = {"nvrtc": "1", "nvcc": "0"}  # DG_JIT_USE_NVRTC


def capture_sizes() -> list[int]:
    """vLLM 0.26's default CUDA graph capture sizes for MAX_NUM_SEQS (its
    VllmConfig._set_cudagraph_sizes, below 256)."""
    largest = min(2 * MAX_NUM_SEQS, 512)
    sizes = [s for s in (1, 2, 4) if s <= largest] + list(range(8, largest + 1, 8))
    return sorted(set(sizes))


def schedule_batches() -> list[int]:
    """The scheduling kernel's batch variants: the capture sizes and the requests'
    own decode batch, rounded up to SCHEDULE_ROWS."""
    rows = SCHEDULE_ROWS
    return sorted({-(-b // rows) * rows for b in (*capture_sizes(), PROMPTS)})


def warm_key() -> dict:
    return {
        "index_n_heads": DSA["index_n_heads"],
        "index_head_dim": DSA["index_head_dim"],
        "block": INDEXER_BLOCK,
        "schedule_batches": schedule_batches(),
        "max_model_len": MAX_MODEL_LEN,
    }


def warm_record(work: Path) -> dict | None:
    """The warm-up's record, when it compiled every kernel for these shapes."""
    f = work / JIT_CACHE / WARM_RECORD
    if not f.is_file():
        return None
    doc = json.loads(f.read_text())
    return doc if doc.get("key") == warm_key() else None


def warm_deepgemm(work: Path, compiler: str) -> dict:
    """Runs each DeepGEMM kernel the indexer uses once, with its shapes and dtypes,
    timing each first call (the compile, or the load from the cache)."""
    import torch
    from vllm.utils import deep_gemm as dg
    from vllm.utils.platform_utils import num_compute_units

    if not dg.has_deep_gemm():
        raise RuntimeError("DeepGEMM does not import in this vLLM (has_deep_gemm)")
    dev = torch.device("cuda")
    heads, dim = DSA["index_n_heads"], DSA["index_head_dim"]
    fp8 = torch.float8_e4m3fn
    num_sms = num_compute_units(dev.index or 0)
    context = PROMPT_TOKENS
    blocks = -(-MAX_MODEL_LEN // INDEXER_BLOCK)
    steps: list[dict] = []

    def timed(label: str, fn, *fn_args, **fn_kwargs):
        fx.log(f"DeepGEMM {label}: first call ({compiler})")
        t = time.monotonic()
        out = fn(*fn_args, **fn_kwargs)
        torch.cuda.synchronize()
        steps.append({"kernel": label, "seconds": round(time.monotonic() - t, 1)})
        fx.log(f"DeepGEMM {label}: {steps[-1]['seconds']} s")
        return out

    gen = torch.Generator(device=dev).manual_seed(SEED)

    def fp8_randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen).to(fp8)

    def weights(rows: int) -> torch.Tensor:
        return torch.rand(rows, heads, device=dev, generator=gen)

    batches = schedule_batches()
    for batch in batches:
        lens = torch.full((batch, 1), context, dtype=torch.int32, device=dev)
        schedule = timed(
            f"paged MQA logits metadata, batch {batch}",
            dg.get_paged_mqa_logits_metadata,
            lens,
            INDEXER_BLOCK,
            num_sms,
        )
        if batch != batches[0]:
            continue
        # Decode: the paged kernel on the smallest batch (its code does not depend on
        # the batch), one query per sequence, as vLLM's indexer passes it.
        cache = torch.zeros(
            batch * blocks,
            INDEXER_BLOCK,
            1,
            dim + INDEXER_SCALE_BYTES,
            dtype=torch.uint8,
            device=dev,
        )
        table = torch.arange(batch * blocks, dtype=torch.int32, device=dev)
        logits = timed(
            "paged MQA logits (decode)",
            dg.fp8_fp4_paged_mqa_logits,
            (fp8_randn(batch, 1, heads, dim), None),
            cache,
            weights(batch),
            lens,
            table.view(batch, blocks),
            schedule,
            max_model_len=MAX_MODEL_LEN,
            clean_logits=False,
        )
        if not torch.isfinite(logits[:, :context]).all():
            raise RuntimeError("DeepGEMM paged MQA logits: non-finite on zero keys")
    rows = PROMPT_TOKENS
    logits = timed(
        "MQA logits (prefill)",
        dg.fp8_fp4_mqa_logits,
        (fp8_randn(rows, heads, dim), None),
        (fp8_randn(rows, dim), torch.ones(rows, device=dev)),
        weights(rows),
        torch.zeros(rows, dtype=torch.int32, device=dev),
        torch.arange(1, rows + 1, dtype=torch.int32, device=dev),
        clean_logits=False,
    )
    if not torch.isfinite(logits.diagonal()).all():
        raise RuntimeError("DeepGEMM MQA logits: non-finite on its diagonal")
    record = {
        "key": warm_key(),
        "compiler": compiler,
        "kernels": steps,
        "seconds": round(sum(s["seconds"] for s in steps), 1),
    }
    (work / JIT_CACHE).mkdir(parents=True, exist_ok=True)
    (work / JIT_CACHE / WARM_RECORD).write_text(json.dumps(record, indent=1))
    return record


def jit_env(work: Path, compiler: str) -> dict[str, str]:
    return {
        "DG_JIT_CACHE_DIR": str(work / JIT_CACHE),
        "DG_JIT_USE_NVRTC": COMPILERS[compiler],
        "DG_JIT_PRINT_COMPILER_COMMAND": "1",
    }


def warm_process(args: argparse.Namespace, compiler: str, timeout_s: float) -> dict:
    """The warm-up in a child: its record, or raises with the reason."""
    log = args.out / LOGS_DIR / f"warm-deepgemm-{compiler}.log"
    got = supervise(
        child_command(args, ["--child", "warm", "--deepgemm-compiler", compiler]),
        child_env(jit_env(args.work, compiler)),
        log,
        timeout_s,
        f"DeepGEMM warm-up ({compiler})",
    )
    record = warm_record(args.work)
    if got["rc"] != 0 or record is None or record["compiler"] != compiler:
        raise RuntimeError(failure(f"DeepGEMM warm-up ({compiler})", got, log))
    return record


def warm_stage(args: argparse.Namespace, budget: Budget) -> dict:
    """DeepGEMM's indexer kernels compiled into the shared cache: "ready" with the
    compiler the engines must use (the cache is keyed by it), or the reason not."""
    record = warm_record(args.work)
    if record is not None:
        fx.log(f"DeepGEMM cache warm ({record['compiler']}): {args.work / JIT_CACHE}")
        return {"status": "ready", "cached": True, **record}
    order = [args.deepgemm_compiler] + [
        c for c in COMPILERS if c != args.deepgemm_compiler
    ]
    reasons = []
    for compiler in order:
        timeout = budget.remaining() - REPORT_RESERVE_S
        if timeout < WARM_MIN_S:
            reasons.append(f"{compiler}: not started, {timeout:.0f} s left")
            break
        try:
            return {
                "status": "ready",
                "cached": False,
                **warm_process(args, compiler, timeout),
            }
        except RuntimeError as e:
            reasons.append(str(e))
            fx.log(f"DeepGEMM warm-up with {compiler} failed")
            if budget.remaining() - REPORT_RESERVE_S < WARM_MIN_S:
                break
    return {"status": "failed", "reasons": reasons}


# ---- the engines


class Budget:
    """--budget-s from the start of the call."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()


def estimate(model: str, runs: dict[str, dict]) -> tuple[float, str]:
    """Seconds an engine of `model` is expected to take, and where that comes from."""
    measured = [
        r["total_s"]
        for name, r in runs.items()
        if RUNS[name].model == model and "total_s" in r
    ]
    if measured:
        return ESTIMATE_MARGIN * max(measured), f"{max(measured):.0f} s measured"
    return FIRST_RUN_GUESS_S[model], "first-run guess"


def backend_missing(name: str) -> str | None:
    """Why this vLLM cannot run attention backend `name`, or None when it can."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name not in AttentionBackendEnum.__members__:
        return (
            f"attention backend {name} is not registered in this vLLM "
            "(AttentionBackendEnum has no such member; is the EXL3 build installed?)"
        )
    try:
        AttentionBackendEnum[name].get_class()
    except Exception as e:  # noqa: BLE001 - the reason is the row's result
        return f"attention backend {name} does not import: {type(e).__name__}: {e}"
    return None


def force_reference_attention() -> None:
    """EXL3_MLA_SPARSE layers built from now on in this process compute through the op
    wrapper's fp32 reference (the path VLLM_EXL3_FORCE_REFERENCE=1 selects), and the op
    raises if anything calls it; nothing else changes (module docstring)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError(
            "the reference run needs the engine in this process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0), or its layers would not see the switch"
        )
    from vllm.v1.attention.backends.mla import exl3_mla_sparse
    from vllm.v1.attention.ops import exl3_sparse_mla

    def op_called(*args, **kwargs):
        raise RuntimeError(
            "the EXL3 sparse-MLA op was called in the reference run (its reference "
            "path is not in use)"
        )

    exl3_mla_sparse.reference_forced = lambda: True
    exl3_sparse_mla.sparse_mla_decode = op_called


def run_engine(model_dir: Path, run: Run, batch: list[list[int]]) -> dict:
    """One engine with vLLM's defaults: prompt logprobs, then greedy continuations."""
    from vllm import LLM

    t0 = time.monotonic()
    if run.reference:
        force_reference_attention()
    tag = f"{run.backend} {run.kv_cache_dtype}{' reference' * run.reference}"
    fx.log(f"{tag}: starting the engine")
    llm = LLM(
        model=str(model_dir),
        attention_backend=run.backend,
        kv_cache_dtype=run.kv_cache_dtype,
        # The fixture tokenizer is a plain HF one; DeepseekV32ForCausalLM would default
        # to DeepSeek-V3.2's own tokenizer mode.
        tokenizer_mode="hf",
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        seed=0,
    )
    out: dict = {**asdict(run), "start_s": round(time.monotonic() - t0, 1)}
    fx.log(f"{tag}: engine up in {out['start_s']} s")
    try:
        config = getattr(llm.llm_engine, "vllm_config", None)
        if config is not None:
            out["cache_dtype"] = str(config.cache_config.cache_dtype)
        out["prompt_logprobs"] = fx.score_windows(llm, batch)
        fx.log(f"{tag}: prompt logprobs done")
        out["greedy_tokens"], out["greedy_logprobs"] = fx.greedy(llm, batch, GEN_TOKENS)
    finally:
        free_llm(llm)
    out["total_s"] = round(time.monotonic() - t0, 1)
    fx.log(f"{tag}: start {out['start_s']} s, total {out['total_s']} s")
    return out


def engine_process(
    args: argparse.Namespace, name: str, compiler: str, timeout_s: float
) -> dict:
    """Engine `name` in a child: its run, or raises with the reason."""
    log = args.out / LOGS_DIR / f"{name}.log"
    result = args.work / f"{name}.result.json"
    result.unlink(missing_ok=True)
    got = supervise(
        child_command(args, ["--child", f"engine:{name}"]),
        child_env(jit_env(args.work, compiler)),
        log,
        timeout_s,
        name,
    )
    if got["rc"] != 0 or not result.is_file():
        raise RuntimeError(failure(name, got, log))
    return json.loads(result.read_text())


def load_previous(out: Path, digest: str) -> dict[str, dict]:
    """Runs an earlier call stored for the same checkpoint."""
    runs = {}
    for f in sorted((out / RUNS_DIR).glob("*.json")):
        doc = json.loads(f.read_text())
        if doc.get("checkpoint") == digest and f.stem in RUNS:
            runs[f.stem] = doc["run"]
    return runs


def run(
    args: argparse.Namespace,
    digest: str,
    budget: Budget,
    report=None,
) -> dict:
    """The engines of --runs, one child each, after the DeepGEMM warm-up when a sparse
    engine is among them; `report(result)` after every stage, so a call stopped from
    outside keeps what finished."""
    runs = {} if args.fresh else load_previous(args.out, digest)
    kept = set(runs) if args.resume else set(runs) - set(args.runs)
    result: dict = {
        "deepgemm": None,
        "reused": sorted(kept),
        "skipped": [],
        "errors": {},
        "runs": runs,
    }

    def progress() -> None:
        result["summary"], result["checks"] = judge(runs)
        if report is not None:
            report(result)

    (args.out / RUNS_DIR).mkdir(parents=True, exist_ok=True)
    todo = []
    for name in args.runs:
        if name in kept:
            fx.log(f"{name}: stored by an earlier call (--resume), not rerun")
            continue
        runs.pop(name, None)
        missing = backend_missing(RUNS[name].backend)
        if missing is not None:
            result["errors"][name] = missing
            fx.log(f"{name}: {missing}")
        else:
            todo.append(name)
    compiler = args.deepgemm_compiler
    needs_warm = any(RUNS[n].model == "sparse" for n in todo)
    if args.warm_deepgemm == "only" or (args.warm_deepgemm == "auto" and needs_warm):
        fx.log("stage: DeepGEMM warm-up")
        warm = result["deepgemm"] = warm_stage(args, budget)
        progress()
        if warm["status"] == "ready":
            compiler = warm["compiler"]
        else:
            why = "the DeepGEMM warm-up did not finish (see deepgemm in the JSON)"
            for name in [n for n in todo if RUNS[n].model == "sparse"]:
                todo.remove(name)
                result["skipped"].append(f"{name} ({why})")
                fx.log(f"{name}: skipped, {why}")
    if args.warm_deepgemm == "only":
        todo = []
    for name in todo:
        spec = RUNS[name]
        need, basis = estimate(spec.model, runs)
        left = budget.remaining() - REPORT_RESERVE_S
        if left < need:
            why = (
                f"time budget: needs about {need:.0f} s ({basis}), {left:.0f} s left "
                "of --budget-s"
            )
            result["skipped"].append(f"{name} ({why})")
            fx.log(f"{name}: skipped, {why}")
            progress()
            continue
        fx.log(f"stage: engine {name} (expected about {need:.0f} s, {basis})")
        try:
            got = engine_process(args, name, compiler, left)
        except RuntimeError as e:
            result["errors"][name] = str(e)
            fx.log(f"{name} FAILED: {e}")
        else:
            runs[name] = got
            doc = {"checkpoint": digest, "run": got}
            (args.out / RUNS_DIR / f"{name}.json").write_text(json.dumps(doc))
        progress()
    result["summary"], result["checks"] = judge(runs)
    return result


# ---- the measures


def pair_agreement(a: dict, b: dict) -> dict:
    topk = DSA["index_topk"]
    prompt_a, prompt_b = a["prompt_logprobs"], b["prompt_logprobs"]
    return {
        "prompt": logprob_agreement(prompt_a, prompt_b),
        # Logprob j is scored by the query at position j, which attends to j + 1
        # tokens: the selection drops tokens from j = index_topk on.
        "prompt_within_topk": logprob_agreement(
            [x[:topk] for x in prompt_a], [x[:topk] for x in prompt_b]
        ),
        "prompt_beyond_topk": logprob_agreement(
            [x[topk:] for x in prompt_a], [x[topk:] for x in prompt_b]
        ),
        "decode": decode_logprob_agreement(
            a["greedy_tokens"],
            a["greedy_logprobs"],
            b["greedy_tokens"],
            b["greedy_logprobs"],
        ),
        "continuations": continuation_agreement(a["greedy_tokens"], b["greedy_tokens"]),
    }


def judge(runs: dict[str, dict]) -> tuple[dict, list]:
    checks: list[dict] = []
    summary: dict[str, dict] = {}
    for label, a, b in (*JUDGED, *INFORMATIONAL, TOPK_PAIR, *REFERENCE_PAIRS):
        if a in runs and b in runs:
            summary[label] = {"runs": [a, b], **pair_agreement(runs[a], runs[b])}
    base = summary.get(INFORMATIONAL[0][0])
    for label, _, _ in JUDGED:
        mine = summary.get(label)
        if mine is None or base is None:
            continue
        # Dense prompts share one prefill kernel; two kernels meet only in decode.
        kernel_noise = max(base["prompt"]["mean_abs"], base["decode"]["mean_abs"])
        for kind, noise in (("prompt", kernel_noise), ("decode", None)):
            noise = base[kind]["mean_abs"] if noise is None else noise
            limit = max(AGREEMENT_FACTOR * noise, AGREEMENT_FLOOR)
            value = mine[kind]["mean_abs"]
            fx.check(
                checks,
                f"{label}: mean |dlogprob| ({kind}) vs the dense pair's",
                value,
                limit,
                value <= limit,
            )
        value = mine["continuations"]["matched_fraction"]
        limit = base["continuations"]["matched_fraction"] - CONTINUATION_SLACK
        fx.check(
            checks,
            f"{label}: greedy matched fraction vs the dense pair's",
            value,
            limit,
            value >= limit,
        )
    topk = summary.get(TOPK_PAIR[0])
    if topk is not None:
        within = topk["prompt_within_topk"]["mean_abs"]
        beyond = topk["prompt_beyond_topk"]["mean_abs"]
        limit = TOPK_EFFECT * within
        fx.check(
            checks,
            f"{TOPK_PAIR[0]}: mean |dlogprob| past index_topk vs before it",
            beyond,
            limit,
            beyond > limit,
        )
    ours, theirs = (summary.get(label) for label, _, _ in REFERENCE_PAIRS)
    if ours is not None and theirs is not None:
        for kind in ("prompt", "decode"):
            value = ours[kind]["mean_abs"]
            limit = REFERENCE_SLACK * theirs[kind]["mean_abs"]
            fx.check(
                checks,
                f"{REFERENCE_PAIRS[0][0]}: mean |dlogprob| ({kind}) vs "
                f"{REFERENCE_PAIRS[1][0]} x {REFERENCE_SLACK}",
                value,
                limit,
                value <= limit,
            )
    return summary, checks


# ---- the report


def markdown(result: dict) -> str:
    lines = [
        "| pair | prompt mean / max abs dlogprob | before / past index_topk (mean) "
        "| decode mean / max | continuations identical | matched fraction |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in result["summary"].items():
        p, w, b = s["prompt"], s["prompt_within_topk"], s["prompt_beyond_topk"]
        d, c = s["decode"], s["continuations"]
        lines.append(
            f"| {label} | {p['mean_abs']:.4g} / {p['max_abs']:.4g} | "
            f"{w['mean_abs']:.4g} / {b['mean_abs']:.4g} | "
            f"{d['mean_abs']:.4g} / {d['max_abs']:.4g} | "
            f"{c['identical']} / {c['count']} | {c['matched_fraction']:.3f} |"
        )
    for name in RUNS:
        if name in result["errors"]:
            reason = result["errors"][name].strip().splitlines()[0]
            lines.append(f"| {name} | FAILED: {reason} | | | | |")
    lines.append("")
    for c in result["checks"]:
        verdict = "PASS" if c["pass"] else "FAIL"
        lines.append(
            f"- {verdict} {c['check']}: {c['value']:.6g} (limit {c['limit']:.6g})"
        )
    for s in result["skipped"]:
        lines.append(f"- SKIPPED {s}")
    warm = result.get("deepgemm")
    if warm is not None and warm["status"] == "ready":
        how = "from the cache" if warm["cached"] else f"in {warm['seconds']} s"
        lines.append(f"- DeepGEMM indexer kernels ready ({warm['compiler']}, {how})")
    elif warm is not None:
        first = [r.splitlines()[0] for r in warm["reasons"]]
        lines.append(f"- DeepGEMM warm-up FAILED: {'; '.join(first)}")
    if result["reused"]:
        lines.append(f"- reused from an earlier call: {', '.join(result['reused'])}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"comma-separated engines to run, in order (default: {','.join(RUNS)})",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="ignore runs an earlier call stored in --out",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="run only the engines of --runs that no earlier call stored for this "
        "checkpoint (repeat the same command until the table is complete)",
    )
    fx.add_out_argument(ap, "the JSON, the table, the raw runs and the logs")
    ap.add_argument(
        "--work",
        type=Path,
        default=fx.REPO / ".e2e" / "sparse-mla-work",
        help="scratch: the synthetic checkpoints and DeepGEMM's JIT cache (default "
        ".e2e/sparse-mla-work, which outlives a call on a warm host)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=540,
        help="every stage is stopped by then; an engine whose expected time no longer "
        "fits is skipped, with the reason",
    )
    ap.add_argument(
        "--warm-deepgemm",
        choices=("auto", "only", "off"),
        default="auto",
        help="compile DeepGEMM's indexer kernels before the first sparse engine "
        "(auto), and nothing else (only), or leave them to the engine (off)",
    )
    ap.add_argument(
        "--deepgemm-compiler",
        choices=tuple(COMPILERS),
        default="nvrtc",
        help="DeepGEMM's JIT compiler to try first (the other one if it fails); "
        "NVRTC compiles in-process with a precompiled header, nvcc per kernel",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown or (not args.runs and args.warm_deepgemm != "only"):
        ap.error(f"--runs: unknown {unknown}; choose from {','.join(RUNS)}")
    return args


def environment() -> dict:
    env = fx.environment()
    from vllm.utils.import_utils import has_deep_gemm

    # The indexer's DeepGEMM kernels are JIT-compiled against the headers the wheel
    # ships under vllm/third_party/deep_gemm/include: by NVRTC (libnvrtc, a torch
    # dependency) or by nvcc (on PATH or under CUDA_HOME).
    env["deep_gemm"] = has_deep_gemm()
    env["nvcc"] = shutil.which("nvcc")
    env["CUDA_HOME"] = os.environ.get("CUDA_HOME")
    return env


def child_main(args: argparse.Namespace) -> int:
    """A stage in its own process (see supervise)."""
    in_child()
    if args.child == "warm":
        record = warm_deepgemm(args.work, args.deepgemm_compiler)
        fx.log(f"DeepGEMM warm-up done: {record['seconds']} s of first calls")
        return 0
    kind, _, name = args.child.partition(":")
    if kind != "engine" or name not in RUNS:
        raise SystemExit(f"--child: unknown stage {args.child!r}")
    spec = RUNS[name]
    got = run_engine(args.work / CHECKPOINTS[spec.model], spec, prompts())
    (args.work / f"{name}.result.json").write_text(json.dumps(got))
    return 0


def settings(digest: str) -> dict:
    return {
        "config": dsa_config(),
        "layers": LAYERS,
        "bits": BITS,
        "codebook": CODEBOOK,
        "seed": SEED,
        "sharpened": SHARPENED,
        "checkpoint": digest,
        "prompts": PROMPTS,
        "prompt_tokens": PROMPT_TOKENS,
        "gen_tokens": GEN_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "runs": {k: asdict(v) for k, v in RUNS.items()},
        "host_env": fx.HOST_ENV,
    }


def write_report(out: Path, result: dict) -> str:
    table = markdown(result)
    (out / f"{RESULT}.json").write_text(json.dumps(result, indent=1))
    (out / f"{RESULT}.md").write_text(table + "\n")
    return table


def passed(result: dict) -> bool:
    complete = set(result["runs"]) == set(RUNS)
    return (
        complete
        and bool(result["checks"])
        and all(c["pass"] for c in result["checks"])
        and not result["skipped"]
        and not result["errors"]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for k, v in fx.HOST_ENV.items():
        os.environ.setdefault(k, v)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child_main(args)
    budget = Budget(args.budget_s)
    t0 = time.monotonic()
    fx.log(f"stage: environment (budget {args.budget_s:.0f} s)")
    env = environment()
    fx.log(f"environment: {env}")
    digest = write_checkpoints(args.work)[2]
    fx.log(f"checkpoints written ({time.monotonic() - t0:.1f} s), digest {digest}")
    head = {"environment": env, "settings": settings(digest)}

    def report(partial: dict) -> None:
        partial["seconds"] = round(time.monotonic() - t0, 1)
        write_report(args.out, {**head, **partial})
        fx.log(f"wrote {args.out / RESULT}.json and .md ({partial['seconds']} s)")

    result = run(args, digest, budget, report)
    report(result)
    print()
    print(markdown({**head, **result}))
    if args.warm_deepgemm == "only":
        return 0 if (result["deepgemm"] or {}).get("status") == "ready" else 1
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
