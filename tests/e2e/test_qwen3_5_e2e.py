# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/e2e/run_qwen3_5_e2e.py without a GPU: the checkpoint it assembles from the
fixtures, the engine settings it asks for, and its verdicts on stand-in runs."""

from __future__ import annotations

import json

import pytest
from vllm_exl3.e2e import run_qwen3_5_e2e as q


def test_recorded_perplexities_are_the_fixtures():
    assert q.recorded("dense")["ppl"] == pytest.approx(45.6478, abs=1e-4)
    assert q.recorded("moe")["ppl"] == pytest.approx(49.7618, abs=1e-4)


@pytest.mark.parametrize("kind", q.KINDS)
def test_assembled_checkpoint_is_complete(kind, tmp_path):
    out = q.assemble(kind, tmp_path)
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "quantization_config.json",
        "tokenizer.json",
        "preprocessor_config.json",
    } <= names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "exl3"
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1


def test_engine_settings_ask_for_triton_gdn_without_flashinfer(monkeypatch):
    monkeypatch.setattr(q.importlib.util, "find_spec", lambda name: None)
    args = q.engine_args(images=1)
    assert args["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert args["additional_config"] == {"gdn_prefill_backend": "triton"}
    serve = q.serve_args()
    assert serve[serve.index("--additional-config") + 1] == json.dumps(
        {"gdn_prefill_backend": "triton"}
    )
    monkeypatch.setattr(q.importlib.util, "find_spec", lambda name: object())
    assert "additional_config" not in q.engine_args()


def test_after_image_keeps_the_positions_the_image_conditions():
    ids = [5, 6, 4096, 4098, 4098, 4097, 7, 8, 9]
    logprobs = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]  # for ids[1:]
    # Scores of ids[6:] (after <|vision_end|> = 4097 at position 5).
    assert q.after_image(ids, logprobs, 4097) == [-6.0, -7.0, -8.0]


def _runs(exl3_eager_diff: float, twin_eager_diff: float) -> dict:
    probe = [[-1.0, -2.0, -3.0]]
    tokens = [[1, 2, 3, 4]]
    logprobs = [[-0.5, -0.5, -0.5, -0.5]]

    def run(shift: float, ppl: float | None = None) -> dict:
        out = {
            "probe_logprobs": [[v + shift for v in probe[0]]],
            "greedy_tokens": tokens,
            "greedy_logprobs": [[v + shift for v in logprobs[0]]],
        }
        if ppl is not None:
            out["ppl"] = ppl
        return out

    return {
        "exl3-default": run(0.0, ppl=45.6478 * 1.001),
        "exl3-eager": run(exl3_eager_diff),
        "twin-default": run(0.0),
        "twin-eager": run(twin_eager_diff),
    }


def _image(after: float, text: float, image_tokens: int = 4) -> dict:
    base = {
        "image_tokens": image_tokens,
        "after_image": [-1.0] * 8,
        "text_only": [-2.0] * 8,
    }
    return {
        "exl3": base,
        "twin": {
            "image_tokens": image_tokens,
            "after_image": [-1.0 + after] * 8,
            "text_only": [-2.0 + text] * 8,
        },
    }


def _spec(same: bool, drafts: int = 100, gap: float = 2.0, runner_up: int = 9) -> dict:
    """Speculative and plain runs; where speculation diverges it takes token 9, and
    plain's runner-up at every position is `runner_up`, `gap` nats below its own."""
    plain = [[1, 2, 3, 4]] * 4
    spec = plain if same else [[1, 9, 9, 9]] * 4
    top = [[[[t, -0.5], [runner_up, -0.5 - gap]] for t in seq] for seq in plain]
    return {
        "plain": {
            "tokens": plain,
            "tie_tokens": plain,
            "top": top,
            "tokens_per_s": 100.0,
            "metrics": {},
        },
        "mtp": {
            "tokens": spec,
            "tokens_per_s": 150.0,
            "metrics": {
                "spec_decode_num_draft_tokens": drafts,
                "spec_decode_num_accepted_tokens": drafts // 2,
            },
        },
    }


def _mtp(same: bool, drafts: int = 100, **exl3) -> dict:
    """EXL3's and the twin's speculative-vs-plain runs."""
    return {"exl3": _spec(same, drafts, **exl3), "twin": _spec(True)}


SERVE = {"multimodal": {"text": "x"}, "language-model-only": {"text": "y"}}


def test_every_check_passes_within_its_limits():
    out = q.judge(
        "dense",
        q.recorded("dense"),
        _runs(0.01, 0.01),
        _image(0.01, 0.01),
        _mtp(True),
        SERVE,
    )
    assert [c["check"] for c in out["checks"] if not c["pass"]] == []
    assert len(out["checks"]) == 7
    assert out["mtp"]["exl3"]["acceptance"] == 0.5
    assert out["mtp"]["exl3"]["matched"] == 1.0


def test_each_check_fails_on_its_fault():
    serve = {"multimodal": None, "language-model-only": {"text": "y"}}
    rec = dict(q.recorded("dense"), ppl=40.0)
    out = q.judge("dense", rec, _runs(0.2, 0.01), _image(0.5, 0.01), _mtp(False), serve)
    failed = {c["check"] for c in out["checks"] if not c["pass"]}
    assert failed == {
        "ppl vs ExLlamaV3",
        "eager vs defaults, prompt",
        "eager vs defaults, decode",
        "image: EXL3 vs dequantized tower",
        "MTP greedy = plain but at near ties",
        "serve (multimodal)",
    }


def test_an_image_that_became_no_image_tokens_fails():
    out = q.judge(
        "dense",
        q.recorded("dense"),
        _runs(0, 0),
        _image(0, 0, image_tokens=0),
        {},
        {},
    )
    assert [c["pass"] for c in out["checks"] if c["check"].startswith("image")] == [
        False
    ]


def test_speculation_may_leave_plain_only_at_near_ties():
    # Every continuation diverges after one of four tokens (matched 0.25): a pass where
    # plain's top two were 0.1 nats apart there, a fail at 2 nats, or where the
    # speculative token is not plain's runner-up at all, or with no runner-ups kept.
    def verdict(mtp):
        out = q.judge("moe", q.recorded("moe"), {}, {}, mtp, {})
        return [c["pass"] for c in out["checks"]], out

    tie, out = verdict(_mtp(False, gap=0.1))
    assert tie == [True]
    assert out["mtp"]["exl3"]["matched"] == 0.25
    assert out["mtp"]["exl3"]["divergences"]["diverged"] == 4
    assert out["mtp"]["exl3"]["divergences"]["widest_gap"] == pytest.approx(0.1)
    assert verdict(_mtp(False, gap=2.0))[0] == [False]
    assert verdict(_mtp(False, gap=0.1, runner_up=7))[0] == [False]
    blind = _mtp(False, gap=0.1)
    del blind["exl3"]["plain"]["top"]
    assert verdict(blind)[0] == [False]


def test_speculation_that_drafted_nothing_fails():
    out = q.judge("moe", q.recorded("moe"), {}, {}, _mtp(True, drafts=0), {})
    assert [c["pass"] for c in out["checks"]] == [False]


@pytest.mark.parametrize(
    "stages, engines",
    [
        (["ppl"], ["exl3-default ppl"]),
        (
            ["agreement"],
            ["twin", "exl3-default", "exl3-eager", "twin-default", "twin-eager"],
        ),
        (
            ["image", "mtp", "serve"],
            ["twin", "image", "image", "mtp", "mtp", "serve", "serve"],
        ),
    ],
)
def test_only_the_asked_stages_start_engines(stages, engines, monkeypatch, tmp_path):
    started = []

    def run_mode(name, path, windows, *, eager, tp, full_ppl, engine_args):
        label = f"{name.split('/')[1]}-{'eager' if eager else 'default'}"
        started.append(label + (" ppl" if full_ppl else ""))
        return None

    monkeypatch.setattr(q.fx, "run_mode", run_mode)
    monkeypatch.setattr(
        q, "dequantized_twin", lambda src, work: started.append("twin") or src
    )
    monkeypatch.setattr(q, "image_run", lambda path, args: started.append("image"))
    monkeypatch.setattr(q, "mtp_run", lambda path, windows: started.append("mtp"))
    monkeypatch.setattr(q.fx, "serve_once", lambda *a, **k: started.append("serve"))
    args = q.argparse.Namespace(stages=stages, work=tmp_path)
    result = {"errors": {}, "models": {}}
    q.run_model("dense", args, [], result)
    assert started == engines
    assert not result["errors"]


def test_mtp_without_its_twin_starts_only_exl3(monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(
        q, "dequantized_twin", lambda src, work: started.append("twin") or src
    )
    monkeypatch.setattr(
        q, "mtp_run", lambda path, windows: started.append(path.name) or None
    )
    args = q.argparse.Namespace(stages=["mtp"], work=tmp_path, mtp_twin=False)
    result = {"errors": {}, "models": {}}
    q.run_model("dense", args, [], result)
    assert started == [q.assemble("dense", tmp_path).name]


class _Cut(BaseException):
    """What a time limit does to the run: nothing below catches it."""


def test_a_run_cut_mid_model_keeps_the_stages_it_finished(monkeypatch, tmp_path):
    twin = tmp_path / "twin"
    monkeypatch.setattr(q, "dequantized_twin", lambda src, work: twin)

    def image_run(path, args):
        shift = 0.0 if path == twin else 0.01
        return {
            "image_tokens": 4,
            "after_image": [-1.0 + shift, -2.0],
            "text_only": [-1.0, -2.0 + shift],
        }

    monkeypatch.setattr(q, "image_run", image_run)

    def mtp_run(path, windows):
        raise _Cut

    monkeypatch.setattr(q, "mtp_run", mtp_run)
    saved = []
    result = {"errors": {}, "models": {}}
    args = q.argparse.Namespace(stages=["image", "mtp", "serve"], work=tmp_path)
    with pytest.raises(_Cut):
        q.run_model(
            "dense", args, [], result, lambda: saved.append(q.json.dumps(result))
        )
    assert saved, "nothing was written before the cut"
    last = q.json.loads(saved[-1])
    assert last["measured"]["dense"]["image"]["exl3"]["after_image"] == [-0.99, -2.0]
    assert "mtp" not in last["measured"]["dense"]
    # The finished stage is judged before the cut, not only at the model's end.
    checks = last["models"]["dense"]["checks"]
    assert [(c["check"], c["pass"]) for c in checks] == [
        ("image: EXL3 vs dequantized tower", True)
    ]
