# SPDX-License-Identifier: Apache-2.0
"""The patch workflow: dev-tree (pristine base + `git am` of the series) and export-patches
(`git format-patch` back into patches/), on a miniature tree."""

from __future__ import annotations

import shutil
from pathlib import Path

from minitree import git, run_tool, write_tree


def _dev_tree(base: Path, series_root: Path, dest: Path):
    return run_tool("dev-tree", dest, "--base", base, "--series", series_root, "--label", "mini")


def test_dev_tree_then_export_is_stable(tmp_path, mini_sdist, series):
    dev = tmp_path / "dev"
    r = _dev_tree(mini_sdist, series.root, dev)
    assert r.returncode == 0, r.stderr
    log = git(dev, "log", "--format=%s").splitlines()
    assert log == ["cmake and a file without final newline", "envs: two far-apart hunks (a)",
                   "mini pristine"]
    assert git(dev, "status", "--porcelain") == ""
    for rel, expected in series.patched.items():
        assert (dev / rel).read_bytes() == expected

    exported = tmp_path / "exported"
    (exported / "patches").mkdir(parents=True)
    (exported / "patches/9999-stale.patch").write_text("old series\n")
    e = run_tool("export-patches", dev, "--series", exported)
    assert e.returncode == 0, e.stderr
    assert "removed: 9999-stale.patch" in e.stdout
    names = sorted(p.name for p in (exported / "patches").glob("*.patch"))
    assert names == ["0001-envs-two-far-apart-hunks-a.patch",
                     "0002-cmake-and-a-file-without-final-newline.patch"]
    first = (exported / "patches/0001-envs-two-far-apart-hunks-a.patch").read_text()
    assert first.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Why: test." in first

    # Round trip: a dev tree from the exported series exports the same bytes.
    dev2 = tmp_path / "dev2"
    assert _dev_tree(mini_sdist, exported, dev2).returncode == 0
    again = tmp_path / "again"
    (again / "patches").mkdir(parents=True)
    assert run_tool("export-patches", dev2, "--series", again).returncode == 0
    for name in names:
        assert (again / "patches" / name).read_bytes() == (exported / "patches" / name).read_bytes()
    same = run_tool("export-patches", dev2, "--series", again)
    assert "added 0, changed 0, removed 0" in same.stdout


def test_export_picks_up_a_new_commit(tmp_path, mini_sdist, series):
    dev = tmp_path / "dev"
    assert _dev_tree(mini_sdist, series.root, dev).returncode == 0
    (dev / "vllm/__init__.py").write_text("__version__ = '0.26.0'\nEXL3 = True\n")
    git(dev, "commit", "-q", "-am", "init: a third patch\n\nWhy: test. Upstream: no.")
    out = tmp_path / "out"
    (out / "patches").mkdir(parents=True)
    e = run_tool("export-patches", dev, "--series", out)
    assert e.returncode == 0 and "3 patch(es); added 3" in e.stdout
    assert (out / "patches/0003-init-a-third-patch.patch").is_file()


def test_export_refusals(tmp_path, mini_sdist, series):
    dev = tmp_path / "dev"
    assert _dev_tree(mini_sdist, series.root, dev).returncode == 0
    (dev / "vllm/envs.py").write_text("uncommitted\n")
    r = run_tool("export-patches", dev, "--series", series.root)
    assert r.returncode == 1 and "uncommitted changes" in r.stderr
    plain = write_tree(tmp_path / "plain", {"a.txt": "x\n"})
    r = run_tool("export-patches", plain, "--series", series.root)
    assert r.returncode == 1 and "not a dev tree" in r.stderr


def test_dev_tree_stops_at_a_patch_that_does_not_apply(tmp_path, mini_sdist, series):
    base = tmp_path / "other-base"
    shutil.copytree(mini_sdist, base)
    (base / "CMakeLists.txt").write_text("project(other)\n")
    dev = tmp_path / "dev"
    r = _dev_tree(base, series.root, dev)
    assert r.returncode == 1
    assert "patch 0002-cmake-and-a-file-without-final-newline.patch does not apply" in r.stderr
    assert "git am --continue" in r.stderr
    assert git(dev, "log", "-1", "--format=%s").strip() == "envs: two far-apart hunks (a)"

    nonempty = write_tree(tmp_path / "nonempty", {"x": "y"})
    r = _dev_tree(mini_sdist, series.root, nonempty)
    assert r.returncode == 1 and "is not empty" in r.stderr
