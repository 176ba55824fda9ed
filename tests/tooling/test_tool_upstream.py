# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm-exl3 series`: the concern map's accounting of every source and patch, the
pull requests written from a miniature series (deterministic, applying in order), the
dev tree's adaptations exported and rebuilt, and the real series on the pinned vLLM
0.34.0 sdist (fetched into the cache once; skipped offline with a cold cache)."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from minitree import git, run_tool, tree_hash
from vllm_exl3 import ToolError
from vllm_exl3.repo import UPSTREAM_VERSION
from vllm_exl3.upstream import (
    UpstreamSeries,
    apply_in_order,
    build_dev_tree,
    export_dev_tree,
    read_dev_tree,
    write_series,
)
from vllm_exl3.upstream_checks import check_pristine

MAP = """
base = "0.34.0"
author = "test <test@localhost>"
date = "Sun, 6 Dec 2026 18:00:00 +0000"

[relocate]
"csrc/libtorch_stable/" = "csrc/"

[[concern]]
name = "envs-fix"
patches = ["0001"]

[[concern]]
name = "feature"
patches = ["0002"]
sources = ["overlay/vllm/*", "csrc/libtorch_stable/*"]
subject = "[Feature] the new module"
body = "Why: test."

[left_out]
"overlay/tests/quantization/test_exl3_harness.py" = "this project's own harness"
"""
LABELS = ("01-envs-fix", "02-feature")


def write_map(root: Path, text: str = MAP) -> UpstreamSeries:
    folder = root / "patches" / "0.34.0"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "series.toml").write_text(text)
    for label in LABELS:
        (folder / label).mkdir(exist_ok=True)
        (folder / label / "PR.md").write_text(f"# {label}\n")
    return UpstreamSeries.load(root, "0.34.0")


def test_map_assigns_and_relocates_every_source(series):
    us = write_map(series.root)
    assert [c.label for c in us.concerns] == list(LABELS)
    feature = us.sources["02-feature"]
    assert sorted(us.dest(f) for f in feature) == [
        "csrc/quantization/exl3/kernel.cu",
        "vllm/exl3_new_module.py",
        "vllm/model_executor/layers/quantization/exl3/__init__.py",
    ]
    assert us.sources["01-envs-fix"] == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: m.replace(
                '"overlay/tests/quantization/test_exl3_harness.py" = ', "# "
            ),
            "overlay/tests/quantization/test_exl3_harness.py: no concern carries it",
        ),
        (
            lambda m: m.replace('"csrc/libtorch_stable/*"]', '"csrc/*", "csrc/x/*"]'),
            "concern feature: source pattern csrc/x/* matches nothing",
        ),
        (
            lambda m: m.replace(
                'patches = ["0001"]\n',
                'patches = ["0001"]\nsources = ["overlay/vllm/exl3_new_module.py"]\n'
                'subject = "[Fix] also the module"\n',
            ),
            "claimed by",
        ),
        (
            lambda m: m.replace('patches = ["0001"]', 'patches = ["0002"]'),
            "patch 0001: neither in a concern nor [superseded]",
        ),
        (
            lambda m: m + '\n[superseded]\n"0009" = "gone"\n',
            "0009 (concern or [superseded]) is not a patch of the series",
        ),
    ],
)
def test_map_refuses_what_it_does_not_account_for(series, edit, message):
    with pytest.raises(ToolError, match=re.escape(message)):
        write_map(series.root, edit(MAP))


def _written(us: UpstreamSeries, base: Path, where: Path) -> Path:
    dev = where / "dev"
    build_dev_tree(us, dev, base)
    write_series(us, dev, where / "out")
    return where / "out"


def test_series_applies_in_order_and_rewrites_the_same_bytes(
    tmp_path, mini_sdist, series
):
    us = write_map(series.root)
    out = _written(us, mini_sdist, tmp_path / "a")
    again = _written(us, mini_sdist, tmp_path / "b")
    assert tree_hash(out) == tree_hash(again)
    names = {
        p.name: sorted(q.name for q in p.glob("*.patch"))
        for p in out.iterdir()
        if p.is_dir()
    }
    assert names == {
        "01-envs-fix": ["0001-envs-two-far-apart-hunks-a.patch"],
        "02-feature": [
            "0001-cmake-and-a-file-without-final-newline.patch",
            "0002-Feature-the-new-module.patch",
        ],
    }
    sources = (out / "02-feature/0002-Feature-the-new-module.patch").read_text()
    assert sources.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Date: Sun, 6 Dec 2026 18:00:00 +0000" in sources
    assert "b/csrc/quantization/exl3/kernel.cu" in sources
    assert "test_exl3_harness" not in sources
    assert (out / "02-feature/PR.md").read_text() == "# 02-feature\n"
    assert "| 02-feature |" in (out / "README.md").read_text()

    tree = tmp_path / "tree"
    shutil.copytree(mini_sdist, tree)
    results = apply_in_order(out, tree)
    assert [(label, error) for label, _, error in results] == [
        ("01-envs-fix", ""),
        ("02-feature", ""),
    ]
    for rel, expected in series.patched.items():
        assert (tree / rel).read_bytes() == expected
    assert (tree / "csrc/quantization/exl3/kernel.cu").read_text() == "// kernel a\n"


def test_a_set_that_no_longer_applies_is_named(tmp_path, mini_sdist, series):
    us = write_map(series.root)
    out = _written(us, mini_sdist, tmp_path)
    tree = tmp_path / "tree"
    shutil.copytree(mini_sdist, tree)
    (tree / "vllm/envs.py").write_text("VAR_3 = 'moved'\n")
    ((label, names, error),) = apply_in_order(out, tree)
    assert label == "01-envs-fix" and names == []
    assert error.startswith("0001-envs-two-far-apart-hunks-a.patch: ")


def test_adaptations_export_and_rebuild_the_same_tree(tmp_path, mini_sdist, series):
    us = write_map(series.root)
    dev = tmp_path / "dev"
    build_dev_tree(us, dev, mini_sdist)
    (sources,) = [
        c.sources for c in read_dev_tree(us, dev) if c.concern.name == "feature"
    ]
    # An adaptation of the feature's sources, between its markers.
    git(dev, "reset", "-q", "--hard", sources)
    (dev / "vllm/exl3_new_module.py").write_text("X = 'adapted'\n")
    git(dev, "commit", "-q", "-am", "exl3: adapt the module\n\nWhy: the new release.")
    git(dev, "commit", "-q", "--allow-empty", "-m", "series: 02-feature end")
    report = export_dev_tree(us, dev)
    assert report == [
        "patches/0.34.0/02-feature/adapt/0001-exl3-adapt-the-module.patch"
    ]

    rebuilt = tmp_path / "rebuilt"
    build_dev_tree(UpstreamSeries.load(series.root, "0.34.0"), rebuilt, mini_sdist)
    assert git(rebuilt, "rev-parse", "HEAD^{tree}") == git(
        dev, "rev-parse", "HEAD^{tree}"
    )
    out = tmp_path / "out"
    write_series(us, rebuilt, out)
    squashed = (out / "02-feature/0002-Feature-the-new-module.patch").read_text()
    assert "+X = 'adapted'" in squashed and "adapt the module" not in squashed


def test_a_new_commit_outside_the_markers_is_refused(tmp_path, mini_sdist, series):
    us = write_map(series.root)
    dev = tmp_path / "dev"
    build_dev_tree(us, dev, mini_sdist)
    (dev / "vllm/tail.txt").write_text("late\n")
    git(dev, "commit", "-q", "-am", "a late change")
    with pytest.raises(ToolError, match="commits after the last concern"):
        export_dev_tree(us, dev)


# The real series on vLLM 0.34.0.


@pytest.fixture(scope="module")
def upstream_sdist() -> Path:
    r = run_tool("fetch", "--version", UPSTREAM_VERSION)
    if r.returncode != 0:
        if "unreachable" in r.stderr or "offline" in r.stderr:
            pytest.skip(
                f"vLLM {UPSTREAM_VERSION} sdist not cached and the index is "
                f"unreachable: {r.stderr.strip()}"
            )
        pytest.fail(r.stderr)
    return Path(r.stdout.strip().splitlines()[-1])


def test_real_series_applies_on_the_pristine_release(tmp_path, upstream_sdist):
    out = tmp_path / "out"
    r = run_tool("series", "--out", out, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    us = UpstreamSeries.load()
    for c in us.concerns:
        assert f"check: {c.label}: " in r.stdout
        assert (out / c.label / "PR.md").is_file()
    assert r.stdout.count(" applies") == len(us.concerns), r.stdout
    assert "FAILS" not in r.stdout


def _fake_env(root: Path) -> tuple[Path, Path]:
    """A "venv" whose python sees one installed vllm distribution with a RECORD."""
    site = root / "site"
    (site / "vllm").mkdir(parents=True)
    files = {"vllm/__init__.py": b"", "vllm/envs.py": b"A = 1\n"}
    record = []
    for rel, data in files.items():
        (site / rel).write_bytes(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
        record.append(f"{rel},sha256={digest.rstrip(b'=').decode()},{len(data)}")
    info = site / "vllm-0.34.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n"
    )
    record.append("vllm-0.34.0.dist-info/RECORD,,")
    (info / "RECORD").write_text("\n".join(record) + "\n")
    python = root / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    os.chmod(python, 0o755)
    return root / "venv", site


def test_series_tests_refuse_an_environment_edited_in_place(tmp_path):
    venv, site = _fake_env(tmp_path)
    check_pristine(venv)  # as installed
    (site / "vllm" / "envs.py").write_text("A = 2\n")
    (site / "vllm" / "exl3.py").write_text("")
    (site / "vllm" / "__pycache__").mkdir()
    (site / "vllm" / "__pycache__" / "envs.cpython-311.pyc").write_bytes(b"")
    with pytest.raises(ToolError) as e:
        check_pristine(venv)
    assert "in 2 file(s)" in str(e.value)
    assert "modified:vllm/envs.py" in str(e.value)
    assert "unlisted:vllm/exl3.py" in str(e.value)
