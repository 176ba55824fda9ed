# SPDX-License-Identifier: Apache-2.0
"""The benchmark's ExLlamaV3 anchor guard (scripts/bench/exllamav3_anchor.py), on a stand-in.

A fake `exllamav3` package plays the JIT build (ext.py) and the import (modules/quant/exl3.py):
the background build writes its done-file, a leftover torch `lock` is removed before the
import, an import that never finishes fails with the reason after its timeout instead of
hanging, and a failed build is reported with its exit status. Each load runs in a fresh
interpreter because the guard imports into sys.modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"
sys.path.insert(0, str(BENCH))
import exllamav3_anchor  # noqa: E402

# The stand-in import blocks while a torch-style lock exists, as torch's FileBaton does.
FAKE_EXL3 = """
import os, time
lock = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "exllamav3_ext", "lock")
while os.path.exists(lock) or os.environ.get("FAKE_HANG"):
    time.sleep(0.05)
class LinearEXL3:
    pass
"""
# The stand-in build leaves a lock behind (an earlier import killed mid-build) and exits rc.
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


def load_in_subprocess(state: Path, env: dict[str, str] | None = None,
                       import_timeout: float = 5) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(BENCH)!r})
        import exllamav3_anchor as a
        try:
            cls = a.load_linear_class(__import__("pathlib").Path({str(state)!r}), 20,
                                      {import_timeout})
            print("LOADED", cls.__name__)
        except a.AnchorUnavailable as e:
            print("UNAVAILABLE", e)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


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
    assert "UNAVAILABLE import of ExLlamaV3 did not finish in 1 s" in r.stdout, r.stdout + r.stderr
    assert "TORCH_CUDA_ARCH_LIST=9.0" in r.stdout


def test_failed_build_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make_state(tmp_path)
    monkeypatch.setenv("FAKE_BUILD_RC", "3")
    exllamav3_anchor.start_build(state, jobs=2)
    assert exllamav3_anchor.wait_built(state, timeout_s=30) == 3
    r = load_in_subprocess(state)
    assert "UNAVAILABLE ExLlamaV3 build failed (exit 3)" in r.stdout, r.stdout + r.stderr


def test_no_build_started(tmp_path: Path) -> None:
    r = load_in_subprocess(make_state(tmp_path))
    assert "UNAVAILABLE no ExLlamaV3 build was started" in r.stdout, r.stdout + r.stderr
