# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/e2e/serve_profile.py on the CPU: the profiler settings against the fields
vLLM 0.26.0 defines (read from its sdist), the iteration names vLLM's worker writes,
and the trace summary on a trace laid out as torch's Chrome-trace export lays it out."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
from pathlib import Path

import pytest
from vllm_exl3.e2e import serve_bench as sb
from vllm_exl3.e2e import serve_profile as sp

VLLM_SDIST = Path("/root/.cache/vllm-exl3/src/vllm-0.26.0")
DECODE = "execute_context_0(0)_generation_16(16)"
MIXED = "execute_context_1(8192)_generation_15(15)"


def test_window_starts_after_the_prefills():
    assert sp.profile_window(16) == (16 + sp.PROFILE_MARGIN_ITERATIONS, 48)
    assert sp.profile_window(1)[0] == 1 + sp.PROFILE_MARGIN_ITERATIONS
    cfg = json.loads(sp.profiler_config(Path("/tmp/t"), 64))
    assert cfg["profiler"] == "torch" and cfg["torch_profiler_dir"] == "/tmp/t"
    assert cfg["delay_iterations"] == 64 + sp.PROFILE_MARGIN_ITERATIONS
    assert cfg["max_iterations"] == sp.PROFILE_ITERATIONS


@pytest.mark.skipif(not VLLM_SDIST.is_dir(), reason="vLLM 0.26.0's sdist is not here")
def test_settings_and_names_exist_in_vllm_0_26():
    fields = (VLLM_SDIST / "vllm/config/profiler.py").read_text()
    for key in json.loads(sp.profiler_config(Path("/tmp/t"), 4)):
        assert re.search(rf"^\s+{key}:", fields, re.M), key
    assert '"--profile"' in (VLLM_SDIST / "vllm/benchmarks/serve.py").read_text()
    assert "profiler_config:" in (VLLM_SDIST / "vllm/engine/arg_utils.py").read_text()
    assert '"VLLM_GPU_SYNC_CHECK"' in (VLLM_SDIST / "vllm/envs.py").read_text()
    # The annotation a decode-only iteration gets (gpu_worker.py, simple form).
    worker = (VLLM_SDIST / "vllm/v1/worker/gpu_worker.py").read_text()
    assert '"execute_context_"' in worker and '"_generation_"' in worker


SYNC_AT = "/site/vllm/model_executor/layers/quantization/exl3/moe.py:448"
SYNC_LOG = (
    "(EngineCore pid=7) INFO 12-07 08:18:39 [core.py:340] init engine\n"
    f"(EngineCore pid=7) {SYNC_AT}: UserWarning: called a synchronizing CUDA "
    "operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:190.)\n"
    "(EngineCore pid=7)   offset, _ = self.w2_meta_cpu[local].tolist()\n"
    f"(EngineCore pid=7) {SYNC_AT}: UserWarning: called a synchronizing CUDA "
    "operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:190.)\n"
    "(EngineCore pid=7) /site/vllm/v1/worker/gpu_model_runner.py:3001: UserWarning: "
    "called a synchronizing CUDA operation\n"
)


def test_sync_locations_in_a_server_log():
    assert sp.sync_locations(SYNC_LOG) == [
        SYNC_AT,
        "/site/vllm/v1/worker/gpu_model_runner.py:3001",
    ]
    assert sp.sync_locations("no warnings here") == []


def test_decode_step_names():
    assert sp.decode_step(DECODE) == 16
    assert sp.decode_step("execute_context_0(0)_generation_1(1)") == 1
    assert sp.decode_step(MIXED) is None
    assert (
        sp.decode_step("execute_8192_context_1(sq8192sk8192)_generation_0(sq0)") is None
    )


def ev(name, ts, dur, cat, tid=1, pid=1):
    return {
        "ph": "X",
        "name": name,
        "ts": ts,
        "dur": dur,
        "cat": cat,
        "pid": pid,
        "tid": tid,
    }


def test_self_times_subtract_direct_children_only():
    evs = [
        ev("outer", 0, 100, "cpu_op"),
        ev("mid", 10, 50, "cpu_op"),
        ev("inner", 20, 10, "cpu_op"),
        ev("after", 70, 20, "cpu_op"),
        ev("other_thread", 0, 100, "cpu_op", tid=2),
    ]
    got = sp.self_times(evs)
    assert got == {
        "outer": 100 - 50 - 20,
        "mid": 50 - 10,
        "inner": 10,
        "after": 20,
        "other_thread": 100,
    }


def synthetic_trace(steps: int = 8, step_us: float = 20000.0, host_us: float = 5000.0):
    """A prefill iteration, then `steps` decode-only ones `step_us` apart, each with its
    host span, a launch and two kernels; one synchronization in the third."""
    events = [ev(MIXED, 0, 30000, "user_annotation")]
    t = 40000.0
    for i in range(steps):
        events.append(ev(DECODE, t, host_us, "user_annotation"))
        events.append(ev("cudaGraphLaunch", t + 100, 50, "cuda_runtime"))
        events.append(ev("moe_gemm", t + 200, 300, "kernel", tid=7, pid=0))
        events.append(ev("attention", t + 600, 100, "kernel", tid=7, pid=0))
        if i == 2:
            events.append(ev("cudaStreamSynchronize", t + 200, 4000, "cuda_runtime"))
        t += step_us
    events.append(ev("ProfilerStep#1", 0, 1, "cpu_op"))  # outside the decode span
    events.append({"ph": "i", "name": "marker", "ts": 5, "cat": "cpu_op"})
    return {"traceEvents": events}


def test_summary_of_a_trace(tmp_path):
    s = sp.summarize(synthetic_trace())
    assert s["decode_steps"] == 8 and s["sequences"] == [16]
    assert s["step_wall_us_median"] == 20000.0
    assert s["step_host_us_median"] == 5000.0
    assert s["kernel_us_per_step"] == 400.0
    assert [k["name"] for k in s["kernels"]] == ["moe_gemm", "attention"]
    assert s["kernels"][0]["us_per_step"] == 300.0
    assert s["runtime"][0] == {"name": "cudaStreamSynchronize", "us_per_step": 500.0}
    host = {h["name"]: h["us_per_step"] for h in s["host_self"]}
    # The step's own host time less the runtime calls nested in it.
    assert host[DECODE] == pytest.approx(5000 - 50 - 4000 / 8)
    assert "ProfilerStep#1" not in host and MIXED not in host


def test_layer_and_moe_block_times():
    """A layer is the gap between attention launches; the MoE block runs from the
    variant's first MoE kernel to its last (MOE_SPANS), whatever runs between."""
    events = [ev(DECODE, 0, 100, "user_annotation")]
    t = 10.0
    for layer in range(5):
        for name, dur in (
            ("flash::FlashAttnFwdSm90<...>", 40),
            ("flash::FlashAttnFwdCombine<...>", 3),
            ("exl3_moe_input_transform_kernel", 4),
            ("exl3_moe_gemm_kernel<8, 2, 1, 0>", 30 + layer),
            ("exl3_moe_act_transform_kernel", 20),
            ("exl3_moe_gemm_kernel<8, 2, 1, 1>", 15),
            ("exl3_moe_finish_sum_kernel", 5),
        ):
            events.append(ev(name, t, dur, "kernel", tid=7, pid=0))
            t += dur + 1
        t = 10.0 + 120.0 * (layer + 1)
    events.append(ev(DECODE, 650, 100, "user_annotation"))
    s = sp.summarize({"traceEvents": events}, "exl3")
    assert s["layer_us_median"] == 120.0
    # Layer 2: input transform at 10 + 240 + 41 + 4 (ends + 1 apart) to the end of
    # finish_sum, 4 + 1 + 32 + 1 + 20 + 1 + 15 + 1 + 5 = 80 us later.
    assert s["moe_us_median"] == 80.0
    assert sp.summarize({"traceEvents": events}, "gptq")["moe_us_median"] is None
    assert sp.summarize({"traceEvents": events})["moe_us_median"] is None
    text = sp.format_summary(
        [{"preset": "p", "variant": "exl3", "concurrency": 1} | {"gpu_syncs": []} | s]
    )
    assert "a layer 120.0 us, its MoE block 80.0 us" in text


def test_moe_block_without_its_end_is_not_spanned_across_layers():
    kernels = [
        ev("exl3_moe_input_transform_kernel", 0, 4, "kernel"),
        ev("exl3_moe_combine_kernel", 50, 5, "kernel"),  # not the span's end kernel
        ev("exl3_moe_input_transform_kernel", 200, 4, "kernel"),
        ev("exl3_moe_finish_sum_kernel", 260, 5, "kernel"),
    ]
    assert sp.moe_us_median(kernels, "exl3") == 65.0


def test_trace_without_decode_iterations_is_named():
    trace = {"traceEvents": [ev(MIXED, 0, 10, "user_annotation")]}
    with pytest.raises(ValueError, match="no decode-only iteration"):
        sp.summarize(trace)


def test_reads_the_written_trace(tmp_path):
    d = tmp_path / "profiles" / "p"
    d.mkdir(parents=True)
    path = d / "rank0.123.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(synthetic_trace(4), f)
    found = sp.wait_for_trace(tmp_path / "profiles", timeout=10)
    assert found == path
    assert sp.summarize(sp.read_trace(found))["decode_steps"] == 4
    with pytest.raises(TimeoutError, match="no complete trace"):
        sp.wait_for_trace(tmp_path / "empty", timeout=0.1)


def test_format_summary_names_each_part():
    row = {"preset": "qwen3-30b-a3b", "variant": "exl3", "concurrency": 16}
    row["gpu_syncs"] = [SYNC_AT]
    text = sp.format_summary([row | sp.summarize(synthetic_trace())])
    assert "exl3 c=16: 8 decode steps" in text and "wall 20.00 ms" in text
    assert "cudaStreamSynchronize" in text and "moe_gemm" in text
    assert f"sync      {SYNC_AT}" in text
    one = row | sp.summarize(synthetic_trace(steps=1))
    assert one["step_wall_us_median"] is None  # no next iteration to time it by
    assert "wall n/a ms" in sp.format_summary([one])


def test_main_summarizes_traces_without_a_server(tmp_path, monkeypatch, capsys):
    paths = []
    for i, steps in enumerate((3, 5)):
        path = tmp_path / f"t{i}.pt.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump(synthetic_trace(steps), f)
        paths.append(path)
    monkeypatch.setattr(sb, "Server", None)  # must not start one
    argv = ["--trace", str(paths[0]), "--trace", str(paths[1])]
    assert sp.main(argv) == 0
    out = capsys.readouterr().out
    assert "exl3 c=16: 3 decode steps" in out and "gptq c=16: 5 decode steps" in out
    with pytest.raises(SystemExit):
        sp.main(argv + ["--variants", "exl3"])


def test_main_profiles_each_variant(tmp_path, monkeypatch):
    """The driver against stand-ins for the server and `vllm bench serve`: each
    variant's server gets its own trace directory in --profiler-config, the wave
    runs with --profile, and the trace the worker leaves there is summarized into the
    result."""
    exl3 = tmp_path / "work" / "exl3-qwen3-30b-a3b-Lall-4bpw-mul1"
    exl3.mkdir(parents=True)
    (exl3 / "config.json").write_text(json.dumps({"num_experts": 128, "vocab_size": 8}))
    monkeypatch.setattr(sp, "ensure_checkpoint", lambda *a: exl3)
    monkeypatch.setattr(sp, "free_port", lambda: 1234)
    monkeypatch.setattr(sp, "TRACE_POLL_S", 0.01)
    monkeypatch.setattr(sb, "host_facts", lambda: {})
    servers = []

    class FakeServer:
        def __init__(self, cmd, port, logfile, env=None):
            assert env["VLLM_GPU_SYNC_CHECK"] == "warn"
            self.cmd, self.logfile = cmd, logfile
            logfile.write_text(SYNC_LOG if not servers else "")
            servers.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def wait_ready(self, timeout):
            return 1.0

    def fake_run(cmd, **kw):
        assert "--profile" in cmd and cmd[cmd.index("--max-concurrency") + 1] == "16"
        assert cmd[cmd.index("--num-prompts") + 1] == "16"  # one wave
        server = servers[-1].cmd
        # Server and client share the model's tokenizer (serve_bench.model_tokenizer).
        tok = cmd[cmd.index("--tokenizer") + 1]
        assert tok == server[server.index("--tokenizer") + 1]
        assert Path(tok).name.startswith("tokenizer-")
        cfg = json.loads(server[server.index("--profiler-config") + 1])
        trace = Path(cfg["torch_profiler_dir"]) / "rank0.1.pt.trace.json.gz"
        with gzip.open(trace, "wt") as f:
            json.dump(synthetic_trace(len(servers) + 2), f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sb, "Server", FakeServer)
    monkeypatch.setattr(sp.subprocess, "run", fake_run)
    out = tmp_path / "out"
    rc = sp.main(
        ["--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "100"]
    )
    assert rc == 0
    rows = json.loads((out / sp.RESULT_NAME).read_text())["rows"]
    assert [(r["variant"], r["decode_steps"]) for r in rows] == [
        ("exl3", 3),
        ("gptq", 4),
    ]
    dirs = {
        json.loads(s.cmd[s.cmd.index("--profiler-config") + 1])["torch_profiler_dir"]
        for s in servers
    }
    assert len(dirs) == 2
    assert "--load-format" in servers[1].cmd and "--load-format" not in servers[0].cmd
