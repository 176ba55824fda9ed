#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Qwen3.5 fixtures (tests/fixtures/qwen3_5: dense and MoE in the multimodal
layout, written by ExLlamaV3 1.6.5's converter) end to end through vLLM, on a CUDA host
where the built wheel (or the offline bundle) is installed; see scripts/e2e/README.md.

Per model, against its reference (the conversion dequantized to bf16 by `vllm-exl3
dequantize`: the same weights through vLLM's own bf16 kernels; the bf16 originals are
not kept in the tree):
  - EXL3 with vLLM's defaults (torch.compile + CUDA graphs): perplexity on the
    qwen3-tiny val.txt (that record's method) against ExLlamaV3's recorded value
    (within 0.3 %);
  - EXL3 with enforce_eager=True: agreement with the defaults, judged against the
    reference's own eager-vs-defaults agreement (as the dense record does);
  - an image request through the EXL3 vision tower: the prompt's logprobs after the
    image against the reference's, their mean |difference| within a factor of the same
    measure on the text-only prompt (the tower adds no more disagreement than the
    language model alone);
  - MTP: speculative decoding with the stored MTP layer (`{"method": "mtp"}`, which
    vLLM 0.26 maps to qwen3_5_mtp) against plain decoding, greedy, for EXL3 and the
    reference: EXL3 passes where each speculative continuation leaves the plain one
    only at a near tie of plain's two leading tokens (measures.TIE_NATS); the matched
    fractions, the drafts accepted and output tokens/s of both are reported;
  - `vllm serve` answering with and without `--language-model-only`.
Where flashinfer is not installed (the offline bundle), every engine asks for vLLM's
Triton gated-delta-net prefill (`gdn_prefill_backend`), as run_mtp_e2e.py does.

Prints a compact table; writes qwen3_5_e2e-<stages>.json to --out (default $OUT).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import time
import traceback
from pathlib import Path

from vllm_exl3.e2e import run_fixture_e2e as fx
from vllm_exl3.e2e.measures import (
    TIE_LOGPROBS,
    TIE_NATS,
    continuation_agreement,
    divergence_gaps,
    logprob_agreement,
    relative_difference,
    tie_verdict,
    top_logprobs,
)
from vllm_exl3.testing.fixtures import QWEN3_5

RECORDED = QWEN3_5 / "ppl_exllamav3.json"
KINDS = ("dense", "moe")
CONVERSION = "exl3-4.0bpw"
# Limits: the dense record's (run_fixture_e2e.py).
PPL_TOLERANCE = fx.PPL_TOLERANCE
AGREEMENT_FACTOR = fx.AGREEMENT_FACTOR
AGREEMENT_FLOOR = fx.AGREEMENT_FLOOR
# The image prompt: a chat turn with one image, as the fixture's chat template writes
# it; a 64 x 64 RGB image is 4 x 4 patches of 16 merged 2 x 2: 4 image tokens.
IMAGE_SIDE = 64
IMAGE_TEXT = "describe this image in python:\ndef f(x):\n    return"
MTP_PROMPTS = 16
MTP_TOKENS = 64
SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 1}


def engine_args(images: int = 0) -> dict:
    args: dict = {"limit_mm_per_prompt": {"image": images, "video": 0}}
    if importlib.util.find_spec("flashinfer") is None:
        args["additional_config"] = {"gdn_prefill_backend": "triton"}
    return args


def recorded(kind: str) -> dict:
    runs = {r["label"]: r for r in json.loads(RECORDED.read_text())}
    return runs[f"{kind}-{CONVERSION}"]


def assemble(kind: str, work: Path) -> Path:
    """The conversion and the shared tokenizer files in one directory."""
    out = work / "models" / f"{kind}-{CONVERSION}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for src in (QWEN3_5 / f"{kind}-{CONVERSION}", QWEN3_5 / "tokenizer"):
        for f in src.iterdir():
            shutil.copy2(f, out / f.name)
    return out


def dequantized_twin(src: Path, work: Path) -> Path:
    from vllm_exl3.dequantize import dequantize

    out = work / "models" / f"{src.name}-dequantized"
    shutil.rmtree(out, ignore_errors=True)
    dequantize(src, out, dtype="bfloat16", device="cpu", progress=False)
    return out


def image_prompt() -> dict:
    from PIL import Image

    # A fixed pattern, not noise: the same pixels in every run.
    img = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE))
    img.putdata(
        [
            ((x * 4) % 256, (y * 4) % 256, ((x + y) * 2) % 256)
            for y in range(IMAGE_SIDE)
            for x in range(IMAGE_SIDE)
        ]
    )
    text = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        f"{IMAGE_TEXT}<|im_end|>\n<|im_start|>assistant\n"
    )
    return {"prompt": text, "multi_modal_data": {"image": img}}


def text_prompt() -> dict:
    return {
        "prompt": f"<|im_start|>user\n{IMAGE_TEXT}<|im_end|>\n<|im_start|>assistant\n"
    }


def prompt_logprobs(llm, prompt: dict) -> tuple[list[int], list[float]]:
    """The prompt's token ids and the logprob of each after the first."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = list(out.prompt_token_ids)
    return ids, [
        float(out.prompt_logprobs[p][ids[p]].logprob) for p in range(1, len(ids))
    ]


def after_image(ids: list[int], logprobs: list[float], end_id: int) -> list[float]:
    """The logprobs of the positions after the image's end token (the text the image
    conditions)."""
    cut = ids.index(end_id)  # logprobs[p - 1] scores ids[p]
    return logprobs[cut:]


STAGES = ("ppl", "agreement", "image", "mtp", "serve")


def run_model(kind: str, args, windows, result: dict, save=lambda: None) -> None:
    """The stages of --stages for one model; each engine's failure is recorded and the
    rest still run. After each stage the measurements so far go to
    result["measured"][kind], their verdicts to result["models"][kind], and `save`
    writes both, so a run cut by a time limit keeps the stages it finished, judged."""
    errors = result["errors"]
    stages = set(args.stages)
    measured = result.setdefault("measured", {}).setdefault(kind, {})

    runs: dict = {}
    image: dict = {}
    mtp: dict = {}
    serve: dict = {}

    def stage_done(name: str, value) -> None:
        measured[name] = value
        result["models"][kind] = judge(kind, recorded(kind), runs, image, mtp, serve)
        save()

    exl3 = assemble(kind, args.work)
    twin = None
    # The MTP verdict needs no twin (each divergence is judged by plain's own top
    # tokens): without the agreement and image stages it is only reported, at two
    # engines' cost.
    mtp_twin = getattr(args, "mtp_twin", True)
    if stages & {"agreement", "image"} or ("mtp" in stages and mtp_twin):
        twin = fx.attempt(
            errors, f"{kind}:dequantize", dequantized_twin, exl3, args.work
        )
    plan = []
    if stages & {"ppl", "agreement"}:
        plan.append(("exl3", exl3, False))
    if "agreement" in stages:
        plan += [("exl3", exl3, True), ("twin", twin, False), ("twin", twin, True)]
    for name, path, eager in plan:
        if path is None:
            continue
        mode = "eager" if eager else "default"
        runs[f"{name}-{mode}"] = fx.attempt(
            errors,
            f"{kind}:{name}-{mode}",
            fx.run_mode,
            f"{kind}/{name}",
            path,
            windows,
            eager=eager,
            tp=1,
            full_ppl=(name == "exl3" and not eager and "ppl" in stages),
            engine_args=engine_args(),
        )
    if plan:
        stage_done("runs", runs)
    if "image" in stages:
        for name, path in (("exl3", exl3), ("twin", twin)):
            if path is not None:
                image[name] = fx.attempt(
                    errors, f"{kind}:{name}-image", image_run, path, args
                )
        stage_done("image", image)
    if "mtp" in stages:
        for name, path in (("exl3", exl3), ("twin", twin)):
            if path is not None and (name == "exl3" or mtp_twin):
                mtp[name] = fx.attempt(
                    errors, f"{kind}:{name}-mtp", mtp_run, path, windows
                )
        stage_done("mtp", mtp)
    if "serve" in stages:
        for extra in ((), ("--language-model-only",)):
            tag = "language-model-only" if extra else "multimodal"
            serve[tag] = fx.attempt(
                errors,
                f"{kind}:serve-{tag}",
                fx.serve_once,
                f"{kind}-{tag}",
                exl3,
                1,
                args.work,
                extra_args=(*extra, *serve_args()),
            )
        stage_done("serve", serve)


def serve_args() -> tuple[str, ...]:
    extra = engine_args()
    out = ["--limit-mm-per-prompt", json.dumps(extra["limit_mm_per_prompt"])]
    if "additional_config" in extra:
        out += ["--additional-config", json.dumps(extra["additional_config"])]
    return tuple(out)


def image_run(model_dir: Path, args) -> dict:
    llm = fx.make_llm(model_dir, eager=False, tp=1, engine_args=engine_args(images=1))
    try:
        tok = llm.get_tokenizer()
        end_id = tok.convert_tokens_to_ids("<|vision_end|>")
        ids, lp = prompt_logprobs(llm, image_prompt())
        _, text_lp = prompt_logprobs(llm, text_prompt())
        return {
            "image_tokens": ids.count(tok.convert_tokens_to_ids("<|image_pad|>")),
            "after_image": after_image(ids, lp, end_id),
            "text_only": text_lp,
        }
    finally:
        fx.free_llm(llm)


def mtp_run(model_dir: Path, windows) -> dict:
    from vllm import SamplingParams
    from vllm_exl3.e2e.run_mtp_e2e import spec_metrics

    step = max(1, len(windows) // MTP_PROMPTS)
    batch = [windows[i * step][: fx.PROMPT_TOKENS] for i in range(MTP_PROMPTS)]
    greedy = dict(
        max_tokens=MTP_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False
    )
    params = SamplingParams(**greedy)
    # The untimed first pass of the plain engine keeps each token's nearest rivals, so
    # that the timed passes run as users run them.
    with_top = SamplingParams(**greedy, logprobs=TIE_LOGPROBS)
    out = {}
    for name, spec in (("plain", None), ("mtp", SPECULATIVE)):
        extra = {**engine_args(), "disable_log_stats": False}
        if spec:
            extra["speculative_config"] = dict(spec)
        llm = fx.make_llm(model_dir, eager=False, tp=1, engine_args=extra)
        try:
            # The whole batch once first: speculation's verify steps reach shapes (and
            # Triton autotuning keys) a single prompt does not.
            first = llm.generate(
                [{"prompt_token_ids": p} for p in batch],
                params if spec else with_top,
                use_tqdm=False,
            )
            t0 = time.monotonic()
            res = llm.generate(
                [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False
            )
            seconds = time.monotonic() - t0
            out[name] = {
                "tokens": [list(r.outputs[0].token_ids) for r in res],
                "tokens_per_s": MTP_PROMPTS * MTP_TOKENS / seconds,
                "metrics": spec_metrics(llm),
            }
            if not spec:
                out[name]["tie_tokens"] = [list(r.outputs[0].token_ids) for r in first]
                out[name]["top"] = [top_logprobs(r.outputs[0].logprobs) for r in first]
        finally:
            fx.free_llm(llm)
    return out


def mtp_summary(res: dict) -> dict:
    """Speculative vs plain greedy: the matched fraction (mean share of each
    continuation before its first divergence), plain's top-two gaps where they diverge
    (against the plain pass that kept its top tokens), the drafts, output tokens/s."""
    m = res["mtp"]["metrics"]
    drafts = m.get("spec_decode_num_draft_tokens") or 0
    accepted = m.get("spec_decode_num_accepted_tokens") or 0
    plain = res["plain"]
    ties = (
        tie_verdict(
            divergence_gaps(plain["tie_tokens"], plain["top"], res["mtp"]["tokens"])
        )
        if "top" in plain
        else None
    )
    return {
        "divergences": ties,
        "matched": continuation_agreement(res["plain"]["tokens"], res["mtp"]["tokens"])[
            "matched_fraction"
        ],
        "draft_tokens": drafts,
        "accepted": accepted,
        "acceptance": accepted / drafts if drafts else None,
        "plain_tokens_per_s": res["plain"]["tokens_per_s"],
        "mtp_tokens_per_s": res["mtp"]["tokens_per_s"],
    }


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    return logprob_agreement([a], [b])["mean_abs"]


def within(value: float, reference: float) -> tuple[float, bool]:
    limit = max(AGREEMENT_FACTOR * reference, AGREEMENT_FLOOR)
    return limit, value <= limit


def judge(kind: str, rec: dict, runs: dict, image: dict, mtp, serve: dict) -> dict:
    checks: list[dict] = []
    out: dict = {"checks": checks}
    default = runs.get("exl3-default")
    if default and "ppl" in default:
        rel = relative_difference(default["ppl"], rec["ppl"])
        out.update(ppl=default["ppl"], exllamav3_ppl=rec["ppl"], ppl_rel=rel)
        fx.check(
            checks,
            "ppl vs ExLlamaV3",
            abs(rel),
            PPL_TOLERANCE,
            abs(rel) <= PPL_TOLERANCE,
        )
    agree = {}
    for name in ("exl3", "twin"):
        d, e = runs.get(f"{name}-default"), runs.get(f"{name}-eager")
        if d and e:
            agree[name] = fx.eager_agreement(d, e)
    out["eager_agreement"] = agree
    if len(agree) == 2:
        for part in ("prompt", "decode"):
            value = agree["exl3"][part]["mean_abs"]
            limit, ok = within(value, agree["twin"][part]["mean_abs"])
            fx.check(checks, f"eager vs defaults, {part}", value, limit, ok)
    if image.get("exl3") and image.get("twin"):
        e, t = image["exl3"], image["twin"]
        img = mean_abs_diff(e["after_image"], t["after_image"])
        txt = mean_abs_diff(e["text_only"], t["text_only"])
        limit, ok = within(img, txt)
        out["image"] = {
            "image_tokens": e["image_tokens"],
            "after_image": img,
            "text": txt,
        }
        fx.check(
            checks,
            "image: EXL3 vs dequantized tower",
            img,
            limit,
            ok and e["image_tokens"] > 0,
        )
    summary = {name: mtp_summary(res) for name, res in mtp.items() if res}
    if summary:
        out["mtp"] = summary
    if "exl3" in summary:
        mine = summary["exl3"]
        ties = mine["divergences"]
        fx.check(
            checks,
            "MTP greedy = plain but at near ties",
            math.inf if ties is None else ties["widest_gap"],
            TIE_NATS,
            ties is not None and ties["pass"] and mine["draft_tokens"] > 0,
        )
    for tag, res in serve.items():
        fx.check(
            checks,
            f"serve ({tag})",
            1.0 if res else 0.0,
            1.0,
            bool(res and res.get("text")),
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fx.add_out_argument(ap)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vx/qwen3_5"))
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument(
        "--stages",
        nargs="+",
        choices=STAGES,
        default=list(STAGES),
        help="which checks to run (each model's engines start per stage; all of them "
        "take longer than one 10-minute call: split them, or run in the background)",
    )
    ap.add_argument(
        "--mtp-twin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the mtp stage also runs the dequantized twin (reported beside EXL3; "
        "the verdict does not need it)",
    )
    args = ap.parse_args(argv)
    for key, value in fx.HOST_ENV.items():
        os.environ.setdefault(key, value)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    windows = fx.validation_windows()
    result: dict = {"environment": fx.environment(), "models": {}, "errors": {}}
    path = args.out / f"qwen3_5_e2e-{'-'.join(args.stages)}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1, default=str))

    for kind in args.kinds:
        try:
            run_model(kind, args, windows, result, save)
        except Exception:  # noqa: BLE001 - recorded; the other model still runs
            result["errors"][kind] = traceback.format_exc()
        save()
    ok = not result["errors"]
    for kind, res in result["models"].items():
        for c in res["checks"]:
            ok &= c["pass"]
            verdict = "PASS" if c["pass"] else "FAIL"
            print(
                f"{kind:6} {c['check']:38} {c['value']:.5g} "
                f"(limit {c['limit']:.5g}) {verdict}"
            )
        if "mtp" in res:
            print(f"{kind:6} MTP {json.dumps(res['mtp'])}")
    for stage, tb in result["errors"].items():
        print(f"ERROR {stage}: {tb.strip().splitlines()[-1]}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
