# SPDX-License-Identifier: Apache-2.0
"""The GPU e2e scripts on the CPU: they import and parse arguments, tokenize the fixture text into
the recorded windows, and turn (faked) engine runs into the right pass/fail checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "scripts" / "e2e"
sys.path.insert(0, str(E2E))

import run_fixture_e2e as fx  # noqa: E402


@pytest.mark.parametrize("script", ["run_fixture_e2e.py", "throughput.py"])
def test_help(script):
    r = subprocess.run([sys.executable, str(E2E / script), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_unknown_checkpoint_is_refused():
    r = subprocess.run([sys.executable, str(E2E / "run_fixture_e2e.py"), "--checkpoints",
                        "exl3-9bpw"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown checkpoints ['exl3-9bpw']" in r.stderr


def test_validation_windows_match_the_recorded_runs():
    windows = fx.validation_windows()
    recorded = fx.recorded_perplexities()
    assert len(windows) == 360
    assert sum(len(w) - 1 for w in windows) == recorded["exl3-4.0bpw"]["scored_tokens"]


def test_assembled_checkpoint_is_complete(tmp_path):
    d = fx.assemble_checkpoint("exl3-4.0bpw", tmp_path)
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "quantization_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names


def _fake_run(ppl: float, jitter: float, tokens: list[list[int]]) -> dict:
    return {"ppl": ppl, "mean_nll": 1.0, "scored": 183960, "windows": 360,
            "probe_logprobs": [[-1.0 - jitter, -2.0], [-0.5]],
            "greedy_tokens": tokens, "greedy_logprobs": [[-0.1 - jitter] * len(t) for t in tokens],
            "offline_text": "    return n\n"}


def _run_tp1(monkeypatch, tmp_path, ppl: dict[str, float], jitter: dict[str, float]) -> dict:
    """run_tp1 with engines faked: eager runs differ from default ones by `jitter` nats."""
    tokens = [[1, 2, 3], [4, 5, 6]]

    def run_mode(name, model_dir, windows, *, eager, tp, full_ppl):
        return _fake_run(ppl[name], jitter[name] if eager else 0.0, tokens)

    monkeypatch.setattr(fx, "run_mode", run_mode)
    monkeypatch.setattr(fx, "serve_once", lambda name, d, tp, work, ready_timeout: {
        "checkpoint": name, "text": "    return n\n"})
    args = fx.argparse.Namespace(checkpoints=list(fx.CHECKPOINTS), eager_for={"exl3-4.0bpw",
                                 "bf16"}, serve="exl3-4.0bpw", work=tmp_path, out=tmp_path)
    return fx.run_tp1(args, windows=[], deadline=fx.Deadline(3600))


RECORDED = {"exl3-4.0bpw": 6.5846706, "exl3-3.0bpw-mcg": 7.0023777, "bf16": 6.4648718}


def test_checks_pass_when_within_limits(monkeypatch, tmp_path):
    ppl = {k: v * 1.001 for k, v in RECORDED.items()}
    out = _run_tp1(monkeypatch, tmp_path, ppl, {"exl3-4.0bpw": 1e-3, "bf16": 1e-3,
                                                "exl3-3.0bpw-mcg": 0.0})
    assert out["checks"] and all(c["pass"] for c in out["checks"]), out["checks"]
    assert out["serve"]["matches_offline"] is True
    assert not out["errors"] and not out["skipped"]
    progress = fx.json.loads((tmp_path / "fixture_e2e.progress.json").read_text())
    assert set(progress["runs"]) == set(fx.CHECKPOINTS)  # saved as the stages went


def test_checks_fail_on_perplexity_and_eager_disagreement(monkeypatch, tmp_path):
    ppl = dict(RECORDED, **{"exl3-3.0bpw-mcg": RECORDED["exl3-3.0bpw-mcg"] * 1.004})
    out = _run_tp1(monkeypatch, tmp_path, ppl, {"exl3-4.0bpw": 0.05, "bf16": 1e-3,
                                                "exl3-3.0bpw-mcg": 0.0})
    failed = {c["check"] for c in out["checks"] if not c["pass"]}
    assert failed == {
        "exl3-3.0bpw-mcg: ppl vs ExLlamaV3",
        "exl3-4.0bpw: eager vs default mean |dlogprob| (prompt) vs bf16's",
        "exl3-4.0bpw: eager vs default mean |dlogprob| (decode) vs bf16's",
    }


def test_a_failing_stage_is_recorded_and_the_rest_runs(monkeypatch, tmp_path):
    def run_mode(name, model_dir, windows, *, eager, tp, full_ppl):
        if name == "exl3-3.0bpw-mcg":
            raise RuntimeError("engine core initialization failed")
        return _fake_run(RECORDED[name], 0.0, [[1, 2]])

    monkeypatch.setattr(fx, "run_mode", run_mode)
    monkeypatch.setattr(fx, "serve_once", lambda *a: {"checkpoint": "exl3-4.0bpw", "text": "x"})
    args = fx.argparse.Namespace(checkpoints=list(fx.CHECKPOINTS), eager_for=set(),
                                 serve="exl3-4.0bpw", work=tmp_path)
    out = fx.run_tp1(args, windows=[], deadline=fx.Deadline(3600))
    assert list(out["errors"]) == ["exl3-3.0bpw-mcg default"]
    assert "engine core initialization failed" in out["errors"]["exl3-3.0bpw-mcg default"]
    assert set(out["summary"]) == {"exl3-4.0bpw", "bf16"}


def test_tp2_checks(monkeypatch, tmp_path):
    same, other = [[1, 2, 3, 4]] * 4, [[1, 2, 3, 4]] * 2 + [[1, 9, 9, 9]] * 2

    def run_mode(name, model_dir, windows, *, eager, tp, full_ppl):
        ppl = RECORDED[name] * (1.002 if (tp == 2 and name == "exl3-4.0bpw") else 1.0)
        toks = other if (tp == 2 and name == "exl3-3.0bpw-mcg") else same
        return _fake_run(ppl, 0.0, toks)

    monkeypatch.setattr(fx, "run_mode", run_mode)
    args = fx.argparse.Namespace(checkpoints=list(fx.CHECKPOINTS), tp=2, baseline=None,
                                 work=tmp_path)
    out = fx.run_tp2(args, windows=[], deadline=fx.Deadline(3600))
    failed = {c["check"] for c in out["checks"] if not c["pass"]}
    assert failed == {"exl3-4.0bpw: ppl tp2 vs tp1",
                      "exl3-3.0bpw-mcg: greedy tp2 vs tp1 matched fraction vs bf16's"}


def test_time_budget_skips_stages(monkeypatch, tmp_path):
    monkeypatch.setattr(fx, "run_mode", lambda *a, **k: pytest.fail("should not run"))
    args = fx.argparse.Namespace(checkpoints=["bf16"], eager_for={"bf16"}, serve="none",
                                 work=tmp_path)
    out = fx.run_tp1(args, windows=[], deadline=fx.Deadline(10))
    assert out["skipped"] == ["bf16 default (time budget)"]


def test_throughput_checkpoint_written_once_and_bf16_twin(tmp_path, monkeypatch):
    import throughput as th

    monkeypatch.setattr(th, "PRESET", "qwen3-tiny")  # the 8B preset's 5.7 GB is for the host
    target = th.checkpoint_dir(tmp_path, 2, 4.0, "mcg")
    # A writer that died half-way leaves target.partial with its pid: rewritten, not waited on.
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (partial / "writer.pid").write_text(str(dead.pid))
    got = th.ensure_checkpoint(target, 2, 4.0, "mcg")
    assert got == target and not partial.exists()
    cfg = th.json.loads((target / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["quantization_config"]["quant_method"] == "exl3"
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert th.ensure_checkpoint(target, 2, 4.0, "mcg") == target  # reused as it is
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    twin = th.bf16_dir(target, tmp_path)
    twin_cfg = th.json.loads((twin / "config.json").read_text())
    assert "quantization_config" not in twin_cfg
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == twin_cfg


def test_throughput_repeats_each_concurrency_in_one_engine(monkeypatch):
    import throughput as th

    engines, batches = [], []

    def fake_measure(llm, batch, output_len):
        batches.append((llm, len(batch), output_len))
        return {"concurrency": len(batch), "output_tok_s": 1.0, "tpot_ms": 1.0, "ttft_ms": 1.0}

    monkeypatch.setattr(th, "make_llm", lambda *a, **k: engines.append(object()) or engines[-1])
    monkeypatch.setattr(th, "free_llm", lambda llm: None)
    monkeypatch.setattr(th, "measure", fake_measure)
    args = th.argparse.Namespace(input_len=8, output_len=4, concurrency=[1, 4], repeat=3)
    out = th.run_model("exl3", Path("unused"), dummy=False, args=args, vocab=100)
    assert len(engines) == 1
    # The warm-up request, then each concurrency three times in a row, all in that engine.
    assert batches == [(engines[0], 1, th.WARMUP_TOKENS)] + [(engines[0], c, 4)
                                                          for c in (1, 4) for _ in range(3)]
    assert [(r["concurrency"], r["repeat"]) for r in out["runs"]] == [
        (c, rep) for c in (1, 4) for rep in range(3)]


def test_throughput_refuses_a_repeat_below_one():
    r = subprocess.run([sys.executable, str(E2E / "throughput.py"), "--repeat", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--repeat must be at least 1" in r.stderr
