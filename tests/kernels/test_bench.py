# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmark's host-side logic (scripts/bench/): the speed-of-light decode term of
bench_linear.py and the ExLlamaV3 anchor guard of exllamav3_anchor.py, on stand-ins.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from vllm_exl3.bench import bench_linear, bench_moe, exllamav3_anchor

# The 4-bit MCG k loop at BM = 16 as sass_loop.py counts it, and an H200's measured
# ceilings (device_ceilings.py).
LOOP = {
    "per_stage": 198.75,
    "per_weight": 6.2109375,
    "by_pipe": {"alu": 90.25, "fma": 76.75, "lsu": 19.0, "tensor": 8.0},
}
CEIL = {
    "copy_bytes_per_s": 3.98e12,
    "bf16_flops": 7.43e14,
    "mma_flops": 6.33e14,
    "int_instr_per_s": 1.604e13,
    "issue_instr_per_s": 132 * 4 * 32 * 1.98e9,
}


def test_decode_term_takes_the_slower_of_issue_and_the_busiest_pipe():
    s = bench_linear.decode_s_per_weight(LOOP, CEIL)
    issue = 6.2109375 / CEIL["issue_instr_per_s"]
    alu = 90.25 / 32 / CEIL["int_instr_per_s"]
    assert s == pytest.approx(max(issue, alu))
    # An ALU-heavy mix of the same length is bound by the pipe, not by issue.
    heavy = {**LOOP, "by_pipe": {"alu": 150.0, "fma": 20.0}}
    assert bench_linear.decode_s_per_weight(heavy, CEIL) == pytest.approx(
        150.0 / 32 / CEIL["int_instr_per_s"]
    )
    assert bench_linear.decode_s_per_weight(None, CEIL) is None


def test_sol_of_the_small_m_shape_is_the_decode_and_stays_below_the_measured_time():
    # 5120 x 12288, m = 1: measured 24.1 us in that run (bench_ours); the bound must be
    # lower.
    sol = bench_linear.sol_us(5120, 12288, 1, 4.0, CEIL, LOOP)
    assert 5120 * 12288 * bench_linear.decode_s_per_weight(
        LOOP, CEIL
    ) * 1e6 == pytest.approx(sol)
    assert sol < 24.1
    # Without the loop counts only bytes and matrix work remain.
    assert bench_linear.sol_us(5120, 12288, 1, 4.0, CEIL, None) < sol


def test_the_ratio_to_bf16_uses_the_faster_of_the_two_bf16_timings():
    rows = [
        {"m": 1, "ours_us": 30.0, "bf16_us": 40.0, "ratio_bf16": 0.75},
        {"m": 4096, "ours_us": 1100.0, "bf16_us": 950.0, "ratio_bf16": 1.158},
    ]
    bench_linear.rebase_on_second_bf16(rows, {1: 41.0, 4096: 900.0})
    assert rows[0]["bf16_us"] == 40.0 and rows[0]["ratio_bf16"] == 0.75
    assert rows[1]["bf16_us"] == 900.0 and rows[1]["ratio_bf16"] == pytest.approx(
        1100 / 900, 1e-3
    )
    assert (rows[1]["bf16_first_us"], rows[1]["bf16_second_us"]) == (950.0, 900.0)


def test_model_shapes_are_timed_as_the_loader_lays_them_out():
    """--models times each distinct kernel run of the models (fused shards kept as
    shards, so the plan key and the EXL3 call are vLLM's), --shapes the bench's own."""
    ns = argparse.Namespace(models=["qwen3-8b"], tp=[1], shapes=None)
    runs = bench_linear.bench_shapes(ns)
    by_kn = {(k, sum(w)): w for k, w, _ in runs}
    # Qwen3-8B: hidden 4096, 32 query heads and 8 KV heads of 128, MLP 12288.
    assert by_kn[(4096, 4096 + 2 * 1024)] == (4096, 1024, 1024)
    assert by_kn[(4096, 2 * 12288)] == (12288, 12288)
    assert (12288, 4096) in by_kn
    assert all(k % 128 == 0 and all(x % 128 == 0 for x in w) for k, w, _ in runs)
    ns = argparse.Namespace(models=None, tp=[1], shapes=["4096x11008"])
    assert bench_linear.bench_shapes(ns) == [(4096, (11008,), "bench")]


def test_every_call_runs_eagerly_before_the_graph_is_captured(monkeypatch):
    """graph_time_us warms each closure, not a sample: state read on a weight set's
    first eager call (the MoE kernel class's bitrate table, one per layer copy) must
    never be first read under capture, where the layer launches every rate."""
    events = []
    calls = [lambda j=j: events.append(("call", j)) for j in range(5)]

    class Graph:
        def replay(self):
            events.append(("replay", None))

    def capture(cs):
        events.append(("capture", None))
        return Graph()

    monkeypatch.setattr(bench_linear, "settle", lambda m: None)
    monkeypatch.setattr(bench_linear, "capture", capture)
    monkeypatch.setattr(bench_linear.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(
        bench_linear.device_ceilings, "median_ms", lambda run, n: (run(), 1.0)[1]
    )
    us, mode = bench_linear.graph_time_us(calls, m=1)
    first_capture = events.index(("capture", None))
    assert {j for kind, j in events[:first_capture] if kind == "call"} == set(range(5))
    assert mode == "graph" and us == 1e3 / 5


def test_split_sweep_entries_are_both_gemms_or_a_gate_up_by_down_pair(tmp_path: Path):
    """bench_moe.py --split-sweep: "S" is S x S (row exl3_splitS), "GxD" cuts gate/up
    G ways and down D ways (row exl3_splitGxD); anything else stops the parse."""
    entry = bench_moe.split_entry
    assert entry("3") == ("3", 3, 3)
    assert entry("3x1") == ("3x1", 3, 1)
    assert entry("1X2") == ("1x2", 1, 2)
    assert entry("2x2").label != entry("2").label
    for bad in ("0", "2x0", "x2", "2x", "2x1x1", "-1", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="GxD"):
            entry(bad)
    with pytest.raises(SystemExit):
        bench_moe.main(["--out", str(tmp_path), "--split-sweep", "2", "3x"])


def test_kernel_profile_sums_each_kernel_per_call():
    """bench_moe.py --profile: a kernel launched several times a call (one per rate)
    counts once per call with its summed time; longest first."""
    got = bench_moe.aggregate_kernels(
        [("gemm", 10.0), ("transform", 2.0), ("gemm", 6.0), ("gemm", 12.0)], calls=2
    )
    assert got == [("gemm", 14.0), ("transform", 1.0)]
    assert bench_moe.aggregate_kernels([], calls=3) == []


# The benchmark's ExLlamaV3 anchor guard (scripts/bench/exllamav3_anchor.py), on a
# stand-in.
#
# A fake `exllamav3` package plays the JIT build (ext.py) and the import
# (modules/quant/exl3.py): the background build writes its done-file, a leftover torch
# `lock` is removed before the import, an import that never finishes fails with the
# reason after its timeout instead of hanging, and a failed build is reported with its
# exit status. Each load runs in a fresh interpreter because the guard imports into
# sys.modules.


# The stand-in import blocks while a torch-style lock exists, as torch's FileBaton does.
FAKE_EXL3 = """
import os, time
lock = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "exllamav3_ext", "lock")
while os.path.exists(lock) or os.environ.get("FAKE_HANG"):
    time.sleep(0.05)
class LinearEXL3:
    pass
"""
# The stand-in build leaves a lock behind (an earlier import killed mid-build) and exits
# rc.
FAKE_EXT = """
import os, sys
d = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "exllamav3_ext")
os.makedirs(d, exist_ok=True)
open(os.path.join(d, "lock"), "w").close()
assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
sys.exit(int(os.environ.get("FAKE_BUILD_RC", "0")))
"""


def make_state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    pkg = state / "site" / "exllamav3"
    (pkg / "modules" / "quant").mkdir(parents=True)
    for d in (pkg, pkg / "modules", pkg / "modules" / "quant"):
        (d / "__init__.py").write_text("")
    (pkg / "ext.py").write_text(FAKE_EXT)
    (pkg / "modules" / "quant" / "exl3.py").write_text(FAKE_EXL3)
    return state


def load_in_subprocess(
    state: Path, env: dict[str, str] | None = None, import_timeout: float = 5
) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        from vllm_exl3.bench import exllamav3_anchor as a
        try:
            cls = a.load_linear_class(__import__("pathlib").Path({str(state)!r}), 20,
                                      {import_timeout})
            print("LOADED", cls.__name__)
        except a.AnchorUnavailable as e:
            print("UNAVAILABLE", e)
    """)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_background_build_then_guarded_import(tmp_path: Path) -> None:
    state = make_state(tmp_path)
    assert exllamav3_anchor.start_build(state, jobs=2)
    assert not exllamav3_anchor.start_build(state, jobs=2)  # once per machine
    assert exllamav3_anchor.wait_built(state, timeout_s=30) == 0
    assert list((state / "torch_ext").rglob("lock")), "the stand-in build leaves a lock"
    r = load_in_subprocess(state)
    assert "LOADED LinearEXL3" in r.stdout, r.stdout + r.stderr
    assert "removed stale torch build locks" in r.stderr
    assert not list((state / "torch_ext").rglob("lock"))


def test_import_that_never_finishes_times_out_with_reason(tmp_path: Path) -> None:
    state = make_state(tmp_path)
    exllamav3_anchor.start_build(state, jobs=2)
    assert exllamav3_anchor.wait_built(state, timeout_s=30) == 0
    r = load_in_subprocess(state, env={"FAKE_HANG": "1"}, import_timeout=1)
    assert "UNAVAILABLE import of ExLlamaV3 did not finish in 1 s" in r.stdout, (
        r.stdout + r.stderr
    )
    assert "TORCH_CUDA_ARCH_LIST=9.0" in r.stdout


def test_failed_build_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = make_state(tmp_path)
    monkeypatch.setenv("FAKE_BUILD_RC", "3")
    exllamav3_anchor.start_build(state, jobs=2)
    assert exllamav3_anchor.wait_built(state, timeout_s=30) == 3
    r = load_in_subprocess(state)
    assert "UNAVAILABLE ExLlamaV3 build failed (exit 3)" in r.stdout, (
        r.stdout + r.stderr
    )


def test_no_build_started(tmp_path: Path) -> None:
    r = load_in_subprocess(make_state(tmp_path))
    assert "UNAVAILABLE no ExLlamaV3 build was started" in r.stdout, r.stdout + r.stderr


# `prebuild` on a stand-in wheel: its ext.py plays torch's JIT build (the module written
# into TORCH_EXTENSIONS_DIR, then the import that fails without a driver); its __init__
# fails if imported, as the real one would pull in the whole library.
FAKE_WHEEL_EXT = """
import os
assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
assert os.environ["FAKE_INCLUDE"] in os.environ["CPATH"].split(os.pathsep)
d = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "exllamav3_ext")
assert not os.path.exists(os.path.join(d, "lock")), "a stale lock blocks the build"
if os.environ.get("FAKE_COMPILE_ERROR"):
    raise RuntimeError("nvcc fatal: cannot find cusolverDn.h")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "exllamav3_ext.so"), "wb") as f:
    f.write(b"\\x7fELF stand-in module")
raise ImportError("libcuda.so.1: cannot open shared object file")
"""


def make_wheel(tmp_path: Path) -> Path:
    wheel = tmp_path / "exllamav3-1.6.5-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("exllamav3/__init__.py", "raise SystemExit('imported the library')")
        z.writestr("exllamav3/ext.py", FAKE_WHEEL_EXT)
        z.writestr("exllamav3/util/__init__.py", "")
    return wheel


def test_prebuild_then_install_into_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    include = tmp_path / "include"
    include.mkdir()
    monkeypatch.setenv("FAKE_INCLUDE", str(include))
    out = tmp_path / "prebuilt"
    # Left by a prebuild that was killed: torch's build would wait on it forever.
    (out / "torch_ext" / "exllamav3_ext").mkdir(parents=True)
    (out / "torch_ext" / "exllamav3_ext" / "lock").write_text("")
    argv = ["prebuild", "--wheel", str(make_wheel(tmp_path)), "--out", str(out)]
    assert exllamav3_anchor.main([*argv, "--include", str(include), "--jobs", "2"]) == 0
    manifest = json.loads((out / "exllamav3_ext.json").read_text())
    assert manifest["exllamav3"] == "1.6.5"
    assert {k: manifest[k] for k in ("python", "torch", "arch_list")} == (
        exllamav3_anchor.ext_abi()
    )
    module = (out / "exllamav3_ext.so").read_bytes()
    assert manifest["sha256"] == hashlib.sha256(module).hexdigest()
    # Installed packed (as it travels) into a state's site/, where ext.py finds it; the
    # build then starts as usual.
    (out / "exllamav3_ext.so.xz").write_bytes(lzma.compress(module))
    (out / "exllamav3_ext.so").unlink()
    state = make_state(tmp_path)
    argv = ["build", "--state", str(state), "--prebuilt", str(out), "--jobs", "2"]
    assert exllamav3_anchor.main(argv) == 0
    assert (state / "site" / "exllamav3_ext.so").read_bytes() == module
    assert exllamav3_anchor.wait_built(state, timeout_s=30) == 0


def test_prebuild_that_writes_no_module_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_INCLUDE", str(tmp_path))
    monkeypatch.setenv("FAKE_COMPILE_ERROR", "1")
    with pytest.raises(exllamav3_anchor.AnchorUnavailable, match="cusolverDn.h"):
        exllamav3_anchor.prebuild(make_wheel(tmp_path), tmp_path / "o", 2, [tmp_path])
    missing = tmp_path / "exllamav3-1.6.5-py3-none-any.whl.gone"
    with pytest.raises(exllamav3_anchor.AnchorUnavailable, match="no such file"):
        exllamav3_anchor.prebuild(missing, tmp_path / "o", 2, [])
    with pytest.raises(exllamav3_anchor.AnchorUnavailable, match="not an exllamav3"):
        exllamav3_anchor.prebuild(tmp_path / "other.whl", tmp_path / "o", 2, [])


def test_prebuilt_for_another_interpreter_or_corrupt_is_refused(
    tmp_path: Path,
) -> None:
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    module = b"\x7fELF stand-in module"
    (prebuilt / "exllamav3_ext.so").write_bytes(module)
    abi = exllamav3_anchor.ext_abi()
    manifest = {**abi, "sha256": hashlib.sha256(module).hexdigest()}
    state = tmp_path / "state"

    def install(**changes):
        (prebuilt / "exllamav3_ext.json").write_text(
            json.dumps({**manifest, **changes})
        )
        return exllamav3_anchor.install_prebuilt(state, prebuilt)

    with pytest.raises(exllamav3_anchor.AnchorUnavailable, match=r"python 3\.99"):
        install(python="3.99")
    with pytest.raises(exllamav3_anchor.AnchorUnavailable, match="torch 2.0.0"):
        install(torch="2.0.0")
    with pytest.raises(exllamav3_anchor.AnchorUnavailable, match="does not match"):
        install(sha256="0" * 64)
    assert not (state / "site" / "exllamav3_ext.so").exists()
    assert install().read_bytes() == module
    (prebuilt / "exllamav3_ext.json").unlink()
    with pytest.raises(exllamav3_anchor.AnchorUnavailable, match="no exllamav3_ext"):
        exllamav3_anchor.install_prebuilt(state, prebuilt)
    # The command reports it and exits nonzero, starting no build.
    argv = ["build", "--state", str(state), "--prebuilt", str(prebuilt)]
    assert exllamav3_anchor.main(argv) == 1
    assert not (state / "build.started").exists()
