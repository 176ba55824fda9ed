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
defaults (torch.compile + CUDA graphs), the same requests on each:

  sparse: EXL3_MLA_SPARSE and FLASHMLA_SPARSE, with the bf16 cache and with
          fp8_ds_mla;
  dense:  FLASHMLA and TRITON_MLA, bf16 cache (the baseline).

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

A backend this vLLM does not have (EXL3_MLA_SPARSE before its patch is installed) is a
failed row with the reason, not a crash. Raw runs are kept in --out
(sparse_mla_e2e.runs/); a later call reuses those it does not rerun (same checkpoint
digest), so the matrix can be split over calls (README). Prints a markdown table;
writes sparse_mla_e2e.json and sparse_mla_e2e.md to --out (default $OUT).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_fixture_e2e as fx  # noqa: E402
from measures import (  # noqa: E402
    continuation_agreement,
    decode_logprob_agreement,
    free_llm,
    logprob_agreement,
)
from run_moe_e2e import DEEPSEEK_V3_ROUTING  # noqa: E402
from run_mtp_e2e import BASE_CONFIG, MLA_DIMS  # noqa: E402

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
# Seconds an engine is assumed to take (compile, graph capture, requests); the first
# sparse engine on a fresh host also JIT-compiles DeepGEMM's indexer kernels.
STAGE_COST_S = {"sparse": 120, "dense": 90}
RUNS_DIR = "sparse_mla_e2e.runs"
RESULT = "sparse_mla_e2e"


@dataclass(frozen=True)
class Run:
    model: str  # "sparse" (DeepSeek-V3.2 config) or "dense" (the twin)
    backend: str  # --attention-backend
    kv_cache_dtype: str  # --kv-cache-dtype


RUNS = {
    "exl3-sparse-bf16": Run("sparse", "EXL3_MLA_SPARSE", "auto"),
    "flashmla-sparse-bf16": Run("sparse", "FLASHMLA_SPARSE", "auto"),
    "exl3-sparse-fp8": Run("sparse", "EXL3_MLA_SPARSE", "fp8_ds_mla"),
    "flashmla-sparse-fp8": Run("sparse", "FLASHMLA_SPARSE", "fp8_ds_mla"),
    "flashmla-dense": Run("dense", "FLASHMLA", "auto"),
    "triton-dense": Run("dense", "TRITON_MLA", "auto"),
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
    sys.path.insert(0, str(fx.REPO / "tests"))
    import synthetic_checkpoint as synth
    from safetensors.torch import load_file, save_file

    sparse, dense = work / "dsa-exl3", work / "dsa-exl3-dense"
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


# ---- the engines


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


def run_engine(model_dir: Path, run: Run, batch: list[list[int]]) -> dict:
    """One engine with vLLM's defaults: prompt logprobs, then greedy continuations."""
    from vllm import LLM

    t0 = time.monotonic()
    llm = LLM(
        model=str(model_dir),
        attention_backend=run.backend,
        kv_cache_dtype=run.kv_cache_dtype,
        # The fixture tokenizer is a plain HF one; DeepseekV32ForCausalLM would default
        # to DeepSeek-V3.2's own tokenizer mode.
        tokenizer_mode="hf",
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )
    out: dict = {**asdict(run), "start_s": round(time.monotonic() - t0, 1)}
    try:
        config = getattr(llm.llm_engine, "vllm_config", None)
        if config is not None:
            out["cache_dtype"] = str(config.cache_config.cache_dtype)
        out["prompt_logprobs"] = fx.score_windows(llm, batch)
        out["greedy_tokens"], out["greedy_logprobs"] = fx.greedy(llm, batch, GEN_TOKENS)
    finally:
        free_llm(llm)
    out["total_s"] = round(time.monotonic() - t0, 1)
    fx.log(
        f"{run.backend} {run.kv_cache_dtype}: start {out['start_s']} s, total "
        f"{out['total_s']} s"
    )
    return out


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
    batch: list[list[int]],
    models: dict[str, Path],
    digest: str,
    deadline: fx.Deadline,
) -> dict:
    runs = {} if args.fresh else load_previous(args.out, digest)
    reused = sorted(set(runs) - set(args.runs))
    errors: dict[str, str] = {}
    skipped: list[str] = []
    (args.out / RUNS_DIR).mkdir(parents=True, exist_ok=True)
    for name in args.runs:
        spec = RUNS[name]
        runs.pop(name, None)
        missing = backend_missing(spec.backend)
        if missing is not None:
            errors[name] = missing
            fx.log(f"{name}: {missing}")
            continue
        if not deadline.allows(spec.model):
            skipped.append(f"{name} (time budget)")
            continue
        got = fx.attempt(errors, name, run_engine, models[spec.model], spec, batch)
        if got is not None:
            runs[name] = got
            doc = {"checkpoint": digest, "run": got}
            (args.out / RUNS_DIR / f"{name}.json").write_text(json.dumps(doc))
    summary, checks = judge(runs)
    return {
        "summary": summary,
        "checks": checks,
        "reused": reused,
        "skipped": skipped,
        "errors": errors,
        "runs": runs,
    }


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
    for label, a, b in (*JUDGED, *INFORMATIONAL, TOPK_PAIR):
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
            reason = result["errors"][name].strip().splitlines()[-1]
            lines.append(f"| {name} | FAILED: {reason} | | | | |")
    lines.append("")
    for c in result["checks"]:
        verdict = "PASS" if c["pass"] else "FAIL"
        lines.append(
            f"- {verdict} {c['check']}: {c['value']:.6g} (limit {c['limit']:.6g})"
        )
    for s in result["skipped"]:
        lines.append(f"- SKIPPED {s}")
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
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", fx.REPO / ".e2e" / "results")),
        help="where the JSON, the table and the raw runs go (default $OUT, else "
        ".e2e/results)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/vx/e2e-sparse-mla"),
        help="scratch: the synthetic checkpoints",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=540,
        help="skip remaining engines that would not finish within this many seconds",
    )
    args = ap.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown or not args.runs:
        ap.error(f"--runs: unknown {unknown}; choose from {','.join(RUNS)}")
    return args


def environment() -> dict:
    env = fx.environment()
    from vllm.utils.import_utils import has_deep_gemm

    # The indexer's DeepGEMM kernels are JIT-compiled with nvcc against the headers the
    # wheel ships under vllm/third_party/deep_gemm/include.
    env["deep_gemm"] = has_deep_gemm()
    env["nvcc"] = shutil.which("nvcc")
    env["CUDA_HOME"] = os.environ.get("CUDA_HOME")
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for k, v in fx.HOST_ENV.items():
        os.environ.setdefault(k, v)
    deadline = fx.Deadline(args.budget_s, STAGE_COST_S)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    env = environment()
    fx.log(f"environment: {env}")
    sparse, dense, digest = write_checkpoints(args.work)
    fx.log(f"checkpoints written ({time.monotonic() - t0:.1f} s), digest {digest}")
    result = run(args, prompts(), {"sparse": sparse, "dense": dense}, digest, deadline)
    result = {
        "environment": env,
        "seconds": round(time.monotonic() - t0, 1),
        "settings": {
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
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "runs": {k: asdict(v) for k, v in RUNS.items()},
            "host_env": fx.HOST_ENV,
        },
        **result,
    }
    table = markdown(result)
    (args.out / f"{RESULT}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{RESULT}.md").write_text(table + "\n")
    print()
    print(table)
    fx.log(f"wrote {args.out / RESULT}.json and .md ({result['seconds']} s)")
    complete = set(result["runs"]) == set(RUNS)
    ok = (
        complete
        and bool(result["checks"])
        and all(c["pass"] for c in result["checks"])
        and not result["skipped"]
        and not result["errors"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
