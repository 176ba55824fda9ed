# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The `vllm-exl3` tool's series commands: `apply` (apply, re-apply, --check, --revert,
--replace and every refusal path) and the patch workflow (dev-tree, export-patches) on a
miniature sdist and wheel tree; `fetch` without the network; the series recorded in an
installed tree; and the real series on the real pinned vLLM 0.26.0 sdist and a
wheel-shaped copy of its package.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from minitree import MINI_SDIST, ROOT, git, make_series, run_tool, tree_hash, write_tree
from vllm_exl3.repo import SDIST_NAME, SDIST_SHA256, VLLM_VERSION

EXL3_INIT = "vllm/model_executor/layers/quantization/exl3/__init__.py"
STATE = ".vllm-exl3"


def test_apply_reapply_check_revert(mini_sdist, series):
    before = tree_hash(mini_sdist)

    check = run_tool("apply", "--check", mini_sdist, "--series", series.root)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "0001-envs-two-far-apart-hunks-a.patch: applies" in check.stdout
    assert "hunk 1 @@ -1,7 +1,7 @@: applies" in check.stdout
    assert "hunk 2 @@" in check.stdout
    assert "applies cleanly" in check.stdout
    assert tree_hash(mini_sdist) == before  # a dry run

    r = run_tool("apply", mini_sdist, "--series", series.root)
    assert r.returncode == 0, r.stderr
    for rel, expected in series.patched.items():
        assert (mini_sdist / rel).read_bytes() == expected, rel
    assert (mini_sdist / EXL3_INIT).read_text() == "# a\n"
    assert (mini_sdist / "tests/quantization/test_exl3_harness.py").is_file()
    assert (
        mini_sdist / "csrc/libtorch_stable/quantization/exl3/kernel.cu"
    ).read_text() == ("// kernel a\n")
    applied = tree_hash(mini_sdist)

    again = run_tool("apply", mini_sdist, "--series", series.root)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert tree_hash(mini_sdist) == applied

    same = run_tool("apply", "--replace", mini_sdist, "--series", series.root)
    assert same.returncode == 0 and "nothing to do" in same.stdout
    assert tree_hash(mini_sdist) == applied

    check_applied = run_tool("apply", "--check", mini_sdist, "--series", series.root)
    assert check_applied.returncode == 0 and "already applied" in check_applied.stdout

    rev = run_tool("apply", "--revert", mini_sdist, "--series", series.root)
    assert rev.returncode == 0, rev.stderr
    assert tree_hash(mini_sdist) == before
    assert not (mini_sdist / STATE).exists()

    nothing = run_tool("apply", "--revert", mini_sdist)
    assert nothing.returncode == 0 and "nothing to revert" in nothing.stdout


def test_revert_after_python_imported_added_modules(mini_sdist, series):
    before = tree_hash(mini_sdist)
    assert run_tool("apply", mini_sdist, "--series", series.root).returncode == 0
    # What importing the added modules leaves behind in an installed tree.
    pycs = [
        "vllm/__pycache__/exl3_new_module.cpython-311.pyc",
        "vllm/model_executor/layers/quantization/exl3/__pycache__/__init__.cpython-311.pyc",
    ]
    write_tree(mini_sdist, {p: "bytecode" for p in pycs})
    rev = run_tool("apply", "--revert", mini_sdist)
    assert rev.returncode == 0, rev.stderr
    assert not any((mini_sdist / p).exists() for p in pycs)
    assert not (mini_sdist / "vllm/model_executor/layers/quantization").exists()
    (mini_sdist / "vllm/__pycache__").rmdir()  # Python's own directory, left empty
    assert tree_hash(mini_sdist) == before


def _expect_refusal(tree: Path, series_root: Path, *needles: str) -> str:
    before = tree_hash(tree)
    r = run_tool("apply", tree, "--series", series_root)
    assert r.returncode == 1, r.stdout
    for n in needles:
        assert n in r.stderr, f"{n!r} not in:\n{r.stderr}"
    assert tree_hash(tree) == before, "a refused apply must not touch the tree"
    return r.stderr


def test_refuses_wrong_version(mini_sdist, series):
    (mini_sdist / "PKG-INFO").write_text(
        "Metadata-Version: 2.4\nName: vllm\nVersion: 0.25.1\n"
    )
    err = _expect_refusal(
        mini_sdist, series.root, "vLLM 0.25.1 (PKG-INFO)", "for vLLM 0.26.0"
    )
    assert "1 problem(s)" in err


def test_refuses_locally_modified_patched_file(mini_sdist, series):
    envs = mini_sdist / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("VAR_49 = 49", "VAR_49 = 'local edit'"))
    err = _expect_refusal(
        mini_sdist,
        series.root,
        "patch 0001-envs-two-far-apart-hunks-a.patch: vllm/envs.py: hunk 2 (@@ -48,6 "
        "+48,7 @@",
        "modified locally",
    )
    assert "hunk 1" not in err  # hunk 1 still applies and is not blamed
    check = run_tool("apply", "--check", mini_sdist, "--series", series.root)
    assert check.returncode == 1
    assert "hunk 1 @@ -1,7 +1,7 @@: applies" in check.stdout
    assert "hunk 2 @@ -48,6 +48,7 @@: FAILS" in check.stdout
    assert "does NOT apply" in check.stdout


def test_refuses_locally_modified_overlay_target(mini_sdist, series):
    write_tree(mini_sdist, {"vllm/exl3_new_module.py": "X = 'someone else'\n"})
    _expect_refusal(
        mini_sdist,
        series.root,
        "vllm/exl3_new_module.py: the tree already has this file with different "
        "content, not written by vllm-exl3",
    )


def test_refusal_lists_every_reason(mini_sdist, series):
    (mini_sdist / "PKG-INFO").write_text(
        "Metadata-Version: 2.4\nName: vllm\nVersion: 0.27.0\n"
    )
    envs = mini_sdist / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("VAR_2 = 2", "VAR_2 = 'x'"))
    (mini_sdist / "CMakeLists.txt").write_text("project(other)\n")
    write_tree(
        mini_sdist,
        {
            "vllm/exl3_new_module.py": "other\n",
            "csrc/libtorch_stable/quantization/exl3/kernel.cu": "// theirs\n",
        },
    )
    err = _expect_refusal(
        mini_sdist,
        series.root,
        "5 problem(s)",
        "the tree is vLLM 0.27.0",
        "vllm/envs.py: hunk 1",
        "0002-cmake-and-a-file-without-final-newline.patch: CMakeLists.txt: hunk 1",
        "vllm/exl3_new_module.py: the tree already has this file",
        "csrc/libtorch_stable/quantization/exl3/kernel.cu: the tree already has this "
        "file",
    )
    assert "vllm/tail.txt" not in err  # applies; not a reason


def test_refuses_patches_applied_outside_the_tool(mini_sdist, series):
    assert run_tool("apply", mini_sdist, "--series", series.root).returncode == 0
    shutil.rmtree(mini_sdist / STATE)
    _expect_refusal(
        mini_sdist, series.root, "already applied to this tree, but not by vllm-exl3"
    )


def test_refuses_missing_file(mini_sdist, series):
    (mini_sdist / "vllm/tail.txt").unlink()
    _expect_refusal(mini_sdist, series.root, "vllm/tail.txt is missing from the tree")


def test_revert_refuses_files_modified_after_apply(mini_sdist, series):
    before = tree_hash(mini_sdist)
    assert run_tool("apply", mini_sdist, "--series", series.root).returncode == 0
    (mini_sdist / "vllm/envs.py").write_text("edited\n")
    (mini_sdist / EXL3_INIT).write_text("edited\n")
    (mini_sdist / "vllm/exl3_new_module.py").unlink()
    edited = tree_hash(mini_sdist)
    r = run_tool("apply", "--revert", mini_sdist)
    assert r.returncode == 1
    for n in (
        "vllm/envs.py: modified after vllm-exl3 wrote it",
        f"{EXL3_INIT}: modified after vllm-exl3 wrote it",
        "vllm/exl3_new_module.py: written by vllm-exl3, now missing",
        "--force",
    ):
        assert n in r.stderr
    assert tree_hash(mini_sdist) == edited

    again = run_tool("apply", mini_sdist, "--series", series.root)
    assert again.returncode == 1 and "changed since" in again.stderr

    forced = run_tool("apply", "--revert", "--force", mini_sdist)
    assert forced.returncode == 0, forced.stderr
    assert tree_hash(mini_sdist) == before


def test_replace_swaps_an_older_series(tmp_path, mini_sdist, series):
    before = tree_hash(mini_sdist)
    newer = make_series(_pristine_copy(tmp_path), tmp_path / "series-b", variant="b")
    assert run_tool("apply", mini_sdist, "--series", series.root).returncode == 0

    plain = run_tool("apply", mini_sdist, "--series", newer.root)
    assert plain.returncode == 1 and "--replace" in plain.stderr

    check = run_tool("apply", "--check", mini_sdist, "--series", newer.root)
    assert check.returncode == 0 and "what --replace would do" in check.stdout

    r = run_tool("apply", "--replace", mini_sdist, "--series", newer.root)
    assert r.returncode == 0, r.stderr
    for rel, expected in newer.patched.items():
        assert (mini_sdist / rel).read_bytes() == expected
    assert (mini_sdist / EXL3_INIT).read_text() == "# b\n"

    assert run_tool("apply", "--revert", mini_sdist).returncode == 0
    assert tree_hash(mini_sdist) == before


def test_replace_refuses_when_new_series_does_not_apply(tmp_path, mini_sdist, series):
    other_base = _pristine_copy(tmp_path)
    envs = other_base / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("VAR_2 = 2", "VAR_2 = 'elsewhere'"))
    broken = make_series(other_base, tmp_path / "series-x", variant="x")
    assert run_tool("apply", mini_sdist, "--series", series.root).returncode == 0
    applied = tree_hash(mini_sdist)
    r = run_tool("apply", "--replace", mini_sdist, "--series", broken.root)
    assert r.returncode == 1 and "vllm/envs.py: hunk 1" in r.stderr
    assert tree_hash(mini_sdist) == applied  # the earlier application is left in place


def _pristine_copy(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "sdist-copy", MINI_SDIST)


def _mini_wheel_tree(root: Path, version: str = "0.26.0") -> Path:
    files = {k: v for k, v in MINI_SDIST.items() if k.startswith("vllm/")}
    files["vllm-0.26.0.dist-info/METADATA"] = (
        f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n"
    )
    files["other_package/__init__.py"] = ""
    return write_tree(root, files)


def test_wheel_tree_mode(tmp_path, series):
    site = _mini_wheel_tree(tmp_path / "site-packages")
    before = tree_hash(site)
    check = run_tool("apply", "--check", site, "--series", series.root)
    assert check.returncode == 0, check.stdout
    assert "CMakeLists.txt: skipped" in check.stdout
    r = run_tool("apply", site, "--series", series.root)
    assert r.returncode == 0, r.stderr
    assert "skipped csrc/ (1 files)" in r.stdout
    assert (
        "skipped 0002-cmake-and-a-file-without-final-newline.patch: CMakeLists.txt"
        in r.stdout
    )
    harness = "overlay/tests/quantization/test_exl3_harness.py"
    assert f"{harness}: outside the installed vllm/" in r.stdout
    assert not (site / "CMakeLists.txt").exists() and not (site / "csrc").exists()
    assert not (site / "tests").exists()
    assert (site / "vllm/envs.py").read_bytes() == series.patched["vllm/envs.py"]
    assert (site / "vllm/tail.txt").read_bytes() == series.patched["vllm/tail.txt"]
    assert (site / EXL3_INIT).is_file()
    assert run_tool("apply", "--revert", site).returncode == 0
    assert tree_hash(site) == before


def test_wheel_tree_refusals(tmp_path, series):
    ours = _mini_wheel_tree(tmp_path / "ours", version="0.26.0+exl3.1234abcd")
    _expect_refusal(ours, series.root, "is a vllm-exl3 build (0.26.0+exl3.1234abcd")
    two = _mini_wheel_tree(tmp_path / "two")
    write_tree(two, {"vllm-0.25.0.dist-info/METADATA": "Name: vllm\nVersion: 0.25.0\n"})
    _expect_refusal(two, series.root, "several vLLM installations' metadata")
    bare = write_tree(tmp_path / "bare", {"vllm/__init__.py": ""})
    _expect_refusal(bare, series.root, "cannot tell the vLLM version")


# The patch workflow: dev-tree (pristine base + `git am` of the series) and
# export-patches (`git format-patch` back into patches/), on a miniature tree.


def _dev_tree(base: Path, series_root: Path, dest: Path):
    return run_tool(
        "dev-tree", dest, "--base", base, "--series", series_root, "--label", "mini"
    )


def test_dev_tree_then_export_is_stable(tmp_path, mini_sdist, series):
    dev = tmp_path / "dev"
    r = _dev_tree(mini_sdist, series.root, dev)
    assert r.returncode == 0, r.stderr
    log = git(dev, "log", "--format=%s").splitlines()
    assert log == [
        "cmake and a file without final newline",
        "envs: two far-apart hunks (a)",
        "mini pristine",
    ]
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
    assert names == [
        "0001-envs-two-far-apart-hunks-a.patch",
        "0002-cmake-and-a-file-without-final-newline.patch",
    ]
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
        assert (again / "patches" / name).read_bytes() == (
            exported / "patches" / name
        ).read_bytes()
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
    assert (
        "patch 0002-cmake-and-a-file-without-final-newline.patch does not apply"
        in r.stderr
    )
    assert "git am --continue" in r.stderr
    assert (
        git(dev, "log", "-1", "--format=%s").strip() == "envs: two far-apart hunks (a)"
    )

    nonempty = write_tree(tmp_path / "nonempty", {"x": "y"})
    r = _dev_tree(mini_sdist, series.root, nonempty)
    assert r.returncode == 1 and "is not empty" in r.stderr


# `fetch` without the network: a cold cache offline, an unreachable index, a corrupt
# cached file, and a local (file://) index serving a file whose hash is not the pinned
# one.

# An index nobody listens on (port 9, "discard", is closed on ordinary machines).
UNREACHABLE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": ""}


def test_offline_cold_cache_says_so(tmp_path):
    r = run_tool("fetch", "--offline", "--cache-dir", tmp_path / "cache")
    assert r.returncode == 1
    assert "offline (--offline)" in r.stderr
    assert f"the cache has no copy of {SDIST_NAME}" in r.stderr
    assert SDIST_SHA256 in r.stderr
    assert "Traceback" not in r.stderr


def test_unreachable_index_cold_cache_says_so(tmp_path):
    r = run_tool("fetch", "--cache-dir", tmp_path / "cache", env=UNREACHABLE)
    assert r.returncode == 1
    assert "offline: the package index is unreachable" in r.stderr
    assert "127.0.0.1:9" in r.stderr
    assert f"the cache has no copy of {SDIST_NAME}" in r.stderr
    assert not list((tmp_path / "cache").rglob("*.part"))


def test_corrupt_cached_sdist_is_not_used(tmp_path):
    sdist = tmp_path / "cache/sdist" / SDIST_NAME
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(b"not the release")
    r = run_tool("fetch", "--offline", "--cache-dir", tmp_path / "cache")
    assert r.returncode == 1 and "corrupt (sha256 mismatch)" in r.stderr


def _local_index(root: Path, payload: bytes, with_hash: bool) -> str:
    files = root / "files"
    files.mkdir(parents=True)
    (files / SDIST_NAME).write_bytes(payload)
    frag = f"#sha256={hashlib.sha256(payload).hexdigest()}" if with_hash else ""
    page = root / "simple/vllm/index.html"
    page.parent.mkdir(parents=True)
    page.write_text(
        f'<html><body><a href="../../files/{SDIST_NAME}{frag}">'
        f"{SDIST_NAME}</a></body></html>"
    )
    return (root / "simple").as_uri()


def test_index_hash_differing_from_pin_is_refused(tmp_path):
    url = _local_index(tmp_path / "index", b"an impostor", with_hash=True)
    r = run_tool(
        "fetch",
        "--cache-dir",
        tmp_path / "cache",
        env={"PIP_INDEX_URL": url, "PIP_EXTRA_INDEX_URL": ""},
    )
    assert r.returncode == 1
    assert "but this repository pins" in r.stderr


def test_download_differing_from_pin_is_discarded(tmp_path):
    url = _local_index(
        tmp_path / "index", b"an impostor without a published hash", with_hash=False
    )
    r = run_tool(
        "fetch",
        "--cache-dir",
        tmp_path / "cache",
        env={"PIP_INDEX_URL": url, "PIP_EXTRA_INDEX_URL": ""},
    )
    assert r.returncode == 1
    assert f"expected {SDIST_SHA256}; the download was discarded" in r.stderr
    assert not (tmp_path / "cache/sdist" / SDIST_NAME).exists()
    assert not list((tmp_path / "cache").rglob("*.part"))


# The real series on the real pinned vLLM 0.26.0 sdist (fetched once into the cache):
# --check, apply, re-apply, revert to a byte-identical tree; and the same on a
# wheel-shaped copy of its Python package (CMake patch skipped).

PATCH_NAMES = sorted(p.name for p in (ROOT / "patches").glob("*.patch"))


@pytest.fixture(scope="module")
def pristine_sdist() -> Path:
    r = run_tool("fetch")
    if r.returncode != 0:
        if "unreachable" in r.stderr or "offline" in r.stderr:
            pytest.skip(
                "pinned sdist not cached and the index is unreachable: "
                f"{r.stderr.strip()}"
            )
        pytest.fail(r.stderr)
    return Path(r.stdout.strip().splitlines()[-1])


def test_series_on_real_sdist(tmp_path, pristine_sdist):
    tree = tmp_path / f"vllm-{VLLM_VERSION}"
    shutil.copytree(
        pristine_sdist,
        tree,
        symlinks=True,
        ignore=shutil.ignore_patterns(".vllm-exl3-unpacked"),
    )
    before = tree_hash(tree)

    check = run_tool("apply", "--check", tree)
    assert check.returncode == 0, check.stdout + check.stderr
    for name in PATCH_NAMES:
        assert f"patch {name}: applies" in check.stdout
    assert "FAILS" not in check.stdout

    r = run_tool("apply", tree)
    assert r.returncode == 0, r.stderr
    registry = (
        tree / "vllm/model_executor/layers/quantization/__init__.py"
    ).read_text()
    assert '"exl3",' in registry and '"exl3": Exl3Config' in registry
    assert "from .exl3 import Exl3Config" in registry
    assert '"VLLM_EXL3_LOG_PLANS":' in (tree / "vllm/envs.py").read_text()
    assert "EXL3_ARCHS" in (tree / "CMakeLists.txt").read_text()
    for f in (ROOT / "csrc").rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts:
            rel = f.relative_to(ROOT)  # the same path in both trees
            assert (tree / rel).read_bytes() == f.read_bytes()
    # The per-rate units the kernel generator writes at build time land beside them.
    exl3 = tree / "csrc/libtorch_stable/quantization/exl3"
    assert len(list(exl3.glob("exl3_rate_k*.cu"))) == 11
    assert "rate_kernels(int k2)" in (exl3 / "exl3_rate_table.cpp").read_text()

    again = run_tool("apply", tree)
    assert again.returncode == 0 and "nothing to do" in again.stdout

    rev = run_tool("apply", "--revert", tree)
    assert rev.returncode == 0, rev.stderr
    assert tree_hash(tree) == before


def test_series_on_real_wheel_shaped_tree(tmp_path, pristine_sdist):
    site = tmp_path / "site-packages"
    shutil.copytree(pristine_sdist / "vllm", site / "vllm")
    meta = site / f"vllm-{VLLM_VERSION}.dist-info/METADATA"
    meta.parent.mkdir()
    meta.write_text(f"Metadata-Version: 2.4\nName: vllm\nVersion: {VLLM_VERSION}\n")
    before = tree_hash(site)
    r = run_tool("apply", site)
    assert r.returncode == 0, r.stderr
    assert "CMakeLists.txt (not part of an installed wheel)" in r.stdout
    assert not (site / "csrc").exists()
    assert run_tool("apply", "--revert", site).returncode == 0
    assert tree_hash(site) == before
