# SPDX-License-Identifier: Apache-2.0
"""`build` (quick path) on a miniature release wheel: the series applied in wheel-tree mode, the
kernel module added, the version labelled, RECORD regenerated; and its refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from minitree import ROOT, check_record, make_wheel, run_tool
from vllm_exl3.build import _REQUIREMENTS_PROBE

MINI_WHEEL_FILES = {
    "vllm/__init__.py": "__version__ = '0.26.0'\n",
    "vllm/envs.py": "".join(f"VAR_{i} = {i}\n" for i in range(60)),
    "vllm/tail.txt": "line one\nno newline at end",
    "vllm/_C_stable_libtorch.abi3.so": os.urandom(3000),
}


@pytest.fixture
def mini_wheel(tmp_path: Path) -> Path:
    return make_wheel(tmp_path / "release", MINI_WHEEL_FILES)


def _build(tmp_path: Path, wheel: Path, series_root: Path, *extra: str | Path):
    return run_tool("build", "--wheel", wheel, "--series", series_root, "--dist-dir",
                    tmp_path / "dist", "--work-dir", tmp_path / "work", *extra)


def test_quick_build_without_kernels(tmp_path, mini_wheel, series):
    r = _build(tmp_path, mini_wheel, series.root, "--no-kernels")
    assert r.returncode == 0, r.stderr
    (out,) = (tmp_path / "dist").glob("*.whl")
    assert out.name.startswith("vllm-0.26.0+exl3.") and ".nokernels-" in out.name
    assert out.name.endswith("-cp38-abi3-manylinux_2_28_x86_64.whl")
    version = out.name.split("-")[1]
    contents = check_record(out)
    assert f"Version: {version}\n".encode() in contents[f"vllm-{version}.dist-info/METADATA"]
    assert contents["vllm/envs.py"] == series.patched["vllm/envs.py"]
    assert contents["vllm/tail.txt"] == series.patched["vllm/tail.txt"]
    assert "vllm/exl3_new_module.py" in contents
    assert "vllm/_exl3_C.abi3.so" not in contents
    assert contents["vllm/_C_stable_libtorch.abi3.so"] == MINI_WHEEL_FILES[
        "vllm/_C_stable_libtorch.abi3.so"]
    assert not any(n.startswith((".vllm-exl3", "csrc/", "CMakeLists", "tests/")) for n in contents)
    with zipfile.ZipFile(out) as zf:
        assert (zf.getinfo("vllm/_C_stable_libtorch.abi3.so").external_attr >> 16) & 0o111
    assert list(zf.namelist())[-1].endswith("/RECORD")
    assert not (tmp_path / "work/wheel-tree").exists()


def test_quick_build_with_a_kernel_module(tmp_path, mini_wheel, series):
    so = tmp_path / "_exl3_C.abi3.so"
    so.write_bytes(b"\x7fELF kernels")
    r = _build(tmp_path, mini_wheel, series.root, "--kernels-so", so)
    assert r.returncode == 0, r.stderr
    (out,) = (tmp_path / "dist").glob("*.whl")
    assert "nokernels" not in out.name
    assert check_record(out)["vllm/_exl3_C.abi3.so"] == b"\x7fELF kernels"


def test_build_refusals(tmp_path, mini_wheel, series):
    other = make_wheel(tmp_path / "other", MINI_WHEEL_FILES, version="0.25.0")
    r = _build(tmp_path, other, series.root, "--no-kernels")
    assert r.returncode == 1 and "is vLLM 0.25.0" in r.stderr

    files = dict(MINI_WHEEL_FILES, **{"vllm/envs.py": "VAR_0 = 'changed'\n"})
    changed = make_wheel(tmp_path / "changed", files)
    r = _build(tmp_path, changed, series.root, "--no-kernels")
    assert r.returncode == 1 and "vllm/envs.py: hunk 1" in r.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


def test_build_without_the_kernel_build_module(tmp_path, mini_wheel, series):
    scripts = tmp_path / "scripts"
    shutil.copytree(ROOT / "scripts", scripts,
                    ignore=shutil.ignore_patterns("kernels_build.py", "__pycache__"))
    cmd = [sys.executable, str(scripts / "vllm-exl3"), "build", "--wheel", str(mini_wheel),
           "--series", str(series.root), "--dist-dir", str(tmp_path / "dist"),
           "--work-dir", str(tmp_path / "work"), "--python", sys.executable]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1
    assert "kernels_build.py) is missing" in r.stderr and "--no-kernels" in r.stderr
    r = subprocess.run(cmd + ["--no-kernels"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_from_source_requirement_check():
    """--from-source checks the interpreter against vLLM's [build-system] requirements before
    starting an hours-long build; the check names each unmet requirement."""
    have = version("pytest")  # any installed distribution will do
    reqs = ["definitely-not-installed-exl3", f"pytest<{have}", f"pytest=={have}"]
    r = subprocess.run([sys.executable, "-c", _REQUIREMENTS_PROBE, json.dumps(reqs)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [
        "definitely-not-installed-exl3: not installed",
        f"pytest<{have}: {have} installed",
    ]
