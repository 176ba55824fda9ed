# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/e2e/serve_bench.py on the CPU: the `vllm serve` and `vllm bench serve`
command lines of every variant (checked against the flags vLLM 0.26.0's parsers define,
read from its sdist), the parsing of a result shaped as vLLM's writer writes it, resume,
the soak's verdicts, and the server lifecycle, the matrix, the soak client and the whole
soak against a small fake server (an http.server subprocess standing in for `vllm
serve`)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import textwrap
import time
from argparse import Namespace
from pathlib import Path

import pytest
from vllm_exl3.e2e import serve_bench as sb
from vllm_exl3.testing.fixtures import TOKENIZER

VLLM_SDIST = Path("/root/.cache/vllm-exl3/src/vllm-0.26.0")
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "num_hidden_layers": 2,
    "quantization_config": {"quant_method": "exl3", "bits": 4.0},
}


@pytest.fixture
def exl3_dir(tmp_path):
    d = tmp_path / "work" / "exl3-qwen3-8b-Lall-4bpw-mul1"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_serve_command_of_every_variant(exl3_dir):
    work = exl3_dir.parent
    vs = {v.name: v for v in sb.variants(exl3_dir, work, list(sb.VLLM_VARIANTS))}
    assert list(vs) == ["exl3", "gptq", "fp8", "bf16"]
    tok = work / "tokenizer-metaspace-151936"
    for name, v in vs.items():
        cmd = sb.serve_command(v, 8123, 0.5, tok)
        assert cmd[: len(sb.vllm_cli()) + 1] == [*sb.vllm_cli(), "serve"]
        assert "--no-enable-prefix-caching" in cmd
        assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "8123"
        assert int(_flag(cmd, "--max-model-len")) >= 8192 + 1024
        assert _flag(cmd, "--gpu-memory-utilization") == "0.5"
        assert _flag(cmd, "--tokenizer") == str(tok)
        assert int(_flag(cmd, "--max-num-seqs")) >= 64
        assert ("--load-format" in cmd) == (name != "exl3"), name
        assert ("--quantization" in cmd) == (name == "fp8"), name
        cfg = json.loads((Path(_flag(cmd, "serve")) / "config.json").read_text())
        method = cfg.get("quantization_config", {}).get("quant_method")
        assert method == {"exl3": "exl3", "gptq": "gptq"}.get(name), (name, method)
    assert _flag(sb.serve_command(vs["fp8"], 1, 0.5, tok), "--quantization") == "fp8"
    assert _flag(sb.serve_command(vs["gptq"], 1, 0.5, tok), "--load-format") == "dummy"
    # fp8 is the bf16 dummy quantized at load.
    assert vs["fp8"].model_dir == vs["bf16"].model_dir


def test_bench_command_and_distinct_seeds(tmp_path):
    seeds = {}
    for preset in sb.PRESETS:
        for variant in sb.VARIANTS:
            for c in sb.CONCURRENCY:
                seeds[(preset, variant, c)] = sb.row_seed(preset, variant, c)
    # Two presets, four vLLM variants and ExLlamaV3's generator, four concurrencies.
    assert len(set(seeds.values())) == len(seeds) == 2 * 5 * 4
    cmd = sb.bench_command(8123, 16, 1007, tmp_path, "r.json", tmp_path / "tok")
    assert _flag(cmd, "--tokenizer") == str(tmp_path / "tok")
    assert cmd[: len(sb.vllm_cli()) + 2] == [*sb.vllm_cli(), "bench", "serve"]
    assert _flag(cmd, "--dataset-name") == "random"
    assert _flag(cmd, "--random-input-len") == "8192"
    assert _flag(cmd, "--random-output-len") == "1024"
    assert "--ignore-eos" in cmd and "--save-result" in cmd
    assert _flag(cmd, "--max-concurrency") == "16"
    assert _flag(cmd, "--num-prompts") == "32"
    assert _flag(cmd, "--seed") == "1007"
    assert _flag(cmd, "--base-url") == "http://127.0.0.1:8123"
    assert _flag(cmd, "--result-dir") == str(tmp_path)
    assert _flag(cmd, "--result-filename") == "r.json"
    assert [sb.num_prompts(c) for c in sb.CONCURRENCY] == [4, 8, 32, 128]
    assert [sb.num_prompts(c, 4) for c in sb.CONCURRENCY] == [4, 16, 64, 256]
    longer = sb.bench_command(8123, 64, 1, tmp_path, "r.json", tmp_path, waves=4)
    assert _flag(longer, "--num-prompts") == "256"


def _defined_flags(*files: str) -> set[str]:
    text = "".join((VLLM_SDIST / f).read_text() for f in files)
    return set(re.findall(r'"(--[a-z0-9-]+)"', text))


@pytest.mark.skipif(not VLLM_SDIST.is_dir(), reason="vLLM 0.26.0's sdist is not here")
def test_flags_exist_in_vllm_0_26(exl3_dir, tmp_path):
    """Every flag we pass is one vLLM 0.26.0's parsers define (read from the sdist's
    source: tests of the tool do not import vLLM)."""
    bench = _defined_flags(
        "vllm/benchmarks/serve.py", "vllm/benchmarks/datasets/datasets.py"
    )
    for flag in (
        a
        for a in sb.bench_command(1, 4, 1, tmp_path, "r.json", tmp_path)
        if a.startswith("--")
    ):
        assert flag in bench, flag
    # Engine flags are generated from EngineArgs' fields (booleans get --no-...).
    engine_src = "".join(
        (VLLM_SDIST / f).read_text()
        for f in ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py")
    )
    for v in sb.variants(exl3_dir, exl3_dir.parent, list(sb.VLLM_VARIANTS)):
        cmd = sb.serve_command(v, 1, 0.5, tmp_path)
        for flag in (a for a in cmd if a.startswith("--")):
            field = flag.removeprefix("--no-").removeprefix("--").replace("-", "_")
            assert f'"{flag}"' in engine_src or f"{field}:" in engine_src, flag


def recorded_result(**over) -> dict:
    """A result with the keys vllm/benchmarks/serve.py's main() writes without
    --save-detailed (its setup keys, then benchmark()'s result with the default
    percentile metrics ttft, tpot, itl at p99)."""
    r = {
        "date": "20261206-050000",
        "endpoint_type": "openai",
        "backend": "openai",
        "label": None,
        "model_id": "model",
        "tokenizer_id": str(TOKENIZER),
        "num_prompts": 64,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": 16,
        "duration": 95.2,
        "completed": 64,
        "failed": 0,
        "total_input_tokens": 524288,
        "total_output_tokens": 65536,
        "request_throughput": 0.672,
        "request_goodput": None,
        "output_throughput": 688.4,
        "total_token_throughput": 6195.6,
        "max_output_tokens_per_s": 912.0,
        "max_concurrent_requests": 16,
        "rtfx": 0.0,
    }
    for m in ("ttft", "tpot", "itl"):
        base = {"ttft": 1800.0, "tpot": 21.5, "itl": 21.4}[m]
        r |= {
            f"mean_{m}_ms": base,
            f"median_{m}_ms": base * 0.98,
            f"std_{m}_ms": base * 0.1,
            f"p99_{m}_ms": base * 1.5,
        }
    return r | over


def test_parse_bench_result(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(recorded_result()))
    row = sb.parse_bench_result(p)
    assert row["output_throughput"] == 688.4 and row["failed"] == 0
    assert row["mean_tpot_ms"] == 21.5 and row["median_ttft_ms"] == 1800.0 * 0.98
    assert set(row) == set(sb.BENCH_FIELDS)
    broken = recorded_result()
    del broken["median_tpot_ms"]
    p.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="median_tpot_ms"):
        sb.parse_bench_result(p)


def test_kv_capacity_and_metrics():
    log = (
        "INFO ... [kv_cache_utils.py:1] GPU KV cache size: 345,088 tokens\n"
        "INFO ... Maximum concurrency for 9,472 tokens per request: 36.43x\n"
    )
    assert sb.kv_capacity(log) == {"kv_tokens": 345088, "kv_max_concurrency": 36.43}
    assert sb.kv_capacity("nothing") == {}
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="model"} 0.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="model"} 0.25\n'
        'vllm:num_requests_running_total{engine="0"} 9.0\n'
    )
    got = sb.parse_metrics(
        text, ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")
    )
    assert got == {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.25}


def test_prompt_ids_stay_in_the_tokenizer():
    ids = sb.prompt_token_ids(TOKENIZER)
    tok = json.loads((TOKENIZER / "tokenizer.json").read_text())
    special = {t["id"] for t in tok["added_tokens"]}
    assert ids and not special & set(ids) and max(ids) < len(tok["model"]["vocab"])


def test_model_tokenizer_decodes_every_sampled_id(exl3_dir):
    """The servers' and the client's tokenizer names every id of the model's
    vocabulary: each decodes alone to its own text in one step of the API server's
    incremental detokenizer (tokenizers' DecodeStream), and a decoded prompt encodes
    back to the same ids. The fixtures' tokenizer, 4096 entries, decodes an id above
    it to nothing, so the stream keeps the id and decodes it again at every later
    step."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    path = sb.model_tokenizer(exl3_dir.parent, exl3_dir)
    assert path == exl3_dir.parent / "tokenizer-metaspace-151936"
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] >= sb.MAX_MODEL_LEN
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == CONFIG["vocab_size"]
    assert sb.prompt_token_ids(path) == list(range(CONFIG["vocab_size"]))
    vocab = range(CONFIG["vocab_size"])
    prompt = random.Random(7).choices(vocab, k=8192)
    assert tok.encode(tok.decode(prompt), add_special_tokens=False).ids == prompt
    stream = DecodeStream(ids=prompt[:64], skip_special_tokens=True)
    texts = [stream.step(tok, i) for i in vocab]
    assert texts == [" " + sb.TOKENIZER_WORD.format(i) for i in vocab]
    small = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    stream = DecodeStream(ids=[5, 6], skip_special_tokens=True)
    assert [stream.step(small, i) for i in (100000, 100001)] == [None, None]
    # Written once: a second call keeps the files.
    stamp = (path / "tokenizer.json").stat().st_mtime_ns
    assert sb.model_tokenizer(exl3_dir.parent, exl3_dir) == path
    assert (path / "tokenizer.json").stat().st_mtime_ns == stamp
    assert not list(exl3_dir.parent.glob("tokenizer-*.tmp*"))


def test_resume_skips_measured_rows(tmp_path):
    done = [
        {"preset": "qwen3-8b", "variant": "exl3", "concurrency": 1},
        {"preset": "qwen3-8b", "variant": "gptq", "concurrency": 64},
    ]
    path = tmp_path / "serve_bench.json"
    path.write_text(json.dumps({"tokenizer": sb.TOKENIZER_KIND, "rows": done}))
    rows = sb.load_rows(path)
    todo = sb.pending(rows, ["qwen3-8b"], ["exl3", "gptq"], [1, 64])
    assert todo == [("qwen3-8b", "exl3", 64), ("qwen3-8b", "gptq", 1)]
    assert sb.load_rows(tmp_path / "absent.json") == []
    # Rows of another tokenizer (the fixtures', before model_tokenizer) are not kept.
    path.write_text(json.dumps({"rows": done}))
    assert sb.load_rows(path) == []


def test_resume_keeps_only_rows_of_this_gpu(tmp_path):
    # The older layout names the GPU once, in the record's host; newer rows name theirs.
    done = [
        {"preset": "qwen3-8b", "variant": "gptq", "concurrency": 1},
        {"preset": "qwen3-8b", "variant": "exl3", "concurrency": 1, "gpu": "H200"},
    ]
    path = tmp_path / "serve_bench.json"
    host = {"gpu": "H100", "commit": "abc1234", "torch": "2.11.0"}
    path.write_text(
        json.dumps({"tokenizer": sb.TOKENIZER_KIND, "host": host, "rows": done})
    )
    # An older row takes the record's host with it (not the torch version: the record
    # of the call that resumes names that); a row's own names win.
    older = {**done[0], "gpu": "H100", "commit": "abc1234"}
    newer = {**done[1], "commit": "abc1234"}
    assert sb.load_rows(path, "H100") == [older]
    assert sb.load_rows(path, "H200") == [newer]
    assert sb.load_rows(path, "B200") == []
    # Where the GPU is unknown (no nvidia-smi), every row is kept.
    assert sb.load_rows(path) == [older, newer]


FAKE_SERVER = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "exit":
        print("fake: failing at start", flush=True)
        sys.exit(3)
    if mode == "ignore-term":
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A child in the server's process group, as vLLM's engine core is.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"fake: child {child.pid}", flush=True)
    print("GPU KV cache size: 345,088 tokens", flush=True)
    print("Maximum concurrency for 9,472 tokens per request: 36.43x", flush=True)
    ready_at = time.monotonic() + (1e9 if mode == "never" else 0.5)

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            ok = time.monotonic() >= ready_at
            metrics = (
                b'vllm:num_requests_running{engine="0"} 0.0\\n'
                b'vllm:kv_cache_usage_perc{engine="0"} 0.0\\n'
            )
            body = b"" if self.path == "/health" else metrics
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = req["max_tokens"]
            if not req.get("stream"):
                body = json.dumps({"usage": {"completion_tokens": n}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            # A short prompt's request fails mid-stream: the soak must count it.
            fail = len(req["prompt"]) < int(os.environ.get("FAKE_FAIL_BELOW", "0"))
            for i in range(4):
                time.sleep(0.05)
                chunk = {"choices": [{"text": "x", "index": 0}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
                self.wfile.flush()
            tokens = n - 1 if fail else n
            usage = {"choices": [], "usage": {"completion_tokens": tokens}}
            self.wfile.write(f"data: {json.dumps(usage)}\\n\\n".encode())
            self.wfile.write(b"data: [DONE]\\n\\n")
            self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def make(mode: str = "ok") -> sb.Server:
        port = sb.free_port()
        return sb.Server(
            [sys.executable, str(script), str(port), mode],
            port,
            tmp_path / f"serve-{mode}.log",
        )

    return make


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def test_server_lifecycle_against_a_fake_server(fake):
    server = fake("ok")
    with server:
        ready = server.wait_ready(timeout=30)
        assert 0.3 < ready < 30
        assert server.healthy()
        pids = server.group_pids()
        assert server.proc.pid in pids and len(pids) >= 2
        assert sb.kv_capacity(server.logfile.read_text())["kv_max_concurrency"] == 36.43
        t0 = time.monotonic()
        assert server.stop() == "terminated"
        assert time.monotonic() - t0 < sb.SERVER_STOP_TIMEOUT_S
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "the server's group outlived stop()"
    assert not server.healthy()
    assert server.stop() == "exited"


def test_server_that_ignores_sigterm_is_killed(fake):
    server = fake("ignore-term")
    server.start()
    try:
        server.wait_ready(timeout=30)
    finally:
        t0 = time.monotonic()
        how = server.stop(timeout=1)
    assert how == "killed" and time.monotonic() - t0 < 10
    assert server.proc.returncode == -signal.SIGKILL


def test_server_that_exits_or_never_answers(fake):
    server = fake("exit")
    with (
        server,
        pytest.raises(RuntimeError, match="(?s)exited with 3.*failing at start"),
    ):
        server.wait_ready(timeout=30)
    server = fake("never")
    t0 = time.monotonic()
    with server, pytest.raises(TimeoutError, match="not healthy after 2 s"):
        server.wait_ready(timeout=2)
    assert time.monotonic() - t0 < 10


def _write_result_cmd(port, c, seed, result_dir, filename, tokenizer, **kw):
    """Stands in for `vllm bench serve`: writes a recorded-shape result whose
    throughput encodes the seed, so each row is traceable to its command. The client
    gets the servers' tokenizer, the model's."""
    assert Path(tokenizer).name == "tokenizer-metaspace-151936"
    data = recorded_result(max_concurrency=c, output_throughput=float(seed))
    code = f"import json, sys; open(sys.argv[1], 'w').write(json.dumps({data!r}))"
    return [sys.executable, "-c", code, str(Path(result_dir) / filename)]


def _matrix_args(
    out: Path, exl3_dir: Path, variants, concurrency, budget_s, resume, paired=False
) -> Namespace:
    """run_matrix's arguments for Qwen3-8B dims."""
    return Namespace(
        out=out,
        work=exl3_dir.parent,
        presets=["qwen3-8b"],
        variants=variants,
        concurrency=concurrency,
        gpu_memory_utilization=None,
        budget_s=budget_s,
        resume=resume,
        prompt_waves=sb.PROMPT_WAVES,
        paired=paired,
    )


def _serve_the_fake(monkeypatch, tmp_path, mode: str) -> None:
    """`vllm serve` is the fake server in `mode`."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def command(v, port, memory, tokenizer) -> list[str]:
        return [sys.executable, str(script), str(port), mode]

    monkeypatch.setattr(sb, "serve_command", command)


def _fake_matrix(monkeypatch, tmp_path, exl3_dir) -> None:
    """run_matrix's servers are the fake server; _write_result_cmd writes its rows."""
    _serve_the_fake(monkeypatch, tmp_path, "ok")
    monkeypatch.setattr(sb, "ensure_checkpoint", lambda *a: exl3_dir)
    monkeypatch.setattr(sb, "bench_command", _write_result_cmd)
    monkeypatch.setattr(sb, "host_facts", lambda: {})


def test_matrix_resumes_against_a_fake_server(fake, exl3_dir, tmp_path, monkeypatch):
    """run_matrix for real (server start, /health, rows, stop, saving), with the fake
    server for `vllm serve` and a writer of recorded results for `vllm bench serve`:
    the rows of --resume are kept and not run again."""
    _fake_matrix(monkeypatch, tmp_path, exl3_dir)
    host = {"gpu": "GPU-A", "vllm": "0.26.0+exl3.new", "commit": "new", "torch": "2.11"}
    monkeypatch.setattr(sb, "host_facts", lambda: dict(host))
    earlier = {
        "tokenizer": sb.TOKENIZER_KIND,
        "host": {"gpu": "GPU-A", "vllm": "0.26.0+exl3.old", "commit": "old"},
        "rows": [
            {
                "preset": "qwen3-8b",
                "variant": "exl3",
                "concurrency": 1,
                "num_prompts": 8,
                "completed": 8,
                "failed": 0,
                "output_throughput": 7.0,
            }
        ],
    }
    resume = tmp_path / "earlier.json"
    resume.write_text(json.dumps(earlier))
    out = tmp_path / "out"
    args = _matrix_args(out, exl3_dir, ["exl3", "gptq"], [1, 4], 3600, resume)
    assert sb.run_matrix(args) == 0
    rows = json.loads((out / sb.RESULT_NAME).read_text())["rows"]
    got = {sb.row_key(r): r for r in rows}
    assert set(got) == {("qwen3-8b", v, c) for v in ("exl3", "gptq") for c in (1, 4)}
    assert got[("qwen3-8b", "exl3", 1)]["output_throughput"] == 7.0  # kept
    # Each row says where it was measured; the kept row keeps its own call's build.
    assert got[("qwen3-8b", "exl3", 1)]["commit"] == "old"
    for key in set(got) - {("qwen3-8b", "exl3", 1)}:
        assert {k: got[key].get(k) for k in ("gpu", "vllm", "commit", "torch")} == {
            "gpu": "GPU-A",
            "vllm": "0.26.0+exl3.new",
            "commit": "new",
            "torch": None,
        }
        assert got[key]["seed"] == sb.row_seed(*key)
        assert got[key]["output_throughput"] == float(got[key]["seed"])
        assert got[key]["kv_max_concurrency"] == 36.43
    # Nothing left: a second call starts no server and keeps every row.
    args.resume = out / sb.RESULT_NAME
    monkeypatch.setattr(sb, "Server", None)
    assert sb.run_matrix(args) == 0
    assert len(json.loads((out / sb.RESULT_NAME).read_text())["rows"]) == 4


def test_budget_leaves_rows_for_a_later_call(exl3_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "ensure_checkpoint", lambda *a: exl3_dir)
    monkeypatch.setattr(sb, "host_facts", lambda: {})
    monkeypatch.setattr(sb, "Server", None)  # must not start one
    args = _matrix_args(tmp_path / "out", exl3_dir, ["exl3"], [1, 64], 60, None)
    assert sb.run_matrix(args) == 1
    rec = json.loads((args.out / sb.RESULT_NAME).read_text())
    assert rec["rows"] == []
    assert rec["skipped"] == [
        "qwen3-8b exl3 c=1 (budget)",
        "qwen3-8b exl3 c=64 (budget)",
    ]


def test_budget_keeps_the_partner_rows(exl3_dir, tmp_path, monkeypatch):
    """--paired: past its first row, a server measures a row only if the later servers
    can still measure the same concurrency: the budget below holds exl3's two rows, or
    exl3's first and gptq's, not all four. gptq, the last server, uses what is left.
    Unpaired, exl3 measures both of its rows first."""
    _fake_matrix(monkeypatch, tmp_path, exl3_dir)
    # Estimates from an earlier call's fp8 rows (not run here): 100 s a start, 50 a row.
    earlier = [
        _row("qwen3-8b", "fp8", c, bench_s=50.0, server_ready_s=100.0) for c in (1, 4)
    ]
    resume = tmp_path / "earlier.json"
    resume.write_text(json.dumps({"tokenizer": sb.TOKENIZER_KIND, "rows": earlier}))
    start, row, stop = 100.0, 50.0, sb.STOP_MARGIN_S
    # exl3's c=4 needs its row plus gptq's start, stop and two rows; 10 s short of it.
    budget = stop + row + (start + stop + 2 * row) - 10
    assert budget >= start + row + stop  # each server's first row fits
    args = _matrix_args(
        tmp_path / "out",
        exl3_dir,
        ["exl3", "gptq"],
        [1, 4],
        budget,
        resume,
        paired=True,
    )
    assert sb.run_matrix(args) == 1
    rec = json.loads((args.out / sb.RESULT_NAME).read_text())
    got = {sb.row_key(r) for r in rec["rows"] if r["variant"] != "fp8"}
    assert got == {
        ("qwen3-8b", "exl3", 1),
        ("qwen3-8b", "gptq", 1),
        ("qwen3-8b", "gptq", 4),
    }
    assert rec["skipped"] == ["qwen3-8b exl3 c=4 (budget kept for the partner rows)"]
    # Unpaired (the fake rows take no time): all four.
    args.paired, args.resume, args.out = False, resume, tmp_path / "unpaired"
    assert sb.run_matrix(args) == 0
    rec = json.loads((args.out / sb.RESULT_NAME).read_text())
    assert len(rec["rows"]) == 6 and rec["skipped"] == []
    assert sb.partner_reserve_s(earlier, "qwen3-8b", [[1, 4], [4]], [1, 4]) == (
        2 * (start + stop) + 3 * row
    )
    assert sb.partner_reserve_s(earlier, "qwen3-8b", [[16]], [1, 4]) == 0


def _row(preset, variant, c, **kw) -> dict:
    """A row as run_matrix stores it (the bench fields of a recorded result)."""
    measured = {f: recorded_result()[f] for f in sb.BENCH_FIELDS}
    return {"preset": preset, "variant": variant, "concurrency": c, **measured, **kw}


def test_estimates_come_from_measured_rows(exl3_dir, tmp_path, monkeypatch):
    rows = [
        _row("qwen3-8b", "gptq", 64, bench_s=310.0, server_ready_s=95.0),
        _row("qwen3-8b", "bf16", 64, bench_s=250.0, server_ready_s=120.0),
        _row("qwen3-30b-a3b", "gptq", 1, bench_s=9.0),
    ]
    assert sb.estimate_row_s(rows, "qwen3-8b", 64) == 310.0
    assert sb.estimate_row_s(rows, "qwen3-8b", 1) == sb.EST_ROW_S[1]
    assert sb.estimate_row_s(rows, "qwen3-30b-a3b", 1) == 9.0
    assert sb.estimate_start_s(rows, "qwen3-8b") == 120.0
    assert sb.estimate_start_s(rows, "qwen3-30b-a3b") == sb.EST_SERVER_START_S
    # A budget the guesses would allow, but not the measured concurrency-64 row.
    monkeypatch.setattr(sb, "ensure_checkpoint", lambda *a: exl3_dir)
    monkeypatch.setattr(sb, "host_facts", lambda: {})
    monkeypatch.setattr(sb, "Server", None)  # must not start one
    resume = tmp_path / "earlier.json"
    resume.write_text(json.dumps({"tokenizer": sb.TOKENIZER_KIND, "rows": rows}))
    budget = sb.EST_SERVER_START_S + sb.EST_ROW_S[64] + sb.STOP_MARGIN_S + 20
    args = _matrix_args(tmp_path / "out", exl3_dir, ["exl3"], [64], budget, resume)
    assert sb.run_matrix(args) == 1
    rec = json.loads((args.out / sb.RESULT_NAME).read_text())
    assert rec["skipped"] == ["qwen3-8b exl3 c=64 (budget)"] and len(rec["rows"]) == 3


def _flat(n=60, base=70000.0, wobble=20.0):
    return [(10.0 * i, base + (wobble if i % 2 else 0.0)) for i in range(n)]


IDLE = {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0}


def _outcomes(failed=0):
    o = [sb.Outcome("ok", 1000, 100, 100) for _ in range(50)]
    o += [sb.Outcome("cancelled", 4000, 500) for _ in range(5)]
    o += [sb.Outcome("failed", 300, 64, 10, "HTTP 500") for _ in range(failed)]
    return o


def test_soak_verdicts():
    ok = sb.soak_verdicts(_outcomes(), _flat(), 600, True, True, IDLE)
    assert ok["passed"], ok
    assert ok["requests"] == {"ok": 50, "cancelled": 5, "failed": 0, "total": 55}
    assert ok["memory"]["spread_mib"] == 20.0

    failed = sb.soak_verdicts(_outcomes(failed=1), _flat(), 600, True, True, IDLE)
    assert not failed["passed"] and not failed["no_failed_request"]
    assert failed["failures"] == ["HTTP 500"]

    # Growth after warm-up: 10 MiB per sample, 480 MiB over the judged 48 samples.
    growing = [(t, m + 10.0 * i) for i, (t, m) in enumerate(_flat())]
    v = sb.soak_verdicts(_outcomes(), growing, 600, True, True, IDLE)
    assert not v["passed"] and not v["memory_flat"]
    # Growth during warm-up only (the first fifth) is allowed.
    warm = [(t, m + (2000.0 if t < 120 else 0.0)) for t, m in _flat()]
    assert sb.soak_verdicts(_outcomes(), warm, 600, True, True, IDLE)["memory_flat"]
    # Too few samples cannot show flatness.
    v = sb.soak_verdicts(_outcomes(), _flat(n=5), 600, True, True, IDLE)
    assert not v["memory_flat"] and "fewer than" in v["memory"]["why"]

    no_cancel = [o for o in _outcomes() if o.status != "cancelled"]
    assert not sb.soak_verdicts(no_cancel, _flat(), 600, True, True, IDLE)["passed"]
    assert not sb.soak_verdicts(_outcomes(), _flat(), 600, False, True, IDLE)["passed"]
    assert not sb.soak_verdicts(_outcomes(), _flat(), 600, True, False, IDLE)["passed"]
    busy = {**IDLE, "vllm:kv_cache_usage_perc": 0.02}
    assert not sb.soak_verdicts(_outcomes(), _flat(), 600, True, True, busy)["passed"]
    assert not sb.soak_verdicts(_outcomes(), _flat(), 600, True, True, {})["passed"]


def test_soak_client_against_a_fake_server(fake, monkeypatch):
    """The client for real: cancelled requests are cut and counted as cancelled, one
    answered short is a failure, the rest complete; it stops after its time."""
    monkeypatch.setattr(sb, "SOAK_CONCURRENCY", 4)
    monkeypatch.setattr(sb, "SOAK_INPUT", (8, 64))
    monkeypatch.setattr(sb, "SOAK_OUTPUT", (4, 8))
    monkeypatch.setattr(sb, "SOAK_CANCEL_FRACTION", 0.3)
    # The fake streams for 0.2 s: a cancel after 0.05-0.1 s always cuts.
    monkeypatch.setattr(sb, "SOAK_CANCEL_AFTER_S", (0.05, 0.1))
    monkeypatch.setenv("FAKE_FAIL_BELOW", "12")
    server = fake("ok")
    with server:
        server.wait_ready(timeout=30)
        t0 = time.monotonic()
        ids = sb.prompt_token_ids(TOKENIZER)
        outcomes = sb.asyncio.run(sb.soak_client(server.base, 2.0, 1, ids))
        assert time.monotonic() - t0 < 10
        assert sb.final_probe(server.base, ids)
    statuses = {s: sum(o.status == s for o in outcomes) for s in ("ok", "cancelled")}
    assert statuses["ok"] > 5 and statuses["cancelled"] > 2, statuses
    failed = [o for o in outcomes if o.status == "failed"]
    assert failed and all(o.input_len < 12 for o in failed)
    assert all("tokens, asked" in o.error for o in failed)
    assert all(o.input_len >= 12 for o in outcomes if o.status == "ok")


def _fake_soak(monkeypatch, tmp_path, exl3_dir, mode: str, memory) -> Namespace:
    """run_soak with the fake server for `vllm serve`, `memory(pids)` for nvidia-smi,
    and a two-second soak at concurrency 4."""
    _serve_the_fake(monkeypatch, tmp_path, mode)
    monkeypatch.setattr(sb, "ensure_checkpoint", lambda *a: exl3_dir)
    monkeypatch.setattr(sb, "model_tokenizer", lambda work, model: TOKENIZER)
    monkeypatch.setattr(sb, "host_facts", lambda: {})
    monkeypatch.setattr(sb, "gpu_memory_mib", memory)
    monkeypatch.setattr(sb, "MEMORY_SAMPLE_S", 0.05)
    monkeypatch.setattr(sb, "SOAK_CONCURRENCY", 4)
    monkeypatch.setattr(sb, "SOAK_INPUT", (16, 64))
    monkeypatch.setattr(sb, "SOAK_OUTPUT", (4, 8))
    monkeypatch.setattr(sb, "SOAK_CANCEL_FRACTION", 0.3)
    monkeypatch.setattr(sb, "SOAK_CANCEL_AFTER_S", (0.05, 0.1))
    return Namespace(
        out=tmp_path / "soak",
        work=exl3_dir.parent,
        gpu_memory_utilization=None,
        soak_s=2.0,
        seed=0,
    )


def test_run_soak_against_a_fake_server(exl3_dir, tmp_path, monkeypatch):
    """The whole soak (server start, client, memory sampler, /health, the last
    completion, /metrics, verdicts, the record) before a GPU lease spends ten minutes
    on it: it passes on a steady server and fails on a growing one."""
    # The server's own process group is what the sampler asks nvidia-smi about.
    seen: list[list[int]] = []

    def steady(pids):
        seen.append(pids)
        return 70000.0, "per-process"

    args = _fake_soak(monkeypatch, tmp_path, exl3_dir, "ok", steady)
    assert sb.run_soak(args) == 0
    rec = json.loads((args.out / sb.SOAK_RESULT_NAME).read_text())
    v = rec["verdicts"]
    assert v["passed"], v
    assert rec["ready_s"] > 0 and rec["duration_s"] >= 2.0
    assert rec["memory_source"] == "per-process"
    assert v["memory"]["judged"] >= sb.MIN_MEMORY_SAMPLES
    assert v["requests"]["ok"] > 0 and v["requests"]["cancelled"] > 0
    assert v["metrics_at_end"] == {
        "vllm:num_requests_running": 0.0,
        "vllm:kv_cache_usage_perc": 0.0,
    }
    assert seen and all(len(p) >= 2 for p in seen)  # the server and its child

    # 1 GiB more at every sample: not flat, so the soak fails (and says why).
    growth = iter(range(10**6))
    args = _fake_soak(
        monkeypatch,
        tmp_path,
        exl3_dir,
        "ok",
        lambda pids: (70000.0 + 1024.0 * next(growth), "whole-gpu"),
    )
    (args.out / sb.SOAK_RESULT_NAME).unlink()
    assert sb.run_soak(args) == 1
    v = json.loads((args.out / sb.SOAK_RESULT_NAME).read_text())["verdicts"]
    assert not v["passed"] and not v["memory_flat"] and v["no_failed_request"]

    # A server that never comes up: a record that says so, not a traceback.
    monkeypatch.setattr(sb, "SERVER_READY_TIMEOUT_S", 5)
    args = _fake_soak(monkeypatch, tmp_path, exl3_dir, "exit", steady)
    (args.out / sb.SOAK_RESULT_NAME).unlink()
    assert sb.run_soak(args) == 1
    rec = json.loads((args.out / sb.SOAK_RESULT_NAME).read_text())
    assert not rec["verdicts"]["passed"] and "error" in rec


def _soak_args(out: Path, budget: float = 0) -> Namespace:
    return Namespace(out=out, budget_s=budget)


def test_collect_and_detach_of_the_soak(tmp_path):
    out = tmp_path / "soak"
    out.mkdir()
    # Nothing started: an error naming the missing result.
    assert sb.collect_soak(_soak_args(out)) == 1
    # One still running past the budget: "collect again".
    sleeper = sb.subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / sb.SOAK_PIDFILE).write_text(str(sleeper.pid))
        assert sb.collect_soak(_soak_args(out)) == 3
        # A running soak is not started twice.
        assert sb.detach_soak(_soak_args(out), ["--soak", "--detach"]) == 0
        assert (out / sb.SOAK_PIDFILE).read_text() == str(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    for passed, rc in ((True, 0), (False, 1)):
        (out / sb.SOAK_RESULT_NAME).write_text(
            json.dumps({"verdicts": {"passed": passed, "metrics_at_end": {}}})
        )
        assert sb.collect_soak(_soak_args(out)) == rc
    # A finished soak is collected, not rerun, by repeating the step.
    assert sb.detach_soak(_soak_args(out), ["--soak", "--detach"]) == 0
    assert not (out / "soak.log").exists()
