# SPDX-License-Identifier: Apache-2.0
"""The real series on the real pinned vLLM 0.26.0 sdist (fetched once into the cache): --check,
apply, re-apply, revert to a byte-identical tree; and the same on a wheel-shaped copy of its
Python package (CMake patch skipped)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from minitree import ROOT, run_tool, tree_hash
from vllm_exl3 import pins

PATCH_NAMES = sorted(p.name for p in (ROOT / "patches").glob("*.patch"))


@pytest.fixture(scope="module")
def pristine_sdist() -> Path:
    r = run_tool("fetch")
    if r.returncode != 0:
        if "unreachable" in r.stderr or "offline" in r.stderr:
            pytest.skip(f"pinned sdist not cached and the index is unreachable: {r.stderr.strip()}")
        pytest.fail(r.stderr)
    return Path(r.stdout.strip().splitlines()[-1])


def test_series_on_real_sdist(tmp_path, pristine_sdist):
    tree = tmp_path / f"vllm-{pins.VLLM_VERSION}"
    shutil.copytree(pristine_sdist, tree, symlinks=True,
                    ignore=shutil.ignore_patterns(".vllm-exl3-unpacked"))
    before = tree_hash(tree)

    check = run_tool("apply", "--check", tree)
    assert check.returncode == 0, check.stdout + check.stderr
    for name in PATCH_NAMES:
        assert f"patch {name}: applies" in check.stdout
    assert "FAILS" not in check.stdout

    r = run_tool("apply", tree)
    assert r.returncode == 0, r.stderr
    registry = (tree / "vllm/model_executor/layers/quantization/__init__.py").read_text()
    assert '"exl3",' in registry and '"exl3": Exl3Config' in registry
    assert "from .exl3 import Exl3Config" in registry
    assert '"VLLM_EXL3_LOG_PLANS":' in (tree / "vllm/envs.py").read_text()
    assert "EXL3_ARCHS" in (tree / "CMakeLists.txt").read_text()
    for f in (ROOT / "csrc").rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts:
            rel = f.relative_to(ROOT / "csrc")
            assert (tree / "csrc/libtorch_stable" / rel).read_bytes() == f.read_bytes()

    again = run_tool("apply", tree)
    assert again.returncode == 0 and "nothing to do" in again.stdout

    rev = run_tool("apply", "--revert", tree)
    assert rev.returncode == 0, rev.stderr
    assert tree_hash(tree) == before


def test_series_on_real_wheel_shaped_tree(tmp_path, pristine_sdist):
    site = tmp_path / "site-packages"
    shutil.copytree(pristine_sdist / "vllm", site / "vllm")
    meta = site / f"vllm-{pins.VLLM_VERSION}.dist-info/METADATA"
    meta.parent.mkdir()
    meta.write_text(f"Metadata-Version: 2.4\nName: vllm\nVersion: {pins.VLLM_VERSION}\n")
    before = tree_hash(site)
    r = run_tool("apply", site)
    assert r.returncode == 0, r.stderr
    assert "CMakeLists.txt (not part of an installed wheel)" in r.stdout
    assert not (site / "csrc").exists()
    assert run_tool("apply", "--revert", site).returncode == 0
    assert tree_hash(site) == before
