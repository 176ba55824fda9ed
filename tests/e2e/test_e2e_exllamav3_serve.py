# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/e2e/exllamav3_serve.py on the CPU: its arguments, the cache plan (what fits
the GPU's memory), the row's measures from per-request timestamps, the load driven
through a stand-in of ExLlamaV3's Generator, the rows in serve_bench.json and its table,
and serve_bench's `exllamav3` rows run for real in child processes against a stand-in
`exllamav3` package installed the way exllamav3_anchor.py's build leaves it (no GPU, no
ExLlamaV3)."""

from __future__ import annotations

import json
import sys
import textwrap
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm_exl3.bench import exllamav3_anchor
from vllm_exl3.e2e import exllamav3_serve as ex
from vllm_exl3.e2e import serve_bench as sb
from vllm_exl3.testing.synthetic_checkpoint import PRESETS as MODEL_CONFIGS

GB = 10**9


def test_parse_args_defaults_follow_serve_bench():
    a = ex.parse_args(
        ["--model", "m", "--preset", "qwen3-8b", "--concurrency", "16", "--result", "r"]
    )
    assert a.num_prompts == 32 == sb.num_prompts(16)
    assert a.seed == sb.row_seed("qwen3-8b", "exllamav3", 16)
    assert a.gpu_memory_utilization == 0.5 and a.reserve_gib == ex.RESERVE_GIB
    assert a.exl3_state is None and a.model == Path("m")
    b = ex.parse_args(
        [
            *("--model", "m", "--preset", "qwen3-30b-a3b", "--concurrency", "1"),
            *("--result", "r", "--num-prompts", "7", "--seed", "5"),
            *("--gpu-memory-utilization", "0.9", "--exl3-state", "/s"),
        ]
    )
    assert (b.num_prompts, b.seed, b.gpu_memory_utilization) == (7, 5, 0.9)
    assert b.exl3_state == Path("/s")
    assert (
        ex.parse_args(
            ["--model", "m", "--preset", "qwen3-30b-a3b", "--concurrency", "1"]
            + ["--result", "r"]
        ).num_prompts
        == 4
    )  # at least MIN_PROMPTS
    with pytest.raises(SystemExit):
        ex.parse_args(["--model", "m", "--preset", "qwen3-8b", "--result", "r"])
    with pytest.raises(SystemExit):
        ex.parse_args(
            ["--model", "m", "--preset", "qwen3-8b", "--concurrency", "0"]
            + ["--result", "r"]
        )


def test_every_exllamav3_row_has_its_own_seed():
    mine = [sb.row_seed(p, "exllamav3", c) for p in sb.PRESETS for c in sb.CONCURRENCY]
    assert len(set(mine)) == 8
    others = {
        sb.row_seed(p, v, c)
        for p in sb.PRESETS
        for v in sb.VLLM_VARIANTS
        for c in sb.CONCURRENCY
    }
    assert not set(mine) & others


def test_kv_bytes_and_job_tokens():
    # K and V, fp16, per layer: 2 x 36 x 8 x 128 x 2 B (Qwen3-8B), 2 x 48 x 4 x 128 x 2.
    assert ex.kv_bytes_per_token(MODEL_CONFIGS["qwen3-8b"]) == 147456
    assert ex.kv_bytes_per_token(MODEL_CONFIGS["qwen3-30b-a3b"]) == 98304
    no_head_dim = {
        k: v for k, v in MODEL_CONFIGS["qwen3-8b"].items() if k != "head_dim"
    }
    assert ex.kv_bytes_per_token(no_head_dim) == 147456  # 4096 / 32 heads
    # 8192 + 1024 + 1 tokens take 37 pages of 256.
    assert ex.TOKENS_PER_JOB == 37 * 256 == 9472


def _plan(c, free=79 * GB, total=80 * GB, frac=0.5, weights=6 * GB, reserve=2 * GB):
    return ex.CachePlan(c, 147456, weights, free, total, frac, reserve)


def test_cache_plan_fits_or_says_how_many():
    job = 9472 * 147456  # 1.397 GB
    small = _plan(16)
    # 0.5 x 80 GB - 6 GB - 2 GB = 32 GB for the cache: 22 jobs; 16 asked.
    assert small.cache_budget_bytes == 32 * GB
    assert small.jobs == 16 and small.cache_tokens == 16 * 9472
    assert small.needed_bytes == 16 * job
    big = _plan(64)
    assert big.jobs == 32 * GB // job == 22 and big.cache_tokens == 22 * 9472
    text = big.describe()
    assert f"needs {64 * job / ex.GIB:.1f} GiB" in text
    assert "holds 22 of 64 requests" in text
    assert "0.5 x 74.5 GiB" in text and "73.6 GiB free" in text
    # Less free than the fraction allows: the free memory bounds it.
    crowded = _plan(64, free=20 * GB)
    assert crowded.cache_budget_bytes == 12 * GB and crowded.jobs == 8
    # Nothing fits: no job, and the row says why.
    none = _plan(4, free=8 * GB)
    assert none.jobs == 0 and none.cache_budget_bytes == 0
    row = ex.not_run_row("qwen3-8b", 4, 7, 8, none)
    assert row["not_run"] == none.describe() and "holds 0 of 4" in row["not_run"]
    assert row["completed"] == row["failed"] == 0 and row["variant"] == "exllamav3"
    assert row["memory"]["cache_needed_bytes"] == 4 * job


def test_weights_bytes_counts_the_tensors(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}" * 100)
    assert ex.weights_bytes(tmp_path) == 1024


def test_row_metrics_from_timestamps():
    reqs = [
        # TTFT 0.5 s, then 1000 tokens in 10 s: TPOT 10 ms.
        ex.Request(0, 8192, 0.0, 0.5, 10.5, 1001),
        # TTFT 1.5 s, 20 ms per token.
        ex.Request(1, 8192, 1.0, 2.5, 22.5, 1001),
        # Failed: counted, kept out of every measure.
        ex.Request(2, 8192, 1.0, 1.2, 3.0, 17, "17 tokens, asked 1001"),
        # One token: a TTFT, no TPOT.
        ex.Request(3, 100, 2.0, 4.0, 4.0, 1),
    ]
    m = ex.row_metrics(reqs, duration=25.0, concurrency=2, num_prompts=4)
    assert set(m) == set(sb.BENCH_FIELDS)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_output_tokens"] == 2003
    assert m["total_input_tokens"] == 8192 * 2 + 100
    assert m["output_throughput"] == pytest.approx(2003 / 25)
    assert m["request_throughput"] == pytest.approx(3 / 25)
    assert m["mean_ttft_ms"] == pytest.approx((500 + 1500 + 2000) / 3)
    assert m["median_ttft_ms"] == pytest.approx(1500)
    assert m["mean_tpot_ms"] == pytest.approx(15.0)
    assert m["median_tpot_ms"] == pytest.approx(15.0)
    assert (m["max_concurrency"], m["num_prompts"]) == (2, 4)
    empty = ex.row_metrics([reqs[2]], 3.0, 1, 1)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None
    assert empty["output_throughput"] == 0


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeGenerator:
    """ExLlamaV3's Generator as the driver sees it: enqueue(job), iterate() -> results.
    Each iterate() is one step of STEP_S on the clock: started jobs prefill for
    `prefill_steps` steps, then each gets one token per step. Jobs named in `fail` get
    an error result on their first decode step; those in `short` end early."""

    STEP_S = 0.01

    def __init__(self, clock, prefill_steps=3, max_active=99, fail=(), short=()):
        self.clock = clock
        self.prefill_steps = prefill_steps
        self.max_active = max_active
        self.fail, self.short = set(fail), set(short)
        self.pending, self.active = [], []
        self.most_in_generator = 0
        self.raise_at = None

    def enqueue(self, job):
        self.pending.append(job)
        in_gen = len(self.pending) + len(self.active)
        self.most_in_generator = max(self.most_in_generator, in_gen)

    def iterate(self):
        self.clock.t += self.STEP_S
        if self.raise_at is not None and self.clock.t >= self.raise_at:
            raise RuntimeError("CUDA error: an illegal memory access")
        out = []
        while self.pending and len(self.active) < self.max_active:
            job = self.pending.pop(0)
            job.left, job.made = self.prefill_steps, 0
            self.active.append(job)
            out.append({"stage": "started", "identifier": job.identifier, "eos": 0})
        for job in list(self.active):
            if job.left:
                job.left -= 1
                out.append({"stage": "prefill", "identifier": job.identifier})
                continue
            if job.identifier in self.fail:
                self.active.remove(job)
                out.append({"stage": "error", "identifier": job.identifier, "eos": 1})
                continue
            job.made += 1
            limit = 5 if job.identifier in self.short else job.max_new_tokens
            r = {
                "stage": "streaming",
                "identifier": job.identifier,
                "token_ids": SimpleNamespace(shape=(1, 1)),
                "eos": job.made >= limit,
            }
            if r["eos"]:
                self.active.remove(job)
                r |= {"new_tokens": job.made, "eos_reason": "max_new_tokens"}
            out.append(r)
        return out


def _job(i, ids, n=8):
    return SimpleNamespace(identifier=i, max_new_tokens=n, input_len=len(ids))


def test_drive_holds_concurrency_and_times_each_request():
    clock = FakeClock()
    gen = FakeGenerator(clock, prefill_steps=3)
    prompt_ids = [[1] * (10 + i) for i in range(10)]
    reqs, duration = ex.drive(gen, _job, prompt_ids, 4, 8, clock=clock)
    assert gen.most_in_generator == 4  # never more than C in the generator
    assert [r.index for r in reqs] == list(range(10))
    assert all(r.ok and r.output_tokens == 8 for r in reqs)
    assert [r.input_len for r in reqs] == [10 + i for i in range(10)]
    # Started at once, prefill 3 steps, first token at the 4th step, 8 tokens: done at
    # the 11th; the next wave is enqueued then.
    for r in reqs[:4]:
        assert r.enqueued == 0.0
        assert r.first_token == pytest.approx(0.04)
        assert r.finished == pytest.approx(0.11)
    assert reqs[4].enqueued == pytest.approx(0.11)
    assert reqs[4].first_token == pytest.approx(0.15)
    assert duration == pytest.approx(0.33)  # three waves of 11 steps
    m = ex.row_metrics(reqs, duration, 4, 10)
    assert m["mean_ttft_ms"] == pytest.approx(40.0)
    assert m["mean_tpot_ms"] == pytest.approx(10.0)  # 7 steps over 7 tokens after 1st
    assert m["output_throughput"] == pytest.approx(80 / 0.33)


def test_drive_counts_failures():
    clock = FakeClock()
    gen = FakeGenerator(clock, prefill_steps=1, fail={1}, short={2})
    reqs, _ = ex.drive(gen, _job, [[1] * 4] * 4, 2, 8, clock=clock)
    assert [r.ok for r in reqs] == [True, False, False, True]
    assert "generator" in reqs[1].error and reqs[1].first_token is None
    assert reqs[2].error == "5 tokens, asked 8 (max_new_tokens)"
    m = ex.row_metrics(reqs, 1.0, 2, 4)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 2, 16)
    # iterate() raising ends the row: every request not finished fails, the ones not
    # yet sent included.
    clock = FakeClock()
    gen = FakeGenerator(clock, prefill_steps=1)
    gen.raise_at = 0.05
    reqs, _ = ex.drive(gen, _job, [[1] * 4] * 6, 2, 8, clock=clock)
    assert len(reqs) == 6 and not any(r.ok for r in reqs)
    assert "illegal memory access" in reqs[0].error
    assert reqs[5].error == "not run"


def test_null_tokenizer():
    tok = ex.NullTokenizer(151936)
    assert tok.actual_vocab_size == 151936
    assert len(tok.get_id_to_piece_list()) == 151936
    assert set(tok.get_id_to_piece_list(True)) == {""}
    # A vocabulary the generator pads (to a multiple of 32) has a piece for every id.
    assert len(ex.NullTokenizer(4100).get_id_to_piece_list()) == 4128
    assert tok.decode(SimpleNamespace(shape=(1, 5), dim=lambda: 2)) == [""]


def _row(variant, c, tok_s, **kw) -> dict:
    r = {
        "preset": "qwen3-8b",
        "variant": variant,
        "concurrency": c,
        "num_prompts": max(2 * c, 4),
        "completed": max(2 * c, 4),
        "failed": 0,
        "output_throughput": tok_s,
        "mean_tpot_ms": 9.5,
        "median_tpot_ms": 9.4,
        "mean_ttft_ms": 1800.0,
        "median_ttft_ms": 1750.0,
        "kv_max_concurrency": 24.0,
    }
    return r | kw


def test_table_shows_the_exllamav3_rows_and_ratios():
    plan = _plan(4, free=8 * GB)
    rows = [
        _row("exllamav3", 64, 1000.0, kv_max_concurrency=22.0, note="holds 22 of 64"),
        _row("exl3", 64, 1250.0),
        _row("gptq", 64, 1000.0),
        _row("exl3", 16, 900.0),
        _row("exllamav3", 16, 600.0),
        ex.not_run_row("qwen3-8b", 4, 1, 8, plan),
        _row("exl3", 4, 300.0),
    ]
    table = sb.format_table(rows)
    lines = table.splitlines()
    mine = [ln for ln in lines if ln.split()[:2] == ["qwen3-8b", "exllamav3"]]
    assert len(mine) == 3
    # Sorted after the vLLM variants, concurrency ascending.
    body = [ln.split()[1:3] for ln in lines[1:8]]
    assert body == [
        ["exl3", "4"],
        ["exl3", "16"],
        ["exl3", "64"],
        ["gptq", "64"],
        ["exllamav3", "4"],
        ["exllamav3", "16"],
        ["exllamav3", "64"],
    ]
    assert "1000.0" in mine[2] and "22.0" in mine[2]
    assert "nan" in mine[0]  # measured nothing
    assert "exl3 qwen3-8b c=64: output tok/s /gptq x1.25, /exllamav3 x1.25" in lines
    assert "exl3 qwen3-8b c=16: output tok/s /exllamav3 x1.50" in lines
    assert not any("c=4: output tok/s" in ln for ln in lines)  # no ratio to nothing
    assert "exllamav3 qwen3-8b c=64: note: holds 22 of 64" in lines
    assert f"exllamav3 qwen3-8b c=4: not_run: {plan.describe()}" in lines


def test_child_command_and_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    state = tmp_path / "state"
    cmd = ex.child_command(
        Path("/m"), "qwen3-8b", 16, 32, 1234, 0.5, Path("/r.json"), state, 30, 10
    )
    assert cmd[:3] == [sys.executable, "-m", "vllm_exl3.e2e.exllamav3_serve"]
    args = ex.parse_args(cmd[3:])
    assert (args.model, args.preset, args.concurrency) == (Path("/m"), "qwen3-8b", 16)
    assert (args.num_prompts, args.seed, args.gpu_memory_utilization) == (32, 1234, 0.5)
    assert (args.result, args.exl3_state) == (Path("/r.json"), state)
    assert (args.exl3_wait_s, args.exl3_import_timeout_s) == (30, 10)
    plain = ex.child_command(Path("/m"), "qwen3-8b", 1, 4, 1, 0.5, Path("/r"))
    assert "--exl3-state" not in plain
    env = ex.child_env(state)
    want = exllamav3_anchor.env_for(state)
    assert {k: env[k] for k in want} == want
    assert env["TORCH_CUDA_ARCH_LIST"] == exllamav3_anchor.ARCH_LIST
    assert env["TORCH_EXTENSIONS_DIR"] == str(state / "torch_ext")
    assert env["PYTHONPATH"].split(":") == [str(state / "site"), "/elsewhere"]
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert ex.child_env(None)["PYTHONPATH"] == "/elsewhere"


# ---- serve_bench's exllamav3 rows, in child processes, against a stand-in -----------

# A stand-in `exllamav3` with the 1.6.5 names the script uses. Its generator runs the
# jobs in batches bounded by the cache (max_num_tokens // 9472) and max_batch_size, one
# token per job per iterate(). torch.cuda.mem_get_info reports FAKE_FREE / FAKE_TOTAL
# GB (no GPU here). It records the environment it was imported in.
FAKE_INIT = """
import json, os, sys, torch

_GB = 10**9
torch.cuda.mem_get_info = lambda device=None: (
    int(float(os.environ["FAKE_FREE"]) * _GB),
    int(float(os.environ["FAKE_TOTAL"]) * _GB),
)
_state = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(_state, "child_env.json"), "a") as f:
    f.write(json.dumps({k: os.environ.get(k) for k in (
        "PYTHONPATH", "TORCH_EXTENSIONS_DIR", "TORCH_CUDA_ARCH_LIST")}) + "\\n")


class Config:
    @staticmethod
    def from_directory(d):
        c = Config()
        c.cfg = json.load(open(os.path.join(d, "config.json")))
        return c


class Model:
    @staticmethod
    def from_config(config):
        m = Model()
        m.config, m.loaded = config, False
        return m

    def load(self, device=None):
        assert device == "cuda:0"
        self.loaded = True

    def warmup(self, cache=None, max_batch_size=8, **kw):
        assert cache is not None and self.loaded
        return []

    def unload(self):
        self.loaded = False


class Cache:
    def __init__(self, model, max_num_tokens):
        assert not model.loaded, "the cache must exist before the load"
        assert max_num_tokens % 256 == 0
        self.max_num_tokens = max_num_tokens


class Job:
    def __init__(self, input_ids, max_new_tokens, sampler, stop_conditions, identifier):
        assert input_ids.dtype == torch.long and input_ids.shape[0] == 1
        assert stop_conditions is None and type(sampler).__name__ == "ArgmaxSampler"
        self.ids, self.n, self.identifier = input_ids, max_new_tokens, identifier


class Generator:
    def __init__(self, model, cache, tokenizer, max_batch_size):
        assert tokenizer.actual_vocab_size == model.config.cfg["vocab_size"]
        self.vocab = model.config.cfg["vocab_size"]
        self.limit = min(max_batch_size, cache.max_num_tokens // 9472)
        self.pending, self.active, self.closed = [], [], False

    def enqueue(self, job):
        assert int(job.ids.max()) < self.vocab, "prompt ids inside the vocabulary"
        job.made = 0
        self.pending.append(job)

    def iterate(self):
        out = []
        while self.pending and len(self.active) < self.limit:
            self.active.append(self.pending.pop(0))
        for job in list(self.active):
            job.made += 1
            r = {"stage": "streaming", "identifier": job.identifier,
                 "token_ids": torch.zeros((1, 1), dtype=torch.long),
                 "eos": job.made == job.n}
            if r["eos"]:
                self.active.remove(job)
                r.update(new_tokens=job.made, eos_reason="max_new_tokens")
            out.append(r)
        return out

    def close(self):
        self.closed = True
"""
FAKE_SAMPLER = """
class ArgmaxSampler:
    pass
"""
FAKE_LINEAR = """
class LinearEXL3:
    pass
"""


def fake_anchor_state(tmp_path: Path) -> Path:
    """A state folder as exllamav3_anchor.py's finished build leaves it: the package
    in site/, the build's started- and done-files (exit 0)."""
    state = tmp_path / "state"
    pkg = state / "site" / "exllamav3"
    for sub in ("generator/sampler", "modules/quant"):
        (pkg / sub).mkdir(parents=True)
    for d in ("generator", "modules"):
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(FAKE_INIT)
    # Where ExLlamaV3 1.6.5 keeps its release: not on the package itself.
    (pkg / "version.py").write_text('__version__ = "1.6.5"\n')
    (pkg / "generator" / "sampler" / "__init__.py").write_text(FAKE_SAMPLER)
    (pkg / "modules" / "quant" / "__init__.py").write_text("")
    (pkg / "modules" / "quant" / "exl3.py").write_text(FAKE_LINEAR)
    p = exllamav3_anchor.paths(state)
    p["ext"].mkdir(parents=True)
    p["started"].write_text("0")
    p["done"].write_text("0")
    return state


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "work" / "exl3-qwen3-8b-Lall-4bpw-mul1"
    d.mkdir(parents=True)
    cfg = {**MODEL_CONFIGS["qwen3-8b"], "quantization_config": {"quant_method": "exl3"}}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"\0" * 4096)
    return d


def _matrix_args(tmp_path, model_dir, state, conc, resume=None) -> Namespace:
    return Namespace(
        out=tmp_path / "out",
        work=model_dir.parent,
        presets=["qwen3-8b"],
        variants=["exllamav3"],
        concurrency=conc,
        gpu_memory_utilization=None,
        budget_s=3600,
        resume=resume,
        prompt_waves=sb.PROMPT_WAVES,
        paired=False,
        exl3_state=state,
        exl3_wait_s=20,
        exl3_import_timeout_s=60,
    )


def test_matrix_measures_exllamav3_rows_in_children(tmp_path, model_dir, monkeypatch):
    """run_matrix with the exllamav3 variant, for real: one child per row in a fresh
    interpreter with the anchor's environment, the stand-in generator driven through
    the whole load, rows merged into serve_bench.json. At 40 GB of an 80 GB card with
    0.5 of it for the process, the cache holds all of c=1 and 2 requests of c=4."""
    state = fake_anchor_state(tmp_path)
    monkeypatch.setattr(sb, "ensure_checkpoint", lambda *a: model_dir)
    monkeypatch.setattr(sb, "host_facts", lambda: {})
    monkeypatch.setattr(sb, "Server", None)  # no vLLM server for these rows
    # 0.5 x 80 GB = 40 GB - 2 GiB reserve = 37.85 GB: 27 jobs of 1.397 GB. Free 5 GB
    # bounds it: 5 GB - 2.147 GB reserve = 2.85 GB, two jobs.
    monkeypatch.setenv("FAKE_FREE", "5")
    monkeypatch.setenv("FAKE_TOTAL", "80")
    args = _matrix_args(tmp_path, model_dir, state, [1, 4])
    assert sb.run_matrix(args) == 0, (args.out / sb.RESULT_NAME).read_text()
    rec = json.loads((args.out / sb.RESULT_NAME).read_text())
    assert rec["errors"] == [] and rec["skipped"] == []
    rows = {r["concurrency"]: r for r in rec["rows"]}
    assert set(rows) == {1, 4}
    for c, r in rows.items():
        assert r["variant"] == "exllamav3" and r["preset"] == "qwen3-8b"
        assert r["seed"] == sb.row_seed("qwen3-8b", "exllamav3", c)
        assert r["num_prompts"] == sb.num_prompts(c) == r["completed"]
        assert r["failed"] == 0 and r["max_concurrency"] == c
        assert r["total_output_tokens"] == r["completed"] * 1024
        assert r["total_input_tokens"] == r["completed"] * 8192
        assert r["output_throughput"] > 0 and r["mean_tpot_ms"] >= 0
        assert {"bench_s", "server_ready_s", "memory"} <= set(r)
        assert r["exllamav3"] == "1.6.5"
    assert rows[1]["kv_max_concurrency"] == 1.0 and "note" not in rows[1]
    assert rows[4]["kv_max_concurrency"] == 2.0
    assert "holds 2 of 4 requests" in rows[4]["note"]
    assert rows[4]["kv_tokens"] == 2 * 9472
    # Each child ran with the anchor's environment: its site first on PYTHONPATH.
    seen = [
        json.loads(line) for line in (state / "child_env.json").read_text().splitlines()
    ]
    assert len(seen) == 2
    for env in seen:
        assert env["PYTHONPATH"].split(":")[0] == str(state / "site")
        assert env["TORCH_EXTENSIONS_DIR"] == str(state / "torch_ext")
        assert env["TORCH_CUDA_ARCH_LIST"] == exllamav3_anchor.ARCH_LIST
    log = args.out / "logs" / "bench-qwen3-8b-exllamav3-c4.log"
    assert "holds 2 of 4 requests" in log.read_text()
    # Resumed: nothing left to measure, no child started, the rows kept.
    monkeypatch.setattr(ex, "run_child", None)
    again = _matrix_args(tmp_path, model_dir, state, [1, 4], args.out / sb.RESULT_NAME)
    assert sb.run_matrix(again) == 0
    assert len(json.loads((args.out / sb.RESULT_NAME).read_text())["rows"]) == 2


def test_matrix_records_a_row_that_cannot_run(tmp_path, model_dir, monkeypatch):
    """No memory for one request: a row that says so, measuring nothing; an anchor
    build that never ran: an error, and the row left for a later call."""
    state = fake_anchor_state(tmp_path)
    monkeypatch.setattr(sb, "ensure_checkpoint", lambda *a: model_dir)
    monkeypatch.setattr(sb, "host_facts", lambda: {})
    monkeypatch.setenv("FAKE_FREE", "3")
    monkeypatch.setenv("FAKE_TOTAL", "80")
    args = _matrix_args(tmp_path, model_dir, state, [16])
    assert sb.run_matrix(args) == 0
    (row,) = json.loads((args.out / sb.RESULT_NAME).read_text())["rows"]
    assert row["completed"] == 0 and "holds 0 of 16 requests" in row["not_run"]
    assert "needs 20.8 GiB" in row["not_run"]
    assert "2.8 GiB free" in row["not_run"]

    unbuilt = tmp_path / "unbuilt"
    unbuilt.mkdir()
    args = _matrix_args(tmp_path / "b", model_dir, unbuilt, [1])
    assert sb.run_matrix(args) == 1
    rec = json.loads((args.out / sb.RESULT_NAME).read_text())
    assert rec["rows"] == [] and rec["skipped"] == ["qwen3-8b exllamav3 c=1 (error)"]
    assert "no ExLlamaV3 build was started" in rec["errors"][0]


def test_child_cut_at_the_budget_is_stopped(tmp_path):
    """A child that outlives its time is stopped (SIGTERM dumps its stacks into the
    log first) and reported as cut, its process group gone."""
    log = tmp_path / "child.log"
    code = textwrap.dedent(
        """
        import faulthandler, signal, time
        faulthandler.register(signal.SIGTERM, chain=True)
        print("started", flush=True)
        time.sleep(60)
        """
    )
    rc = ex.run_child([sys.executable, "-c", code], {}, log, timeout=2)
    assert rc is None
    text = log.read_text()
    assert "started" in text and 'File "<string>", line 5' in text
    assert ex.run_child([sys.executable, "-c", "pass"], {}, log, timeout=30) == 0
