# SPDX-License-Identifier: Apache-2.0
"""`apply` on a miniature sdist and wheel tree, with patches made by `git format-patch`: apply,
re-apply (no-op), --check, --revert (byte-identical), --replace and every refusal path."""

from __future__ import annotations

import shutil
from pathlib import Path

from minitree import MINI_SDIST, make_series, run_tool, tree_hash, write_tree

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
    assert (mini_sdist / "csrc/libtorch_stable/quantization/exl3/kernel.cu").read_text() == (
        "// kernel a\n")
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
    pycs = ["vllm/__pycache__/exl3_new_module.cpython-311.pyc",
            "vllm/model_executor/layers/quantization/exl3/__pycache__/__init__.cpython-311.pyc"]
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
    (mini_sdist / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.25.1\n")
    err = _expect_refusal(mini_sdist, series.root, "vLLM 0.25.1 (PKG-INFO)", "for vLLM 0.26.0")
    assert "1 problem(s)" in err


def test_refuses_locally_modified_patched_file(mini_sdist, series):
    envs = mini_sdist / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("VAR_49 = 49", "VAR_49 = 'local edit'"))
    err = _expect_refusal(
        mini_sdist, series.root,
        "patch 0001-envs-two-far-apart-hunks-a.patch: vllm/envs.py: hunk 2 (@@ -48,6 +48,7 @@",
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
    _expect_refusal(mini_sdist, series.root,
                    "vllm/exl3_new_module.py: the tree already has this file with different "
                    "content, not written by vllm-exl3")


def test_refusal_lists_every_reason(mini_sdist, series):
    (mini_sdist / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.27.0\n")
    envs = mini_sdist / "vllm/envs.py"
    envs.write_text(envs.read_text().replace("VAR_2 = 2", "VAR_2 = 'x'"))
    (mini_sdist / "CMakeLists.txt").write_text("project(other)\n")
    write_tree(mini_sdist, {"vllm/exl3_new_module.py": "other\n",
                            "csrc/libtorch_stable/quantization/exl3/kernel.cu": "// theirs\n"})
    err = _expect_refusal(
        mini_sdist, series.root,
        "5 problem(s)",
        "the tree is vLLM 0.27.0",
        "vllm/envs.py: hunk 1",
        "0002-cmake-and-a-file-without-final-newline.patch: CMakeLists.txt: hunk 1",
        "vllm/exl3_new_module.py: the tree already has this file",
        "csrc/libtorch_stable/quantization/exl3/kernel.cu: the tree already has this file",
    )
    assert "vllm/tail.txt" not in err  # applies; not a reason


def test_refuses_patches_applied_outside_the_tool(mini_sdist, series):
    assert run_tool("apply", mini_sdist, "--series", series.root).returncode == 0
    shutil.rmtree(mini_sdist / STATE)
    _expect_refusal(mini_sdist, series.root, "already applied to this tree, but not by vllm-exl3")


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
    for n in ("vllm/envs.py: modified after vllm-exl3 wrote it",
              f"{EXL3_INIT}: modified after vllm-exl3 wrote it",
              "vllm/exl3_new_module.py: written by vllm-exl3, now missing", "--force"):
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
        f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n")
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
    assert "skipped 0002-cmake-and-a-file-without-final-newline.patch: CMakeLists.txt" in r.stdout
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
