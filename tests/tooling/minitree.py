# SPDX-License-Identifier: Apache-2.0
"""What the tooling tests build on: the CLI run as a subprocess, a miniature vLLM source tree, and
a series whose patches are made with `git format-patch` on a scratch checkout of it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "scripts" / "vllm-exl3"
sys.path.insert(0, str(ROOT / "scripts"))

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost",
    "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost",
}


def run_tool(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})})


def git(cwd: Path, *args: str) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, **GIT_ENV})
    assert r.returncode == 0, r.stderr
    return r.stdout


def tree_hash(root: Path) -> str:
    """Every file's path, mode and bytes, and every directory (so leftovers count)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_dir():
            h.update(f"D {rel}\n".encode())
        else:
            h.update(f"F {rel} {p.stat().st_mode & 0o777:o}\n".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


# A miniature vLLM 0.26.0 sdist: just enough to be recognised and patched.
ENVS = "".join(f"VAR_{i} = {i}\n" for i in range(60))
MINI_SDIST = {
    "PKG-INFO": "Metadata-Version: 2.4\nName: vllm\nVersion: 0.26.0\n",
    "CMakeLists.txt": "project(vllm)\nset(VLLM_STABLE_EXT_SRC a.cu)\ndefine_extension_target()\n",
    "csrc/libtorch_stable/torch_bindings.cpp": "// bindings\n",
    "vllm/__init__.py": "__version__ = '0.26.0'\n",
    "vllm/envs.py": ENVS,
    "vllm/model_executor/__init__.py": "",
    "vllm/tail.txt": "line one\nno newline at end",
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@dataclass
class MadeSeries:
    root: Path  # series root: overlay/, csrc/, patches/
    patched: dict[str, bytes]  # expected content of each patched file (from the git checkout)


def make_series(base: Path, dest: Path, variant: str = "a") -> MadeSeries:
    """Patches from real commits (git format-patch) on a scratch checkout of `base`, plus an
    overlay and csrc. `variant` changes the content, to model an older/newer series."""
    work = dest.parent / f"scratch-{dest.name}"
    subprocess.run(["cp", "-a", str(base), str(work)], check=True)
    git(work, "init", "-q")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "pristine")
    envs = (work / "vllm/envs.py").read_text().splitlines(keepends=True)
    envs[3] = f"VAR_3 = 'patched-{variant}'\n"
    envs.insert(50, f"EXL3_{variant.upper()} = True\n")
    (work / "vllm/envs.py").write_text("".join(envs))
    git(work, "commit", "-q", "-am", f"envs: two far-apart hunks ({variant})\n\nWhy: test.")
    (work / "CMakeLists.txt").write_text(
        (work / "CMakeLists.txt").read_text().replace("a.cu)", f"a.cu exl3_{variant}.cu)"))
    (work / "vllm/tail.txt").write_text(f"line one\nno newline at end\nadded {variant}")
    git(work, "commit", "-q", "-am", "cmake and a file without final newline\n\nWhy: test.")
    (dest / "patches").mkdir(parents=True)
    git(work, "format-patch", "-q", "-o", str(dest / "patches"), "HEAD~2..HEAD")
    write_tree(dest, {
        "overlay/vllm/model_executor/layers/quantization/exl3/__init__.py": f"# {variant}\n",
        "overlay/vllm/exl3_new_module.py": f"X = '{variant}'\n",
        "overlay/tests/quantization/test_exl3_harness.py": "def test_x():\n    pass\n",
        "csrc/quantization/exl3/kernel.cu": f"// kernel {variant}\n",
    })
    patched = {rel: (work / rel).read_bytes()
               for rel in ("vllm/envs.py", "CMakeLists.txt", "vllm/tail.txt")}
    return MadeSeries(dest, patched)
