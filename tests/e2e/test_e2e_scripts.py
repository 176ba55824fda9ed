# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fixture end-to-end pieces of scripts/e2e/ on the CPU: the perplexity windows
(against a logprob source shaped like vLLM's prompt logprobs, with the expected
perplexity computed independently here), the agreement measures, and the runner that
stages the fixtures, checks the recorded windows and turns (faked) engine runs into the
right pass/fail checks.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_exl3.e2e import run_fixture_e2e as fx
from vllm_exl3.e2e import throughput as th
from vllm_exl3.e2e.measures import (
    TIE_NATS,
    WINDOW,
    common_prefix,
    continuation_agreement,
    decode_logprob_agreement,
    divergence_gaps,
    logprob_agreement,
    next_token_logprobs,
    perplexity,
    relative_difference,
    split_windows,
    tie_verdict,
    top_logprobs,
)
from vllm_exl3.repo import ROOT as REPO
from vllm_exl3.testing.synthetic_checkpoint import load_config

E2E = REPO / "scripts" / "e2e"


# Each script's flags that its --help must list, run as a file and as a module.
HELP_FLAGS = {
    "run_fixture_e2e": ("--checkpoints", "--budget-s"),
    "throughput": ("--preset", "--models"),
    "serve_bench": ("--soak", "--resume", "--exl3-state"),
    "exllamav3_serve": ("--exl3-state", "--concurrency"),
}


@pytest.mark.parametrize("form", ["script", "module"])
@pytest.mark.parametrize("name", sorted(HELP_FLAGS))
def test_help(name, form):
    how = (
        [str(E2E / f"{name}.py")]
        if form == "script"
        else ["-m", f"vllm_exl3.e2e.{name}"]
    )
    r = subprocess.run(
        [sys.executable, *how, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    assert all(flag in r.stdout for flag in HELP_FLAGS[name]), r.stdout


def test_unknown_checkpoint_is_refused():
    r = subprocess.run(
        [sys.executable, str(E2E / "run_fixture_e2e.py"), "--checkpoints", "exl3-9bpw"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unknown checkpoints ['exl3-9bpw']" in r.stderr


def test_validation_windows_match_the_recorded_runs():
    windows = fx.validation_windows()
    recorded = fx.recorded_perplexities()
    assert len(windows) == 360
    assert sum(len(w) - 1 for w in windows) == recorded["exl3-4.0bpw"]["scored_tokens"]


def test_the_quantized_embedding_conversion_is_judged_against_its_record(tmp_path):
    recorded = fx.recorded_perplexities()
    assert "exl3-4.0bpw-embed4" in fx.EXL3
    assert recorded["exl3-4.0bpw-embed4"]["ppl"] == pytest.approx(6.6176, abs=1e-4)
    assert (
        recorded["exl3-4.0bpw-embed4"]["scored_tokens"]
        == recorded["exl3-4.0bpw"]["scored_tokens"]
    )
    d = fx.assemble_checkpoint("exl3-4.0bpw-embed4", tmp_path)
    assert (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()


def test_assembled_checkpoint_is_complete(tmp_path):
    d = fx.assemble_checkpoint("exl3-4.0bpw", tmp_path)
    names = {p.name for p in d.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "quantization_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names


def _fake_run(ppl: float, jitter: float, tokens: list[list[int]]) -> dict:
    return {
        "ppl": ppl,
        "mean_nll": 1.0,
        "scored": 183960,
        "windows": 360,
        "probe_logprobs": [[-1.0 - jitter, -2.0], [-0.5]],
        "greedy_tokens": tokens,
        "greedy_logprobs": [[-0.1 - jitter] * len(t) for t in tokens],
        "offline_text": "    return n\n",
    }


def _run_tp1(
    monkeypatch, tmp_path, ppl: dict[str, float], jitter: dict[str, float]
) -> dict:
    """run_tp1 with engines faked: eager runs differ from default ones by `jitter`
    nats.
    """
    tokens = [[1, 2, 3], [4, 5, 6]]

    def run_mode(name, model_dir, windows, *, eager, tp, full_ppl):
        return _fake_run(ppl[name], jitter[name] if eager else 0.0, tokens)

    monkeypatch.setattr(fx, "run_mode", run_mode)
    monkeypatch.setattr(
        fx,
        "serve_once",
        lambda name, d, tp, work, ready_timeout: {
            "checkpoint": name,
            "text": "    return n\n",
        },
    )
    args = fx.argparse.Namespace(
        checkpoints=list(fx.CHECKPOINTS),
        eager_for={"exl3-4.0bpw", "bf16"},
        serve="exl3-4.0bpw",
        work=tmp_path,
        out=tmp_path,
    )
    return fx.run_tp1(args, windows=[], deadline=fx.Deadline(3600))


RECORDED = {"exl3-4.0bpw": 6.5846706, "exl3-3.0bpw-mcg": 7.0023777, "bf16": 6.4648718}


def test_checks_pass_when_within_limits(monkeypatch, tmp_path):
    ppl = {k: v * 1.001 for k, v in RECORDED.items()}
    out = _run_tp1(
        monkeypatch,
        tmp_path,
        ppl,
        {"exl3-4.0bpw": 1e-3, "bf16": 1e-3, "exl3-3.0bpw-mcg": 0.0},
    )
    assert out["checks"] and all(c["pass"] for c in out["checks"]), out["checks"]
    assert out["serve"]["matches_offline"] is True
    assert not out["errors"] and not out["skipped"]
    progress = fx.json.loads((tmp_path / "fixture_e2e.progress.json").read_text())
    assert set(progress["runs"]) == set(fx.CHECKPOINTS)  # saved as the stages went


def test_checks_fail_on_perplexity_and_eager_disagreement(monkeypatch, tmp_path):
    ppl = dict(RECORDED, **{"exl3-3.0bpw-mcg": RECORDED["exl3-3.0bpw-mcg"] * 1.004})
    out = _run_tp1(
        monkeypatch,
        tmp_path,
        ppl,
        {"exl3-4.0bpw": 0.05, "bf16": 1e-3, "exl3-3.0bpw-mcg": 0.0},
    )
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
    monkeypatch.setattr(
        fx, "serve_once", lambda *a: {"checkpoint": "exl3-4.0bpw", "text": "x"}
    )
    args = fx.argparse.Namespace(
        checkpoints=list(fx.CHECKPOINTS),
        eager_for=set(),
        serve="exl3-4.0bpw",
        work=tmp_path,
    )
    out = fx.run_tp1(args, windows=[], deadline=fx.Deadline(3600))
    assert list(out["errors"]) == ["exl3-3.0bpw-mcg default"]
    assert (
        "engine core initialization failed" in out["errors"]["exl3-3.0bpw-mcg default"]
    )
    assert set(out["summary"]) == {"exl3-4.0bpw", "bf16"}


def test_tp2_checks(monkeypatch, tmp_path):
    same, other = [[1, 2, 3, 4]] * 4, [[1, 2, 3, 4]] * 2 + [[1, 9, 9, 9]] * 2

    def run_mode(name, model_dir, windows, *, eager, tp, full_ppl):
        ppl = RECORDED[name] * (1.002 if (tp == 2 and name == "exl3-4.0bpw") else 1.0)
        toks = other if (tp == 2 and name == "exl3-3.0bpw-mcg") else same
        return _fake_run(ppl, 0.0, toks)

    monkeypatch.setattr(fx, "run_mode", run_mode)
    args = fx.argparse.Namespace(
        checkpoints=list(fx.CHECKPOINTS), tp=2, baseline=None, work=tmp_path
    )
    out = fx.run_tp2(args, windows=[], deadline=fx.Deadline(3600))
    failed = {c["check"] for c in out["checks"] if not c["pass"]}
    assert failed == {
        "exl3-4.0bpw: ppl tp2 vs tp1",
        "exl3-3.0bpw-mcg: greedy tp2 vs tp1 matched fraction vs bf16's",
    }


def test_time_budget_skips_stages(monkeypatch, tmp_path):
    monkeypatch.setattr(fx, "run_mode", lambda *a, **k: pytest.fail("should not run"))
    args = fx.argparse.Namespace(
        checkpoints=["bf16"], eager_for={"bf16"}, serve="none", work=tmp_path
    )
    out = fx.run_tp1(args, windows=[], deadline=fx.Deadline(10))
    assert out["skipped"] == ["bf16 default (time budget)"]


def test_throughput_checkpoint_written_once_and_bf16_twin(tmp_path, monkeypatch):
    # qwen3-tiny: the 8B preset's 5.7 GB is for the host.
    target = th.checkpoint_dir(tmp_path, "qwen3-tiny", 2, 4.0, "mcg")
    # A writer that died half-way leaves target.partial with its pid: rewritten, not
    # waited on.
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (partial / "writer.pid").write_text(str(dead.pid))
    got = th.ensure_checkpoint(target, "qwen3-tiny", 2, 4.0, "mcg")
    assert got == target and not partial.exists()
    cfg = th.json.loads((target / "config.json").read_text())
    assert (
        cfg["num_hidden_layers"] == 2
        and cfg["quantization_config"]["quant_method"] == "exl3"
    )
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert th.ensure_checkpoint(target, "qwen3-tiny", 2, 4.0, "mcg") == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    twin = th.bf16_dir(target, tmp_path)
    twin_cfg = th.json.loads((twin / "config.json").read_text())
    assert "quantization_config" not in twin_cfg
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == twin_cfg
    gptq = th.json.loads((th.gptq_dir(target, tmp_path) / "config.json").read_text())
    q = gptq.pop("quantization_config")
    assert gptq == twin_cfg
    assert (q["quant_method"], q["bits"], q["group_size"]) == ("gptq", 4, 128)
    # Dense: attention and MLP linears listed (dummy weights give vLLM no other way).
    assert set(q["modules_in_block_to_quantize"][0]) == set(
        th.GPTQ_ATTENTION + th.GPTQ_DENSE_MLP
    )


def test_throughput_writes_the_checkpoint_in_a_child_process(tmp_path):
    # vLLM forks its engine from the process that asked for the checkpoint; forked after
    # torch's worker threads had run (the writer's tensor ops), the engine hung. So the
    # writer runs elsewhere: that process has not even imported torch afterwards.
    code = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        from vllm_exl3.e2e import throughput as th
        target = th.checkpoint_dir(Path({str(tmp_path)!r}), "qwen3-tiny", 2, 4.0, "mcg")
        th.ensure_checkpoint(target, "qwen3-tiny", 2, 4.0, "mcg")
        cfg = json.loads((target / "config.json").read_text())
        print(json.dumps([cfg["num_hidden_layers"], "torch" in sys.modules]))
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert th.json.loads(r.stdout.strip().splitlines()[-1]) == [2, False]


def test_throughput_waits_while_the_writer_child_lives(tmp_path, monkeypatch):
    # writer.pid lists the writing process and its child: a dead parent with a live
    # child is still at work (waited on, not rewritten over).
    target = th.checkpoint_dir(tmp_path, "qwen3-tiny", 2, 4.0, "mcg")
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import pathlib, sys, time; time.sleep(1); "
            "pathlib.Path(sys.argv[1]).mkdir(); "
            "(pathlib.Path(sys.argv[1]) / 'mark').write_text('child')",
            str(target),
        ]
    )
    (partial / "writer.pid").write_text(f"{dead.pid} {child.pid}")
    monkeypatch.setattr(th, "WRITER_POLL_S", 0.1)
    monkeypatch.setattr(
        th, "writer_command", lambda *a: pytest.fail("rewrote a checkpoint in progress")
    )
    assert th.ensure_checkpoint(target, "qwen3-tiny", 2, 4.0, "mcg") == target
    child.wait()
    assert (target / "mark").read_text() == "child"


def test_throughput_writer_failure_is_an_error(tmp_path, monkeypatch):
    target = th.checkpoint_dir(tmp_path, "qwen3-tiny", 2, 4.0, "mcg")
    monkeypatch.setattr(
        th, "writer_command", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    with pytest.raises(RuntimeError, match="checkpoint writer exited with 3"):
        th.ensure_checkpoint(target, "qwen3-tiny", 2, 4.0, "mcg")
    assert not target.exists()


def test_throughput_moe_preset_is_qwen3_30b_a3b():
    cfg = load_config("qwen3-30b-a3b")
    dims = (
        cfg["hidden_size"],
        cfg["moe_intermediate_size"],
        cfg["num_experts"],
        cfg["num_experts_per_tok"],
        cfg["num_hidden_layers"],
    )
    assert dims == (2048, 768, 128, 8, th.PRESETS["qwen3-30b-a3b"])


def test_throughput_repeats_each_concurrency_in_one_engine(monkeypatch):
    engines, batches = [], []

    def fake_measure(llm, batch, output_len):
        batches.append((llm, len(batch), output_len))
        return {
            "concurrency": len(batch),
            "output_tok_s": 1.0,
            "tpot_ms": 1.0,
            "ttft_ms": 1.0,
        }

    monkeypatch.setattr(
        th, "make_llm", lambda *a, **k: engines.append(object()) or engines[-1]
    )
    monkeypatch.setattr(th, "free_llm", lambda llm: None)
    monkeypatch.setattr(th, "measure", fake_measure)
    args = th.argparse.Namespace(
        input_len=8,
        output_len=4,
        concurrency=[1, 4],
        repeat=3,
        gpu_memory_utilization=0.5,
    )
    out = th.run_model("exl3", Path("unused"), dummy=False, args=args, vocab=100)
    assert len(engines) == 1
    # A warm-up pass at every concurrency (each first prefill of its size out of the
    # timings), then each concurrency three times in a row, all in that engine.
    assert batches == [(engines[0], c, th.WARMUP_TOKENS) for c in (1, 4)] + [
        (engines[0], c, 4) for c in (1, 4) for _ in range(3)
    ]
    assert [(r["concurrency"], r["repeat"]) for r in out["runs"]] == [
        (c, rep) for c in (1, 4) for rep in range(3)
    ]


def test_throughput_refuses_a_repeat_below_one():
    r = subprocess.run(
        [sys.executable, str(E2E / "throughput.py"), "--repeat", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--repeat must be at least 1" in r.stderr


# The perplexity arithmetic of the GPU e2e record (scripts/e2e/measures.py), fed by a
# fake logprob source shaped like vLLM's prompt logprobs: a known next-token
# distribution per position, so the expected perplexity is computed independently here.


FIXTURE_TOKENS = 184368  # tests/fixtures/README.md: val.txt's token count
FIXTURE_SCORED = 183960  # ... and the scored tokens of the recorded runs
PEAK = 3.0  # spread of the fake model's logits


@dataclass
class FakeLogprob:  # vLLM's Logprob: the value is in .logprob
    logprob: float
    rank: int | None = None


class FakeModel:
    """p(next = t | prefix) depends on the previous token only: a fixed random bigram
    table, so the true log-likelihood of a window is a plain sum the test computes on
    its own."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.vocab = vocab
        self.logp = []
        for _ in range(vocab):
            # Peaked rows (like a trained model's): a wrong target is far less likely.
            w = [math.exp(PEAK * rng.gauss(0, 1)) for _ in range(vocab)]
            z = sum(w)
            self.logp.append([math.log(x / z) for x in w])

    def sample(self, rng: random.Random, length: int) -> list[int]:
        ids = [rng.randrange(self.vocab)]
        while len(ids) < length:
            probs = [math.exp(x) for x in self.logp[ids[-1]]]
            ids.append(rng.choices(range(self.vocab), weights=probs)[0])
        return ids

    def prompt_logprobs(self, window: list[int], top: int = 0) -> list:
        """As vLLM returns them: None at position 0, then {token: Logprob} holding the
        actual token and the `top` most likely ones."""
        out: list = [None]
        for pos in range(1, len(window)):
            row = self.logp[window[pos - 1]]
            ranked = sorted(range(self.vocab), key=lambda t: -row[t])
            entry = {t: FakeLogprob(row[t], i + 1) for i, t in enumerate(ranked[:top])}
            entry[window[pos]] = FakeLogprob(row[window[pos]])
            out.append(entry)
        return out


def test_fixture_window_count_matches_the_recorded_runs():
    windows = split_windows(list(range(FIXTURE_TOKENS)))
    assert len(windows) == 360
    assert all(len(w) == WINDOW for w in windows)
    assert sum(len(w) - 1 for w in windows) == FIXTURE_SCORED
    # Non-overlapping and in order: window i starts at token i * WINDOW; the tail is
    # dropped.
    assert [w[0] for w in windows[:3]] == [0, 512, 1024]
    assert windows[-1][-1] == 360 * 512 - 1


def test_split_rejects_too_short_text_and_windows():
    with pytest.raises(ValueError, match="do not fill"):
        split_windows([1, 2, 3], window=4)
    with pytest.raises(ValueError, match="context token"):
        split_windows([1, 2, 3], window=1)


@pytest.mark.parametrize("top", [0, 1, 5])
def test_perplexity_from_fake_prompt_logprobs(top):
    vocab, model = 23, FakeModel(23)
    rng = random.Random(1)
    ids = [rng.randrange(vocab) for _ in range(5 * 40 + 17)]
    windows = split_windows(ids, window=40)
    got = perplexity(
        next_token_logprobs(w, model.prompt_logprobs(w, top)) for w in windows
    )
    # Independent computation: the bigram log-likelihood, first token of each window
    # unscored.
    nll = -sum(model.logp[w[i - 1]][w[i]] for w in windows for i in range(1, len(w)))
    assert got.scored == 5 * 39 and got.windows == 5
    assert got.nll_sum == pytest.approx(nll, rel=1e-12)
    assert got.ppl == pytest.approx(math.exp(nll / (5 * 39)), rel=1e-12)


def test_off_by_one_target_changes_the_answer():
    """Scoring the token at p with the distribution for p+1 (a classic slip) is
    detected."""
    vocab, model = 23, FakeModel(23, seed=3)
    w = model.sample(random.Random(2), 64)
    right = perplexity(
        [next_token_logprobs(w, model.prompt_logprobs(w, top=vocab))]
    ).ppl
    shifted = model.prompt_logprobs(w, top=vocab)
    shifted = [None] + shifted[2:] + [shifted[-1]]
    wrong = perplexity([next_token_logprobs(w, shifted)]).ppl
    assert relative_difference(wrong, right) > 0.5


def test_missing_or_bad_logprobs_are_errors():
    w = [3, 4, 5]
    with pytest.raises(ValueError, match="3 prompt logprob positions"):
        next_token_logprobs(w + [6], [None, {4: -1.0}, {5: -1.0}])
    with pytest.raises(
        ValueError, match="position 2: no logprob for the actual token 5"
    ):
        next_token_logprobs(w, [None, {4: -1.0}, {6: -1.0}])
    with pytest.raises(ValueError, match="position 1: no logprob"):
        next_token_logprobs(w, [None, None, {5: -1.0}])
    with pytest.raises(ValueError, match="is nan"):
        next_token_logprobs(w, [None, {4: float("nan")}, {5: -1.0}])
    with pytest.raises(ValueError, match="no scored tokens"):
        perplexity([])


def test_relative_difference():
    assert relative_difference(6.5847 * 1.003, 6.5847) == pytest.approx(0.003)
    assert relative_difference(6.5, 6.5) == 0.0


# Agreement measures of the GPU e2e record (scripts/e2e/agreement.py).


def test_logprob_agreement_max_and_mean():
    a = [[-1.0, -2.0], [-0.5]]
    b = [[-1.1, -2.0], [-0.2]]
    got = logprob_agreement(a, b)
    assert got["positions"] == 3
    assert got["max_abs"] == pytest.approx(0.3)
    assert got["mean_abs"] == pytest.approx(0.4 / 3)


def test_logprob_agreement_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="2 vs 1 sequences"):
        logprob_agreement([[0.0], [0.0]], [[0.0]])
    with pytest.raises(ValueError, match="sequence 0: 2 vs 1 positions"):
        logprob_agreement([[0.0, 1.0]], [[0.0]])
    with pytest.raises(ValueError, match="no positions"):
        logprob_agreement([[]], [[]])


def test_decode_agreement_stops_at_the_first_divergence():
    # Tokens agree for 2 positions; after that the logprobs condition on different text
    # and their (large) difference must not count.
    got = decode_logprob_agreement(
        [[5, 6, 7, 8]],
        [[-0.1, -0.2, -0.3, -0.4]],
        [[5, 6, 9, 8]],
        [[-0.1, -0.25, -5.0, -9.0]],
    )
    assert got["positions"] == 2
    assert got["max_abs"] == pytest.approx(0.05)


def test_continuation_agreement():
    a = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 9]]
    b = [[1, 2, 3, 4], [1, 2, 0, 4], [8, 9]]
    got = continuation_agreement(a, b)
    assert got["identical"] == 1 and got["count"] == 3
    assert got["first_divergence"] == [None, 2, 0]
    assert got["matched_fraction"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    with pytest.raises(ValueError):
        continuation_agreement([], [])


@dataclass
class _Logprob:
    logprob: float


def test_speculation_may_leave_plain_greedy_only_at_a_near_tie():
    # vLLM's per-position dicts, in no order, become [token, logprob] pairs best first.
    top = top_logprobs([{7: _Logprob(-2.0), 3: _Logprob(-0.1)}, {5: _Logprob(-0.3)}])
    assert top == [[[3, -0.1], [7, -2.0]], [[5, -0.3]]]
    plain = [[1, 2, 3], [1, 2, 3], [4, 5, 6]]
    kept = [
        [[[1, -0.1], [8, -3.0]], [[2, -0.6], [9, -0.8]], [[3, -0.1], [0, -4.0]]],
        [[[1, -0.1], [8, -3.0]], [[2, -0.1], [9, -2.1]], [[3, -0.1], [0, -4.0]]],
        [[[4, -0.1], [8, -3.0]], [[5, -0.1], [9, -2.1]], [[6, -0.1], [0, -4.0]]],
    ]
    # The first diverges where plain's top two were 0.2 nats apart, the second where
    # they were 2 apart, the third not at all.
    gaps = divergence_gaps(plain, kept, [[1, 9, 9], [1, 9, 9], [4, 5, 6]])
    assert gaps == [pytest.approx(0.2), pytest.approx(2.0)]
    assert tie_verdict(gaps[:1])["pass"] and not tie_verdict(gaps)["pass"]
    assert tie_verdict(gaps)["widest_gap"] == pytest.approx(2.0)
    assert 0.2 < TIE_NATS < 2.0
    # A speculative token plain did not even rank second is no tie.
    assert divergence_gaps(plain[:1], kept[:1], [[1, 7, 7]]) == [None]
    assert tie_verdict([None])["widest_gap"] == math.inf
    assert tie_verdict([]) == {
        "diverged": 0,
        "gaps": [],
        "widest_gap": 0.0,
        "pass": True,
    }
    with pytest.raises(ValueError, match="one each per request"):
        divergence_gaps(plain, kept[:2], plain)
    with pytest.raises(ValueError, match="top-logprob positions"):
        divergence_gaps(plain[:1], [kept[0][:2]], [[1, 2, 9]])
