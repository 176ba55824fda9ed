# SPDX-License-Identifier: Apache-2.0
"""Every Python file of the repository passes pyflakes: no undefined names, unused imports or
redefinitions. The GPU benchmarks and device scripts never run in CI, so this is what catches
a name left behind by a refactor there before a device call finds it (bench_linear.py crashed
at its first row from fed6495 to 85994cc on an undefined `n_copies`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pyflakes.api import check
from pyflakes.reporter import Reporter

REPO = Path(__file__).resolve().parents[2]
# Python files without the .py suffix.
SCRIPTS = ("scripts/vllm-exl3",)


def python_files() -> list[Path]:
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "*.py", *SCRIPTS],
                             capture_output=True, text=True, check=True).stdout.split()
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
    assert len(files) > 50 and (REPO / "scripts/bench/bench_linear.py") in files, files[:5]
    out, err = _Collect(), _Collect()
    reporter = Reporter(out, err)
    problems = sum(check(f.read_text(), str(f.relative_to(REPO)), reporter) for f in files)
    assert problems == 0 and not err.lines, "".join(out.lines + err.lines)


def test_the_lint_sees_an_undefined_name() -> None:
    out = _Collect()
    assert check("def f():\n    return {'copies': n_copies}\n", "probe.py",
                 Reporter(out, _Collect())) == 1
    assert "undefined name 'n_copies'" in "".join(out.lines)
