#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MoE fixture conversions end to end through vLLM, on a CUDA host where the built
wheel (or the offline bundle) is installed; see scripts/e2e/README.md.

--moe-dir: a directory written by stage_fixtures.sh (or the shared fixture set itself).
Per EXL3 conversion (qwen3moe-e16-tiny 3.0 bpw mcg and 5.0 bpw mul1, dsv3-tiny 4.0 bpw
mcg):
  - vLLM with its defaults (torch.compile + CUDA graphs): perplexity on val.txt by the
    fixtures' method vs ExLlamaV3's recorded value (within 0.3%);
  - the same requests with enforce_eager=True, agreement measured as for the dense
    fixtures and judged against a bf16 model of the same architecture: the original bf16
    checkpoint when the directory holds it, else the EXL3 conversion dequantized to bf16
    (`vllm-exl3 dequantize`: the same weights through vLLM's own bf16 kernels);
  - `vllm serve` answering one completions request on one conversion.
dsv3-tiny's config.json lacks "topk_method": "noaux_tc" and "scoring_func": "sigmoid"
(transformers 5 omits them; vLLM 0.26 reads their absence as softmax routing without the
correction bias): the working copy gets them, and the JSON says so.

Prints a compact table; writes moe_e2e[_<models>].json to --out (default $OUT).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_exl3.e2e import run_fixture_e2e as fx

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class MoEModel:
    record: (
        str  # ExLlamaV3's perplexity record, as the fixture set names it under logs/
    )
    conversions: tuple[str, ...]
    # The conversion dequantized to bf16 when the original is not at hand: the highest
    # rate.
    twin_source: str
    # Environment for every engine of the model (and its `vllm serve`), with the reason.
    env: tuple[tuple[str, str], ...] = ()
    env_reason: str = ""


# vLLM 0.26 has no MLA kernel for dsv3-tiny's dims on Hopper: MLA decode needs a
# 576-wide latent head (kv_lora_rank 512) and FlashAttention's MLA prefill takes
# (qk_nope, rope, v) = (128, 64, 128), (192, 64, 256) or (64, 64, 128); the fixture has
# rank 128 and (64, 64, 64). vLLM's DeepSeek MHA form computes the same attention.
DSV3_TINY_MHA = (
    "VLLM_MLA_DISABLE=1: vLLM 0.26 has no MLA kernel for dsv3-tiny's dims "
    "(kv_lora_rank 128, qk_nope/rope/v 64/64/64); its attention runs as vLLM's "
    "DeepSeek MHA (kv_b expanded per token), the same math; q_a, kv_a, q_b and o "
    "stay EXL3"
)


MODELS = {
    "qwen3moe-e16-tiny": MoEModel(
        "ppl_exllamav3_moe_e16.json",
        ("exl3-3.0bpw-mcg", "exl3-5.0bpw-mul1"),
        "exl3-5.0bpw-mul1",
    ),
    "dsv3-tiny": MoEModel(
        "ppl_exllamav3_dsv3.json",
        ("exl3-4.0bpw-mcg",),
        "exl3-4.0bpw-mcg",
        env=(("VLLM_MLA_DISABLE", "1"),),
        env_reason=DSV3_TINY_MHA,
    ),
}
ORIGINAL = "bf16"  # the original checkpoint's directory name in the fixture set
DEQUANTIZED = "bf16-dequantized"
# transformers 5 writes DeepSeek-V3 configs without these; vLLM 0.26 needs them to
# route with sigmoid scores plus e_score_correction_bias as the model was trained.
DEEPSEEK_V3_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
SUMS = "SHA256SUMS"  # written by stage_fixtures.sh


def label(model: str, checkpoint: str) -> str:
    return f"{model}/{checkpoint}"


@contextlib.contextmanager
def model_environment(model: str | None):
    """The model's engine environment (MoEModel.env) while its engines run; vLLM's
    settings cache is dropped on entry and exit so each engine reads it afresh."""
    import vllm.envs as envs

    saved = {}
    for key, value in MODELS[model].env if model in MODELS else ():
        saved[key] = os.environ.get(key)
        os.environ[key] = value
    envs.disable_envs_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        envs.disable_envs_cache()


def record_path(moe_dir: Path, model: str) -> Path:
    """The staged copy (top level) or the fixture set's own (logs/)."""
    name = MODELS[model].record
    for path in (moe_dir / name, moe_dir / "logs" / name):
        if path.is_file():
            return path
    raise SystemExit(f"{moe_dir}: no {name} (ExLlamaV3's perplexities of {model})")


def recorded_perplexities(moe_dir: Path, model: str) -> dict[str, dict]:
    return {r["label"]: r for r in json.loads(record_path(moe_dir, model).read_text())}


def verify_staged(moe_dir: Path) -> dict:
    """Check the staged files against the SHA256SUMS the staging wrote (a truncated copy
    would otherwise show up as a perplexity failure)."""
    sums = moe_dir / SUMS
    if not sums.is_file():
        return {"checked": 0, "note": f"no {SUMS}: files not verified"}
    bad = []
    lines = [ln for ln in sums.read_text().splitlines() if ln.strip()]
    for line in lines:
        digest, name = line.split(maxsplit=1)
        path = moe_dir / name.lstrip("*")
        if not path.is_file():
            bad.append(f"{name}: missing")
            continue
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != digest:
            bad.append(f"{name}: SHA-256 differs from {SUMS}")
    if bad:
        raise SystemExit(f"{moe_dir}: staged files damaged: " + "; ".join(bad))
    return {"checked": len(lines)}


def assemble(src: Path, out: Path) -> list[str]:
    """A working copy of a checkpoint directory with what vLLM needs added; returns what
    was added, for the record."""
    if not (src / "config.json").is_file():
        raise SystemExit(f"{src}: no config.json (staged with stage_fixtures.sh?)")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    notes = []
    if not (out / "tokenizer.json").is_file():
        for f in (fx.FIXTURES / "tokenizer").iterdir():
            shutil.copy2(f, out / f.name)
        notes.append("tokenizer files from tests/fixtures/qwen3-tiny/tokenizer")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") == "deepseek_v3":
        missing = {k: v for k, v in DEEPSEEK_V3_ROUTING.items() if k not in cfg}
        if missing:
            cfg.update(missing)
            cfg_path.write_text(json.dumps(cfg, indent=4))
            notes.append(
                "config.json: added "
                + ", ".join(f"{k}={v!r}" for k, v in missing.items())
            )
    return notes


def dequantized_twin(src: Path, out: Path) -> None:
    """The EXL3 checkpoint's reconstructed weights as a bf16 checkpoint."""
    import torch
    from vllm_exl3.dequantize import dequantize

    shutil.rmtree(out, ignore_errors=True)
    cuda = torch.cuda.is_available()
    dequantize(
        src, out, dtype="bfloat16", device="cuda" if cuda else "cpu", progress=False
    )
    if cuda:
        # The next engine sizes its KV cache from the free memory.
        torch.cuda.empty_cache()
    # Tokenizer and generation files, whatever dequantize left out.
    for f in src.iterdir():
        if (
            f.is_file()
            and not (out / f.name).exists()
            and f.suffix != ".safetensors"
            and f.name != "quantization_config.json"
        ):
            shutil.copy2(f, out / f.name)


@dataclass
class Checkpoint:
    label: str
    path: Path
    exl3: bool
    recorded: (
        dict | None
    )  # ExLlamaV3's record this checkpoint's perplexity is set against
    notes: list[str]
    twin_of: Path | None = None  # the EXL3 working copy a dequantized twin is made from


def prepare(
    args: argparse.Namespace, model: str
) -> tuple[list[Checkpoint], Checkpoint | None]:
    """The model's EXL3 working copies and its bf16 reference (None when not wanted); a
    dequantized reference is only planned here and made by `make_reference`."""
    spec = MODELS[model]
    recorded = recorded_perplexities(args.moe_dir, model)
    convs = []
    for conv in spec.conversions:
        dst = args.work / "models" / model / conv
        notes = assemble(args.moe_dir / model / conv, dst)
        convs.append(
            Checkpoint(label(model, conv), dst, True, recorded.get(conv), notes)
        )
    if args.reference == "none":
        return convs, None
    original = args.moe_dir / model / ORIGINAL
    if (original / "config.json").is_file():
        dst = args.work / "models" / model / ORIGINAL
        return convs, Checkpoint(
            label(model, ORIGINAL),
            dst,
            False,
            recorded.get(ORIGINAL),
            assemble(original, dst),
        )
    dst = args.work / "models" / model / DEQUANTIZED
    source = next(c for c in convs if c.label == label(model, spec.twin_source))
    # Its perplexity is set against the source conversion's record (reported, not
    # judged).
    return convs, Checkpoint(
        label(model, DEQUANTIZED),
        dst,
        False,
        source.recorded,
        [
            f"dequantized from {spec.twin_source} (the original bf16 "
            f"checkpoint was not staged)"
        ],
        twin_of=source.path,
    )


def make_reference(ref: Checkpoint) -> bool:
    if ref.twin_of is not None:
        t0 = time.monotonic()
        dequantized_twin(ref.twin_of, ref.path)
        ref.notes.append(f"dequantized in {time.monotonic() - t0:.1f} s")
    return True


def run(
    args: argparse.Namespace, windows: list[list[int]], deadline: fx.Deadline
) -> dict:
    engine = (
        {"attention_backend": args.attention_backend}
        if args.attention_backend
        else None
    )
    runs: dict[str, dict] = {}
    skipped: list[str] = []
    errors: dict[str, str] = {}
    checkpoints: dict[str, Checkpoint] = {}
    reference_of: dict[str, str] = {}  # EXL3 label -> its model's bf16 reference label

    def progress() -> None:
        fx.save_progress(
            getattr(args, "out", None), runs, errors, skipped, name="moe_e2e"
        )

    def one(ckpt: Checkpoint) -> None:
        if not deadline.allows("default"):
            skipped.append(f"{ckpt.label} default (time budget)")
            return
        default = fx.attempt(
            errors,
            f"{ckpt.label} default",
            fx.run_mode,
            ckpt.label,
            ckpt.path,
            windows,
            eager=False,
            tp=1,
            full_ppl=True,
            engine_args=engine,
        )
        if default is None:
            return
        runs[ckpt.label] = {"default": default}
        progress()
        if not args.eager:
            return
        if not deadline.allows("eager"):
            skipped.append(f"{ckpt.label} eager (time budget)")
            return
        eager = fx.attempt(
            errors,
            f"{ckpt.label} eager",
            fx.run_mode,
            ckpt.label,
            ckpt.path,
            windows,
            eager=True,
            tp=1,
            full_ppl=False,
            engine_args=engine,
        )
        if eager is not None:
            runs[ckpt.label]["eager"] = eager
            progress()

    for model in args.models:
        convs, ref = prepare(args, model)
        if MODELS[model].env_reason:
            convs[0].notes.append(MODELS[model].env_reason)
        with model_environment(model):
            for c in convs:
                checkpoints[c.label] = c
                one(c)
            if ref is not None:
                checkpoints[ref.label] = ref
                for c in convs:
                    reference_of[c.label] = ref.label
                if fx.attempt(errors, f"{ref.label} prepare", make_reference, ref):
                    one(ref)

    serve = None
    serve_label = args.serve
    if serve_label == "auto":
        serve_label = next(
            (lb for lb, c in checkpoints.items() if c.exl3 and lb in runs), None
        )
    if serve_label not in (None, "none"):
        if serve_label not in runs:
            skipped.append(f"serve {serve_label} (its offline run did not happen)")
        elif deadline.allows("serve"):
            extra = (
                ("--attention-backend", args.attention_backend)
                if args.attention_backend
                else ()
            )
            with model_environment(serve_label.split("/")[0]):
                serve = fx.attempt(
                    errors,
                    f"serve {serve_label}",
                    fx.serve_once,
                    serve_label,
                    checkpoints[serve_label].path,
                    1,
                    args.work,
                    min(
                        fx.SERVE_READY_TIMEOUT_S,
                        deadline.remaining() - fx.SERVE_TAIL_S,
                    ),
                    extra,
                )
        else:
            skipped.append(f"serve {serve_label} (time budget)")
    elif serve_label is None:
        skipped.append("serve (no EXL3 conversion ran)")

    summary, checks = judge(runs, checkpoints, reference_of)
    if serve is not None:
        ok = "text" in serve and bool(serve["text"].strip())
        fx.check(
            checks, f"serve {serve_label}: completions answered", float(ok), 1.0, ok
        )
        if ok:
            serve["offline_text"] = runs[serve_label]["default"]["offline_text"]
            serve["matches_offline"] = serve["text"] == serve["offline_text"]
    notes = {lb: c.notes for lb, c in checkpoints.items() if c.notes}
    return {
        "summary": summary,
        "serve": serve,
        "checks": checks,
        "skipped": skipped,
        "errors": errors,
        "notes": notes,
        "runs": runs,
    }


def judge(
    runs: dict[str, dict],
    checkpoints: dict[str, Checkpoint],
    reference_of: dict[str, str],
) -> tuple[dict, list]:
    checks: list[dict] = []
    summary: dict[str, dict] = {}
    for name, modes in runs.items():
        ckpt, d = checkpoints[name], modes["default"]
        s: dict = {"ppl": d["ppl"], "scored": d["scored"]}
        if ckpt.recorded is not None:
            rec = ckpt.recorded
            s.update(
                exllamav3_ppl=rec["ppl"],
                rel=fx.relative_difference(d["ppl"], rec["ppl"]),
                expected_scored=rec["scored_tokens"],
            )
            if ckpt.exl3:
                fx.check(
                    checks,
                    f"{name}: ppl vs ExLlamaV3",
                    s["rel"],
                    fx.PPL_TOLERANCE,
                    abs(s["rel"]) <= fx.PPL_TOLERANCE,
                )
            fx.check(
                checks,
                f"{name}: scored tokens",
                d["scored"],
                rec["scored_tokens"],
                d["scored"] == rec["scored_tokens"],
            )
        elif ckpt.exl3:
            fx.check(checks, f"{name}: ExLlamaV3 record present", 0.0, 1.0, False)
        if "eager" in modes:
            s["eager_vs_default"] = fx.eager_agreement(d, modes["eager"])
        summary[name] = s
    for name, ref_name in reference_of.items():
        mine = summary.get(name, {}).get("eager_vs_default")
        ref = summary.get(ref_name, {}).get("eager_vs_default")
        if mine is None or ref is None:
            continue
        for kind in ("prompt", "decode"):
            limit = max(fx.AGREEMENT_FACTOR * ref[kind]["mean_abs"], fx.AGREEMENT_FLOOR)
            fx.check(
                checks,
                f"{name}: eager vs default mean |dlogprob| ({kind}) vs "
                f"{ref_name.split('/')[1]}'s",
                mine[kind]["mean_abs"],
                limit,
                mine[kind]["mean_abs"] <= limit,
            )
    return summary, checks


def print_table(result: dict) -> None:
    fx.print_table(result)
    for name, notes in result.get("notes", {}).items():
        for n in notes:
            print(f"  NOTE {name}: {n}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--moe-dir",
        type=Path,
        required=True,
        help="the staged MoE conversions (scripts/e2e/stage_fixtures.sh DEST)",
    )
    ap.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, in run order (default {','.join(MODELS)})",
    )
    ap.add_argument(
        "--reference",
        choices=("auto", "none"),
        default="auto",
        help="auto: each model's bf16 original when staged, else its dequantized "
        "twin; none: EXL3 runs only (eager agreement reported, not judged)",
    )
    ap.add_argument(
        "--no-eager",
        dest="eager",
        action="store_false",
        help="skip the enforce_eager runs",
    )
    ap.add_argument(
        "--serve",
        default="auto",
        help="MODEL/CHECKPOINT for the `vllm serve` check, 'auto' (the first EXL3 "
        "conversion run) or 'none'",
    )
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="vLLM attention backend for every engine (default: vLLM's choice)",
    )
    fx.add_out_argument(ap)
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/vx/e2e-moe"),
        help="scratch: working copies, dequantized twins, server logs",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450,
        help="skip remaining stages that would not finish within this many seconds",
    )
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        ap.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    known = {label(m, c) for m in args.models for c in MODELS[m].conversions}
    if args.serve not in ("auto", "none") and args.serve not in known:
        ap.error(
            f"--serve {args.serve}: not an EXL3 conversion of --models "
            f"({', '.join(sorted(known))})"
        )
    if not args.moe_dir.is_dir():
        ap.error(f"--moe-dir {args.moe_dir}: not a directory")
    return args


def result_name(models: list[str]) -> str:
    if set(models) == set(MODELS):
        return "moe_e2e.json"
    return "moe_e2e_" + "+".join(models) + ".json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for k, v in fx.HOST_ENV.items():
        os.environ.setdefault(k, v)
    deadline = fx.Deadline(args.budget_s)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    staged = verify_staged(args.moe_dir)
    env = fx.environment()
    fx.log(f"environment: {env}; staged files verified: {staged}")
    windows = fx.validation_windows()
    result = run(args, windows, deadline)
    result = {
        "environment": env,
        "seconds": round(time.monotonic() - t0, 1),
        "staged": staged,
        "settings": {
            "gpu_memory_utilization": fx.GPU_MEMORY_UTILIZATION,
            "max_model_len": fx.MAX_MODEL_LEN,
            "probe_windows": fx.PROBE_WINDOWS,
            "greedy": fx.greedy_settings(),
            "attention_backend": args.attention_backend,
            "host_env": fx.HOST_ENV,
        },
        **result,
    }
    name = result_name(args.models)
    text = json.dumps(result, indent=1)
    (args.out / name).write_text(text)
    (args.work / name).write_text(text)
    print_table(result)
    fx.log(f"wrote {args.out / name} ({result['seconds']} s)")
    return 0 if fx.all_passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
