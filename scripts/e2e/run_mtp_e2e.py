#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MTP speculative decoding of an EXL3 checkpoint through vLLM, on a CUDA host where the
built wheel (or the offline bundle) is installed; see scripts/e2e/README.md.

Writes a synthetic EXL3 checkpoint with one MTP layer and its bf16 twin (the same
weights dequantized), by `--layout`:

* `deepseek` (default): DeepSeek-V3's layout (`num_nextn_predict_layers: 1`: enorm,
  hnorm, EXL3 eh_proj, a whole MLA + MoE decoder layer, shared_head.norm; dims of the
  dsv3-tiny fixture, random weights); the twin also gets the MTP layer's embed_tokens
  and shared_head.head, which ExLlamaV3 does not store and vLLM's strict bf16 loader
  wants;
* `qwen3-next`: Qwen3-Next's `mtp.` layout (`mtp_num_hidden_layers: 1`:
  pre_fc_norm_hidden / pre_fc_norm_embedding, EXL3 fc, a gated-attention + MoE decoder
  layer, mtp.norm; the qwen3-next-tiny preset: a Gated DeltaNet and an attention layer,
  random weights), drafted by vLLM's Qwen3NextMTP, which loads the model's own
  embedding and head.

For each model, vLLM with its defaults (torch.compile + CUDA graphs) runs greedy
continuations without and with MTP speculation
(`speculative_config={"method": "mtp", "num_speculative_tokens": 1}`); the measure is
how closely the speculative output agrees with the plain output of the same model.
Pass, for each model: speculation drafted tokens, and wherever a speculative
continuation leaves the plain one, the speculative token was among plain's top tokens
there and within measures.TIE_NATS of plain's own: the only divergence rounding can
explain. The bf16 twin's agreement is reported beside EXL3's; the verdict
does not need it.

Random weights make drafts mostly rejected; that does not matter, the measure is the
output. Prints a compact table; writes mtp_e2e.json (`--layout qwen3-next`:
mtp_e2e-qwen3-next.json) to --out (default $OUT).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

from vllm_exl3.e2e import run_fixture_e2e as fx
from vllm_exl3.e2e.measures import (
    TIE_LOGPROBS,
    TIE_NATS,
    continuation_agreement,
    divergence_gaps,
    free_llm,
    tie_verdict,
    top_logprobs,
)
from vllm_exl3.e2e.run_moe_e2e import DEEPSEEK_V3_ROUTING, dequantized_twin

HERE = Path(__file__).resolve().parent

# The dsv3-tiny fixture's config (16 experts top-4, one shared expert, a dense first
# layer), with DeepSeek-V3's MLA dims: vLLM 0.26's MLA kernels on Hopper take a
# 576-wide latent head (kv_lora_rank 512 + qk_rope 64) and its only MLA prefill backend
# there (FlashAttention) takes (qk_nope, qk_rope, v) = (128, 64, 128); the fixture's
# (64, 64, 64) with rank 128 runs on neither.
BASE_CONFIG = fx.REPO / "tests" / "fixtures" / "moe" / "dsv3-4.0bpw-mcg" / "config.json"
MLA_DIMS = {
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
# Decoder layers before the MTP layer: deepseek, one dense and one MoE; qwen3-next, a
# Gated DeltaNet and a gated-attention layer, both MoE.
LAYERS = 2
BITS, MTP_BITS, CODEBOOK = 4, 4, "mcg"
SEED = 11
SPEC_TOKENS = 1
SPECULATIVE_CONFIG = {"method": "mtp", "num_speculative_tokens": SPEC_TOKENS}
PROMPTS = 16
PROMPT_TOKENS = 32
GEN_TOKENS = 32
# An engine with a draft model compiles and captures graphs for both.
STAGE_COST_S = {"plain": 75, "spec": 110}
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


DEEPSEEK, QWEN3_NEXT = "deepseek", "qwen3-next"
LAYOUTS = (DEEPSEEK, QWEN3_NEXT)
# The synthetic writer's Qwen3-Next preset (vllm_exl3.testing.synthetic_checkpoint).
QWEN3_NEXT_PRESET = "qwen3-next-tiny"


def mtp_config(layout: str = DEEPSEEK) -> dict:
    if layout == QWEN3_NEXT:
        from vllm_exl3.testing import synthetic_checkpoint as synth

        cfg = synth.load_config(QWEN3_NEXT_PRESET)
        cfg["mtp_num_hidden_layers"] = 1
        return cfg
    cfg = json.loads(BASE_CONFIG.read_text())
    cfg.pop("quantization_config", None)
    cfg.update(DEEPSEEK_V3_ROUTING)
    cfg["num_nextn_predict_layers"] = 1
    cfg.update(MLA_DIMS)
    return cfg


def result_name(layout: str) -> str:
    """The JSON's stem: the default layout keeps its historical name."""
    return "mtp_e2e" if layout == DEEPSEEK else f"mtp_e2e-{layout}"


def write_checkpoints(work: Path, layout: str = DEEPSEEK) -> tuple[Path, Path]:
    """(EXL3 checkpoint, bf16 twin) under work/, rewritten every time (seconds)."""
    from safetensors.torch import load_file, save_file
    from vllm_exl3.testing import synthetic_checkpoint as synth

    stem = "mtp" if layout == DEEPSEEK else f"mtp-{layout}"
    exl3, bf16 = work / f"{stem}-exl3", work / f"{stem}-bf16"
    shutil.rmtree(exl3, ignore_errors=True)
    synth.write_checkpoint(
        mtp_config(layout),
        exl3,
        bits=BITS,
        codebook=CODEBOOK,
        mtp_bits=MTP_BITS,
        layers=LAYERS,
        mtp=True,
        seed=SEED,
    )
    for f in (fx.FIXTURES / "tokenizer").iterdir():
        shutil.copy2(f, exl3 / f.name)
    dequantized_twin(exl3, bf16)
    if layout == QWEN3_NEXT:
        # Qwen3NextMTP loads the model's own embed_tokens and lm_head.
        return exl3, bf16
    # vLLM's MTP layer owns an embedding and a head (shared with the target's in
    # DeepSeek-V3's own checkpoints, stored per layer there); the twin gets copies of
    # the model's.
    weights = {}
    for f in bf16.glob("*.safetensors"):
        weights.update(load_file(f))
    mtp = f"model.layers.{LAYERS}"
    extra = {
        f"{mtp}.embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
        f"{mtp}.shared_head.head.weight": weights["lm_head.weight"].clone(),
    }
    save_file(
        extra, str(bf16 / "model-mtp-shared.safetensors"), metadata={"format": "pt"}
    )
    index = bf16 / "model.safetensors.index.json"
    if index.is_file():
        doc = json.loads(index.read_text())
        doc["weight_map"].update({k: "model-mtp-shared.safetensors" for k in extra})
        index.write_text(json.dumps(doc, indent=2))
    return exl3, bf16


def prompts() -> list[list[int]]:
    windows = fx.validation_windows()
    step = max(1, len(windows) // PROMPTS)
    return [windows[i * step][:PROMPT_TOKENS] for i in range(PROMPTS)]


def spec_metrics(llm) -> dict:
    out = {}
    try:
        for m in llm.get_metrics():
            if m.name in SPEC_METRICS:
                out[m.name.split(":")[1]] = getattr(m, "value", None)
    except Exception as e:  # noqa: BLE001 - reported; the agreement stands without it
        out["error"] = repr(e)
    return out


def gdn_prefill_config(layout: str) -> dict | None:
    """vLLM's additional_config for Qwen3-Next's gated-delta-net prefill: vLLM 0.26
    takes FlashInfer's kernel on Hopper without checking that flashinfer is installed
    (qwen_gdn_linear_attn._resolve_gdn_prefill_backend), and the offline bundle does
    not ship it, so without it the Triton (FLA) kernel is asked for."""
    if layout != QWEN3_NEXT or importlib.util.find_spec("flashinfer") is not None:
        return None
    return {"gdn_prefill_backend": "triton"}


def generate(
    model_dir: Path,
    batch: list[list[int]],
    *,
    speculative: bool,
    attention_backend: str | None,
    additional_config: dict | None = None,
) -> dict:
    """One engine (vLLM defaults): greedy continuations, with or without MTP
    speculation."""
    from vllm import SamplingParams

    engine: dict = {
        "disable_log_stats": False
    }  # the spec-decode counters need the stats
    if speculative:
        engine["speculative_config"] = dict(SPECULATIVE_CONFIG)
    if attention_backend:
        engine["attention_backend"] = attention_backend
    if additional_config:
        engine["additional_config"] = dict(additional_config)
    t0 = time.monotonic()
    llm = fx.make_llm(model_dir, eager=False, tp=1, engine_args=engine)
    out: dict = {"speculative": speculative, "start_s": round(time.monotonic() - t0, 1)}
    try:
        params = SamplingParams(
            max_tokens=GEN_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
            logprobs=None if speculative else TIE_LOGPROBS,
        )
        res = llm.generate(
            [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False
        )
        out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
        if not speculative:
            out["top"] = [top_logprobs(r.outputs[0].logprobs) for r in res]
        out["metrics"] = spec_metrics(llm)
    finally:
        free_llm(llm)
    out["total_s"] = round(time.monotonic() - t0, 1)
    fx.log(
        f"{model_dir.name} speculative={speculative}: start {out['start_s']} s, "
        f"total {out['total_s']} s, {out['metrics']}"
    )
    return out


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions holding the same token (a position-wise count; after a
    divergence the two runs condition on different text, so this is the looser of the
    two measures)."""
    same = total = 0
    for x, y in zip(a, b):
        same += sum(1 for p, q in zip(x, y) if p == q)
        total += max(len(x), len(y))
    return same / total if total else 1.0


def run(
    args: argparse.Namespace,
    batch: list[list[int]],
    models: dict[str, Path],
    deadline: fx.Deadline,
) -> dict:
    runs: dict[str, dict] = {}
    skipped: list[str] = []
    errors: dict[str, str] = {}
    for kind, path in models.items():
        for speculative, stage in ((False, "plain"), (True, "spec")):
            key = f"{kind} {stage}"
            if not deadline.allows(stage):
                skipped.append(f"{key} (time budget)")
                continue
            got = fx.attempt(
                errors,
                key,
                generate,
                path,
                batch,
                speculative=speculative,
                attention_backend=args.attention_backend,
                additional_config=gdn_prefill_config(getattr(args, "layout", DEEPSEEK)),
            )
            if got is not None:
                runs.setdefault(kind, {})[stage] = got
                fx.save_progress(
                    getattr(args, "out", None),
                    runs,
                    errors,
                    skipped,
                    name=result_name(getattr(args, "layout", DEEPSEEK)),
                )
    summary, checks = judge(runs)
    return {
        "summary": summary,
        "checks": checks,
        "skipped": skipped,
        "errors": errors,
        "runs": runs,
    }


def judge(runs: dict[str, dict]) -> tuple[dict, list]:
    checks: list[dict] = []
    summary: dict[str, dict] = {}
    for kind, stages in runs.items():
        if "plain" not in stages or "spec" not in stages:
            continue
        plain, spec = stages["plain"]["tokens"], stages["spec"]["tokens"]
        s = {
            "continuations": continuation_agreement(plain, spec),
            "token_agreement": token_agreement(plain, spec),
            "spec_metrics": stages["spec"].get("metrics", {}),
        }
        drafts = s["spec_metrics"].get("spec_decode_num_drafts")
        if drafts is not None:
            fx.check(
                checks, f"{kind}: speculation drafted tokens", drafts, 1, drafts >= 1
            )
        if "top" in stages["plain"]:
            ties = tie_verdict(divergence_gaps(plain, stages["plain"]["top"], spec))
            s["divergences"] = ties
            fx.check(
                checks,
                f"{kind}: speculative output leaves plain only at near ties",
                ties["widest_gap"],
                TIE_NATS,
                ties["pass"],
            )
        summary[kind] = s
    return summary, checks


def print_table(result: dict) -> None:
    print()
    for kind, s in result["summary"].items():
        c, m = s["continuations"], s["spec_metrics"]
        print(
            f"{kind:5s} speculative vs plain: identical {c['identical']}/{c['count']}, "
            f"matched {c['matched_fraction']:.3f}, tokens {s['token_agreement']:.3f}; "
            f"drafts {m.get('spec_decode_num_drafts')}, accepted "
            f"{m.get('spec_decode_num_accepted_tokens')}"
        )
    fx.print_verdicts(result)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fx.add_out_argument(ap)
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/vx/e2e-mtp"),
        help="scratch: the synthetic checkpoints",
    )
    ap.add_argument(
        "--models",
        default="exl3,bf16",
        help="which of exl3,bf16 to run, in order (default both)",
    )
    ap.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=DEEPSEEK,
        help="MTP layout of the synthetic model: deepseek (model.layers.N, default) "
        "or qwen3-next (mtp.*, drafted by Qwen3NextMTP)",
    )
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="vLLM attention backend for every engine (default: vLLM's choice)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450,
        help="skip remaining stages that would not finish within this many seconds",
    )
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if not args.models or set(args.models) - {"exl3", "bf16"}:
        ap.error(f"--models {','.join(args.models)}: choose from exl3,bf16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for k, v in fx.HOST_ENV.items():
        os.environ.setdefault(k, v)
    deadline = fx.Deadline(args.budget_s, STAGE_COST_S)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    env = fx.environment()
    fx.log(f"environment: {env}")
    exl3, bf16 = write_checkpoints(args.work, args.layout)
    fx.log(f"checkpoints written ({time.monotonic() - t0:.1f} s)")
    paths = {"exl3": exl3, "bf16": bf16}
    result = run(args, prompts(), {m: paths[m] for m in args.models}, deadline)
    result = {
        "environment": env,
        "seconds": round(time.monotonic() - t0, 1),
        "settings": {
            "layout": args.layout,
            "config": mtp_config(args.layout),
            "layers": LAYERS,
            "bits": BITS,
            "mtp_bits": MTP_BITS,
            "codebook": CODEBOOK,
            "seed": SEED,
            "speculative_config": SPECULATIVE_CONFIG,
            "prompts": PROMPTS,
            "prompt_tokens": PROMPT_TOKENS,
            "gen_tokens": GEN_TOKENS,
            "tie_nats": TIE_NATS,
            "attention_backend": args.attention_backend,
            "additional_config": gdn_prefill_config(args.layout),
            "gpu_memory_utilization": fx.GPU_MEMORY_UTILIZATION,
            "max_model_len": fx.MAX_MODEL_LEN,
            "host_env": fx.HOST_ENV,
        },
        **result,
    }
    text = json.dumps(result, indent=1)
    path = args.out / f"{result_name(args.layout)}.json"
    path.write_text(text)
    print_table(result)
    fx.log(f"wrote {path} ({result['seconds']} s)")
    ok = fx.all_passed(result) and len(result["summary"]) == len(args.models)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
