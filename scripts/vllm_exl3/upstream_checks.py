# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`series --lint` and `--test`: what vLLM's CI would ask of each pull request of the
upstream series, run here set by set on a git checkout of the pristine release.

Each set is applied with `git am` onto the sets before it. `--lint` runs the release's
own .pre-commit-config.yaml on the files the set adds or modifies, through pre-commit
itself, with every hook made local (precommit_local.py: the same tools at the pinned
versions, installed by ci/setup-env-upstream.sh, since GitHub is unreachable here).
`--test` runs the set's test files (tests/**/test_*.py it adds or modifies) in that
environment: the installed vLLM wheel of the release with the set's Python files laid
over a linked copy of it, from a copy of the tree's tests/ (vLLM's conftest), as vLLM's
CI runs its tests against the built package.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import ToolError
from .fetch import copy_sdist_tree
from .patches import _git
from .repo import ROOT, default_cache_dir
from .upstream import UpstreamSeries, pull_request_folders

SETUP = ROOT / "ci" / "setup-env-upstream.sh"
# The tools the remote hooks need, looked for in the environment's bin/.
HOOK_TOOLS = (
    "ruff",
    "typos",
    "clang-format",
    "markdownlint-cli2",
    "shellcheck",
    "check-json",
)
# The environment holding exactly the mypy hook's additional_dependencies.
MYPY_HOOK_ENV = "mypy-hook"
# How precommit_local.py names a hook it has no tool for.
NO_LOCAL_TOOL = "(no local tool)"
# The fixture checkpoints the EXL3 tests read (EXL3_TEST_MODELS_DIR).
FIXTURES = ROOT / "tests" / "fixtures" / "qwen3-tiny"
_HOOK_LINE = re.compile(
    r"^(?P<name>.+?)\.{3,}(?:\((?P<why>[^)]*)\))?(?P<state>Passed|Failed|Skipped)$"
)
_SUMMARY = re.compile(
    r"=+ (?P<text>.*\b(passed|failed|error|errors|skipped)\b.*) in [\d.]+s"
)


@dataclass
class SetReport:
    label: str
    touched: list[str] = field(default_factory=list)
    failed_hooks: list[str] = field(default_factory=list)
    # Hooks that files reached but that have no local tool (precommit_local.py).
    not_run_hooks: list[str] = field(default_factory=list)
    hooks_run: int = 0
    lint_output: str = ""
    tests: list[str] = field(default_factory=list)
    test_summary: str = ""
    test_status: int = 0


def upstream_env() -> Path:
    """The second pinned environment; made by ci/setup-env-upstream.sh (a few GB of
    downloads the first time), so it is not created behind the user's back."""
    path = Path(
        subprocess.run(
            ["bash", str(SETUP), "--path"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    stamp = path.name.rsplit("-", 1)[-1]
    if not (path / f".exl3-env-{stamp}").is_file():
        raise ToolError(
            f"the environment {path} is missing or incomplete; create it with "
            f"`bash {SETUP.relative_to(ROOT)}` (downloads the torch and vLLM wheels, "
            "about 3 GB)"
        )
    return path


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, **kw):
    return subprocess.run(
        cmd, cwd=cwd, env={**os.environ, **(env or {})}, text=True, **kw
    )


def _local_config(venv: Path, tree: Path, dest: Path) -> list[str]:
    tools = [t for t in HOOK_TOOLS if (venv / "bin" / t).exists()]
    cmd = [
        str(venv / "bin" / "python"),
        str(Path(__file__).with_name("precommit_local.py")),
        str(tree / ".pre-commit-config.yaml"),
        str(dest),
        "--tools",
        *tools,
    ]
    if (venv / MYPY_HOOK_ENV / "bin" / "mypy").exists():
        cmd += ["--hook-env", f"mypy={venv / MYPY_HOOK_ENV / 'bin'}"]
    r = _run(cmd, tree, capture_output=True)
    if r.returncode:
        raise ToolError(f"precommit_local.py failed:\n{r.stdout}{r.stderr}")
    return tools


def _lint(venv: Path, tree: Path, config: Path, report: SetReport, cache: Path):
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        "PRE_COMMIT_HOME": str(cache / "pre-commit"),
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    r = _run(
        [
            str(venv / "bin" / "pre-commit"),
            "run",
            "--config",
            str(config),
            "--hook-stage",
            "manual",
            "--files",
            *report.touched,
        ],
        tree,
        env,
        capture_output=True,
    )
    report.lint_output = r.stdout + r.stderr
    for line in report.lint_output.splitlines():
        m = _HOOK_LINE.match(line.strip())
        if not m:
            continue
        name = m.group("name").strip()
        if m.group("state") == "Failed" and name.endswith(NO_LOCAL_TOOL):
            report.not_run_hooks.append(name.removesuffix(NO_LOCAL_TOOL).strip())
        elif m.group("state") == "Failed":
            report.failed_hooks.append(name)
        if m.group("state") == "Passed" or name in report.failed_hooks:
            report.hooks_run += 1
    # Hooks that fix (ruff --fix, clang-format -i) leave their edits: drop them.
    _git(tree, "reset", "-q", "--hard")
    _git(tree, "clean", "-q", "-fd")


def _linked_package(venv: Path, tree: Path, base_rev: str, dest: Path) -> Path:
    """The environment's installed vllm/ as hard links under dest, with every Python
    file the tree changed since `base_rev` written over its link."""
    site = Path(
        _run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            tree,
            capture_output=True,
        ).stdout.strip()
    )
    installed = site / "vllm"

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(installed, dest / "vllm", copy_function=link)
    changed = _git(
        tree, "diff", "--name-only", "--diff-filter=AM", base_rev, "HEAD", "--", "vllm"
    ).stdout.split()
    for rel in changed:
        target = dest / rel
        if target.exists():
            target.unlink()  # a link: never write through it into the environment
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / rel, target)
    return dest


# Run in the environment: the installed vllm/ against its wheel's RECORD. A file the
# RECORD does not list, or one whose hash differs, means the package was edited in
# place, and a set's tests would then see code of sets after it.
_PRISTINE_PROBE = r"""
import base64, hashlib, importlib.metadata as md, pathlib
dist = md.distribution("vllm")
listed, bad = set(), []
for f in dist.files or []:
    if not str(f).startswith("vllm/"):
        continue
    listed.add(str(f))
    if f.hash is None:
        continue
    path = pathlib.Path(f.locate())
    data = path.read_bytes() if path.is_file() else b""
    digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, data).digest())
    if digest.rstrip(b"=").decode() != f.hash.value.rstrip("="):
        bad.append("modified:" + str(f))
root = pathlib.Path(dist.locate_file("vllm"))
for path in root.rglob("*"):
    rel = "vllm/" + path.relative_to(root).as_posix()
    if path.is_file() and "__pycache__" not in rel and rel not in listed:
        bad.append("unlisted:" + rel)
print("\n".join(bad))
"""


def check_pristine(venv: Path) -> None:
    """Refuses an environment whose installed vLLM differs from its wheel."""
    r = _run(
        [str(venv / "bin" / "python"), "-c", _PRISTINE_PROBE],
        venv,
        capture_output=True,
    )
    if r.returncode:
        raise ToolError(f"{venv}: cannot read its vllm package:\n{r.stderr[-2000:]}")
    bad = r.stdout.split()
    if bad:
        shown = "\n  ".join(bad[:10])
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise ToolError(
            f"{venv}: the installed vllm package differs from its wheel in "
            f"{len(bad)} file(s) (modified: a hash other than its RECORD's; "
            "unlisted: not in its RECORD), so a set's tests could see code of later "
            "sets:\n"
            f"  {shown}{more}\nreinstall it (pip install --no-deps --force-reinstall "
            "the release wheel) and remove the files the wheel does not list"
        )


def _test(venv: Path, tree: Path, base_rev: str, report: SetReport, work: Path):
    report.tests = [
        p
        for p in report.touched
        if p.startswith("tests/") and re.search(r"/test_[^/]*\.py$", p)
    ]
    if not report.tests:
        report.test_summary = "no test files in this set"
        return
    run_dir = work / f"tests-{report.label}"
    for part in ("tests", "csrc"):
        shutil.copytree(tree / part, run_dir / part, symlinks=True)
    shutil.copyfile(tree / "pyproject.toml", run_dir / "pyproject.toml")
    site = _linked_package(venv, tree, base_rev, work / f"site-{report.label}")
    env = {"PYTHONPATH": str(site)}
    if FIXTURES.is_dir():
        env["EXL3_TEST_MODELS_DIR"] = str(FIXTURES)
    r = _run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pytest",
            "-c",
            "pyproject.toml",
            "--rootdir",
            ".",
            "-p",
            "no:cacheprovider",
            "-q",
            "-ra",
            *report.tests,
        ],
        run_dir,
        env,
        capture_output=True,
    )
    report.test_status = r.returncode
    out = r.stdout + r.stderr
    found = _SUMMARY.findall(out)
    report.test_summary = found[-1][0] if found else out.strip().splitlines()[-1]
    if r.returncode:
        report.lint_output += "\n" + out[-6000:]


def run_checks(us: UpstreamSeries, args: argparse.Namespace, base: Path) -> int:
    venv = upstream_env()
    cache = Path(args.cache_dir or default_cache_dir())
    if args.test:
        check_pristine(venv)
    reports = []
    with tempfile.TemporaryDirectory(prefix="vllm-exl3-series-ci-") as tmp:
        work = Path(tmp)
        tree = work / f"vllm-{us.base}"
        copy_sdist_tree(base, tree)
        _git(tree, "init", "-q")
        _git(tree, "add", "-f", "-A", ".")
        _git(tree, "commit", "-q", "--no-verify", "-m", f"vllm {us.base} pristine")
        base_rev = _git(tree, "rev-parse", "HEAD").stdout.strip()
        config = work / "pre-commit-local.yaml"
        tools = _local_config(venv, tree, config)
        print(f"check: hooks run with local tools: {', '.join(tools)}, mypy env")
        for folder in pull_request_folders(args.out):
            start = _git(tree, "rev-parse", "HEAD").stdout.strip()
            patches = sorted(str(p) for p in folder.glob("*.patch"))
            r = _git(tree, "am", "-q", "--whitespace=nowarn", *patches, check=False)
            if r.returncode:
                raise ToolError(f"{folder.name}: git am failed:\n{r.stdout}{r.stderr}")
            report = SetReport(folder.name)
            report.touched = _git(
                tree, "diff", "--name-only", "--diff-filter=AM", start, "HEAD"
            ).stdout.split()
            if args.lint:
                _lint(venv, tree, config, report, cache)
                state = (
                    "FAILED: " + ", ".join(report.failed_hooks)
                    if report.failed_hooks
                    else "clean"
                )
                if report.not_run_hooks:
                    state += "; not run here (no local tool): " + ", ".join(
                        report.not_run_hooks
                    )
                print(
                    f"lint: {report.label}: {len(report.touched)} file(s), "
                    f"{report.hooks_run} hook(s) ran, {state}"
                )
            if args.test:
                _test(venv, tree, base_rev, report, work)
                print(
                    f"test: {report.label}: {len(report.tests)} file(s): "
                    f"{report.test_summary}"
                )
            if report.failed_hooks or report.test_status:
                print(report.lint_output, file=sys.stderr)
            reports.append(report)
    return int(any(r.failed_hooks or r.test_status for r in reports))
