# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Repository hygiene: every Python file passes pyflakes, the lint configuration accepts
good code and rejects bad, the user-facing documents (README, docs) stay short, name
only files that exist and document exactly the settings vLLM's envs.py declares, the
patches name only sources that exist, and every statement of the GPUs the kernels are
built for agrees with the build's.
"""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _pyflakes():
    """pyflakes' check and Reporter. The pinned environment has it; a GPU host running
    `pytest -m gpu tests` may not, and must still collect this module."""
    api = pytest.importorskip("pyflakes.api")
    return api.check, pytest.importorskip("pyflakes.reporter").Reporter


README = ROOT / "README.md"
README_LIMIT = 5000  # characters: a page a user reads before installing
DOCS = [
    README,
    ROOT / "scripts" / "README.md",
    ROOT / "scripts" / "bench" / "README.md",
    ROOT / "scripts" / "e2e" / "README.md",
    ROOT / "patches" / "README.md",
    ROOT / "overlay" / "docs" / "features" / "quantization" / "exl3.md",
    ROOT / "overlay" / "docs" / "features" / "quantization" / "exl3_dgx_spark.md",
    ROOT / "docker" / "README.md",
    ROOT / "overlay" / "docs" / "design" / "exl3_format.md",
    ROOT / "overlay" / "docs" / "design" / "exl3_kernels.md",
]
# A repository path in backticks: starts at a top-level folder of the tree.
PATH_RE = re.compile(r"`((?:ci|csrc|docker|overlay|patches|scripts|tests)/[^`\s*<>]+)`")


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8"))
    assert n <= README_LIMIT, f"README.md has {n} characters (limit {README_LIMIT})"


def _in_repository(path: str) -> bool:
    """Whether a path a document names is a file or folder of this repository: csrc/ is
    laid out as in the vLLM tree, and the overlay's pages, which live in that tree, may
    name the overlay's files by their path there."""
    path = path.rstrip("/.,")
    return (ROOT / path).exists() or (ROOT / "overlay" / path).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_name_existing_files_only(doc):
    text = doc.read_text(encoding="utf-8")
    missing = [p for p in PATH_RE.findall(text) if not _in_repository(p)]
    assert not missing, f"{doc.name} names files that are not in the tree: {missing}"


# Our sources as a patch names them (its message and its added lines): the CMake globs,
# csrc/ folders and files, the overlay's exl3 modules. vLLM's own files are not ours.
PATCH_SOURCE_RE = re.compile(r"\bcsrc/[\w./*{},-]+|\bvllm/[\w./-]*exl3[\w./-]*")


def _expand_braces(pattern: str) -> list[str]:
    """'a.{cuh,cu}' -> ['a.cuh', 'a.cu'] (glob has no braces)."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


@pytest.mark.parametrize(
    "patch", sorted((ROOT / "patches").glob("*.patch")), ids=lambda p: p.name[:4]
)
def test_patches_name_existing_sources(patch):
    text = patch.read_text(encoding="utf-8")
    message, _, diff = text.partition("\ndiff --git ")
    added = "\n".join(line for line in diff.splitlines() if line.startswith("+"))
    missing = [
        name
        for name in PATCH_SOURCE_RE.findall(message + "\n" + added)
        for pattern in _expand_braces(name.rstrip("/.,;"))
        if not any(
            itertools.chain(ROOT.glob(pattern), (ROOT / "overlay").glob(pattern))
        )
    ]
    assert not missing, f"{patch.name} names sources not in the tree: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_name_no_session_or_call(doc):
    text = doc.read_text(encoding="utf-8")
    found = re.findall(r"(?i)\bsession\w*|\bcall ?\d+|\bcalls \d", text)
    assert not found, f"{doc.name}: {found}"


def test_readme_settings_are_the_declared_ones():
    """The settings table lists every VLLM_EXL3_* variable the envs patch declares,
    and no other."""
    table = set(
        re.findall(
            r"^\| `(VLLM_EXL3_\w+)` \|", README.read_text(encoding="utf-8"), re.M
        )
    )
    patch = next((ROOT / "patches").glob("*envs*.patch")).read_text(encoding="utf-8")
    declared = set(re.findall(r'^\+\s+"(VLLM_EXL3_\w+)":', patch, re.M))
    assert declared, "no VLLM_EXL3_* declaration found in the envs patch"
    assert table == declared, {
        "undocumented": sorted(declared - table),
        "not declared": sorted(table - declared),
    }


# The lint configuration is vLLM 0.26's, and the SPDX check tells a good header from a
# bad one.

from vllm_exl3 import build, kernels_build, repo  # noqa: E402

HEADER = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)


def _vllm_sdist() -> Path:
    tree = repo.default_cache_dir() / "src" / "vllm-0.26.0"
    if not (tree / "pyproject.toml").is_file():
        pytest.skip("no vLLM 0.26.0 sdist in the cache (scripts/vllm-exl3 fetch)")
    return tree


def test_ruff_rules_are_vllms():
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    theirs = tomllib.loads((_vllm_sdist() / "pyproject.toml").read_text())["tool"][
        "ruff"
    ]
    for key in ("select", "ignore"):
        assert ours["lint"][key] == theirs["lint"][key], key
    assert ours["format"] == theirs["format"]
    assert "line-length" not in ours  # ruff's default, 88, as vLLM


def test_clang_format_is_vllms():
    ours = (ROOT / ".clang-format").read_text()
    assert ours == (_vllm_sdist() / ".clang-format").read_text()


@pytest.mark.parametrize(
    "text, ok",
    [
        (HEADER + "x = 1\n", True),
        ("#!/usr/bin/env python3\n" + HEADER + "x = 1\n", True),
        ("", True),
        ("# SPDX-License-Identifier: Apache-2.0\nx = 1\n", False),
        ("x = 1\n" + HEADER, False),
    ],
)
def test_spdx_check(tmp_path, text, ok):
    f = tmp_path / "m.py"
    f.write_text(text)
    r = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "check_spdx.py"), str(f)],
        capture_output=True,
        text=True,
    )
    assert (r.returncode == 0) == ok, r.stdout


def test_ci_test_names_the_lint_step():
    """ci/test.sh names the lint step (disabled until the formatting pass lands)."""
    text = (ROOT / "ci" / "test.sh").read_text()
    assert "bash ci/lint.sh" in text


# Every Python file of the repository passes pyflakes: no undefined names, unused
# imports or redefinitions. The GPU benchmarks and device scripts never run in CI, so
# this is what catches a name left behind by a refactor there before a device call finds
# it (bench_linear.py crashed at its first row from fed6495 to 85994cc on an undefined
# `n_copies`).

REPO = Path(__file__).resolve().parents[2]
# Python files without the .py suffix.
SCRIPTS = ("scripts/vllm-exl3",)


def python_files() -> list[Path]:
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "*.py", *SCRIPTS],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [REPO / f for f in tracked]


class _Collect:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines.append(text)

    def flush(self) -> None:
        pass


def test_every_python_file_passes_pyflakes() -> None:
    files = python_files()
    assert len(files) > 50 and (REPO / "scripts/bench/bench_linear.py") in files, files[
        :5
    ]
    check, Reporter = _pyflakes()
    out, err = _Collect(), _Collect()
    reporter = Reporter(out, err)
    problems = sum(
        check(f.read_text(), str(f.relative_to(REPO)), reporter) for f in files
    )
    assert problems == 0 and not err.lines, "".join(out.lines + err.lines)


def test_the_lint_sees_an_undefined_name() -> None:
    check, Reporter = _pyflakes()
    out = _Collect()
    assert (
        check(
            "def f():\n    return {'copies': n_copies}\n",
            "probe.py",
            Reporter(out, _Collect()),
        )
        == 1
    )
    assert "undefined name 'n_copies'" in "".join(out.lines)


# The GPUs: the CMake patch's EXL3_ARCHS (what the full build compiles), the quick
# build's BUILT_ARCHS / TARGET_ARCHS and `build`'s default, the lowest compute
# capability the quantization method accepts, README's and the user guide's GPU rows
# and the sparse-MLA backend's list say the same. Read as text: nothing here imports
# vLLM.

BUILT = kernels_build.BUILT_ARCHS
UNTUNED = set(BUILT) - set(kernels_build.TARGET_ARCHS)
EXL3_PACKAGE = ROOT / "overlay/vllm/model_executor/layers/quantization/exl3"
USER_GUIDE = ROOT / "overlay/docs/features/quantization/exl3.md"
SPARSE_MLA_BACKEND = ROOT / "overlay/vllm/v1/attention/backends/mla/exl3_mla_sparse.py"
# Where a GPU row turns from the architectures the kernels are tuned for to those that
# are only built.
UNTUNED_MARK = "Also built"


def _cmake_archs() -> list[str]:
    patch = next((ROOT / "patches").glob("*-cmake-*.patch")).read_text()
    (archs,) = re.findall(r'^\+\s+"([0-9.;af]+)" "\$\{CUDA_ARCHS\}"\)', patch, re.M)
    return archs.split(";")


def _min_capabilities() -> set[int]:
    """The literal every get_min_capability of the EXL3 package returns, and every
    MIN_CAPABILITY constant of it; 0 (the reference kernels: no GPU feature) aside."""
    found = set()
    for module in EXL3_PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "get_min_capability":
                found |= {
                    r.value.value
                    for r in ast.walk(node)
                    if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant)
                }
            elif (
                isinstance(node, ast.Assign)
                and any(
                    getattr(t, "id", None) == "MIN_CAPABILITY" for t in node.targets
                )
                and isinstance(node.value, ast.Constant)
            ):
                found.add(node.value.value)
    return found - {0}


def _gpu_row(text: str) -> tuple[set[str], set[str]]:
    """The architectures of a support table's first GPUs row (sm_121 or SM 12.1 ->
    '121'): all of them, and those after UNTUNED_MARK."""
    row = re.search(r"^\| GPUs \|(.*)\|$", text, re.M).group(1)

    def archs(part: str) -> set[str]:
        return set(re.findall(r"\bsm_(\d+)", part)) | {
            major + minor for major, minor in re.findall(r"\bSM (\d+)\.(\d)", part)
        }

    return archs(row), archs(row.partition(UNTUNED_MARK)[2])


def test_built_architectures_are_the_cmake_patchs():
    assert sorted(set(BUILT.values())) == sorted(_cmake_archs())
    for arch, entry in BUILT.items():
        major, minor = kernels_build.dotted(arch).split(".")
        e_major, e_minor = entry.rstrip("af").split(".")
        if entry.endswith("f"):  # a family image: the same major, from its minor on
            assert major == e_major and int(minor) >= int(e_minor), (arch, entry)
        else:  # a plain or arch-specific image runs on its own architecture
            assert (major, minor) == (e_major, e_minor), (arch, entry)


def test_min_capability_is_the_lowest_built_architecture():
    assert _min_capabilities() == {min(int(a) for a in BUILT)}


def test_quick_build_refuses_an_architecture_not_built():
    assert set(kernels_build.TARGET_ARCHS) <= set(BUILT)
    default = build.DEFAULT_ARCHS.split(";")
    assert {kernels_build.normalize_arch(a) for a in default} == set(
        kernels_build.TARGET_ARCHS
    )
    with pytest.raises(kernels_build.BuildError, match=r"built for 8\.0, 8\.6"):
        kernels_build.normalize_arch("7.5")


@pytest.mark.parametrize("doc", [README, USER_GUIDE], ids=lambda p: p.name)
def test_documented_gpus_are_the_built_ones(doc):
    listed, untuned = _gpu_row(doc.read_text(encoding="utf-8"))
    assert listed == set(BUILT), sorted(listed ^ set(BUILT))
    assert untuned == UNTUNED, sorted(untuned ^ UNTUNED)


def test_sparse_mla_backend_archs_are_built():
    text = SPARSE_MLA_BACKEND.read_text()
    archs = set(
        re.findall(
            r"\bsm_(\d+)", re.search(r"^BUILT_ARCHS = (.*)$", text, re.M).group(1)
        )
    )
    assert archs and archs <= set(BUILT), archs
