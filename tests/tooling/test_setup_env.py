# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ci/setup-env.sh as a newcomer meets it: one variable moves the whole cache, the
environment's path is keyed by the script's hash (checkouts at different commits keep
their own), the tool finds the same path, and the CUDA libraries are pinned where torch
2.11.0 pins them."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "setup-env.sh"
sys.path.insert(0, str(ROOT / "scripts"))
from vllm_exl3 import repo  # noqa: E402

# torch 2.11.0 names the cuda-toolkit metapackage at this version; the script spells out
# the versions that metapackage's extras pin (read from cuda_toolkit-13.0.2's METADATA).
CUDA_TOOLKIT = "13.0.2"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_EXL3_VENV", "VLLM_EXL3_WHEELS", "VLLM_EXL3_CACHE")
    }
    env.update(VLLM_EXL3_CACHE=str(tmp_path / "cache"), **extra)
    return env


def _setup(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cache_variable_moves_the_environment_and_the_tool_agrees(
    tmp_path, monkeypatch
):
    stamp = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:16]
    r = _setup(tmp_path, "--path")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "cache" / f"venv-{stamp}")
    monkeypatch.delenv("VLLM_EXL3_VENV", raising=False)
    monkeypatch.setenv("VLLM_EXL3_CACHE", str(tmp_path / "cache"))
    assert repo.default_venv() == Path(r.stdout.strip())
    assert repo.default_venv(tmp_path / "other") == tmp_path / "other" / f"venv-{stamp}"


def test_clean_keeps_the_current_environment_only(tmp_path):
    current = Path(_setup(tmp_path, "--path").stdout.strip())
    other = current.with_name("venv-0123456789abcdef")
    legacy = current.with_name("venv")
    for d in (current, other, legacy):
        (d / "bin").mkdir(parents=True)
    r = _setup(tmp_path, "--clean")
    assert r.returncode == 0, r.stderr
    assert current.is_dir() and not other.exists() and not legacy.exists()


def test_a_complete_environment_is_reused_without_touching_it(tmp_path):
    venv = Path(_setup(tmp_path, "--path").stdout.strip())
    stamp = venv.name.removeprefix("venv-")
    (venv / "bin").mkdir(parents=True)
    (venv / f".exl3-env-{stamp}").touch()
    r = _setup(tmp_path, VLLM_EXL3_PYTHON=sys.executable)
    assert r.returncode == 0 and "reusing" in r.stdout, r.stdout + r.stderr


def test_unknown_argument_is_refused(tmp_path):
    r = _setup(tmp_path, "--bogus")
    assert r.returncode == 2 and "unknown argument" in r.stderr


def _script_pins() -> dict[str, str]:
    return dict(re.findall(r"\b(nvidia-[a-z0-9-]+)==([0-9.]+)", SCRIPT.read_text()))


def test_cuda_libraries_are_pinned_at_torchs_own_pins():
    """The pins torch 2.11.0's wheel names directly must be the script's."""
    wheels = sorted((repo.default_cache_dir() / "wheels").glob("torch-2.11.0-*.whl"))
    if not wheels:
        pytest.skip("no torch 2.11.0 wheel in the cache (ci/setup-env.sh downloads it)")
    with zipfile.ZipFile(wheels[0]) as z:
        meta = z.read("torch-2.11.0.dist-info/METADATA").decode()
    requires = re.findall(r"^Requires-Dist: (\S+)==([^;\s]+)", meta, re.M)
    direct = {name: version for name, version in requires if name.startswith("nvidia-")}
    assert direct, "torch's METADATA names no nvidia-* pins"
    pins = _script_pins()
    assert {n: pins.get(n) for n in direct} == direct
    assert (
        dict(requires).get(next(n for n, _ in requires if n.startswith("cuda-toolkit")))
        == CUDA_TOOLKIT
    )


def test_no_cuda_library_is_left_unpinned():
    text = SCRIPT.read_text()
    named = set(re.findall(r"\b(nvidia-[a-z0-9-]+)(?:==|\s|$)", text))
    assert named <= set(_script_pins()), sorted(named - set(_script_pins()))
