# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tools as a user runs them (a new process): a damaged checkpoint gives one line on
stderr naming the file and the rule, exit code 1 and no traceback; `--debug` adds the
traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from damage import CASES, REPO

CLI = REPO / "scripts" / "vllm-exl3"
BY_ID = {case.id: case for case in CASES}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CLI), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "command,case",
    [
        ("inspect", "header-length-absurd"),
        ("dequantize", "lfs-pointer"),
        ("inspect", "suh-nan"),
    ],
)
def test_one_line_no_traceback(command, case, tmp_path):
    ckpt = BY_ID[case].make(tmp_path)
    args = [command, str(ckpt)] + (
        [str(tmp_path / "out")] if command == "dequantize" else []
    )
    if case == "suh-nan":
        args.append("--values")
    proc = _run(*args)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vllm-exl3 {command}: error: "), (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr
    for phrase in BY_ID[case].expect.phrases(command):
        assert phrase in lines[0]


def test_debug_shows_the_traceback(tmp_path):
    ckpt = BY_ID["html-page"].make(tmp_path)
    proc = _run("inspect", str(ckpt), "--debug")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("vllm-exl3 inspect: error: ")
    assert "an HTML page" in proc.stderr
