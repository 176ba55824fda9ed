# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the tooling tests build on: the CLI run as a subprocess, a miniature vLLM source
tree, and a series whose patches are made with `git format-patch` on a scratch checkout
of it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_exl3.repo import ROOT

TOOL = ROOT / "scripts" / "vllm-exl3"

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@localhost",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@localhost",
}


def run_tool(
    *args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def git(cwd: Path, *args: str) -> str:
    r = subprocess.run(
        ["git", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_ENV},
    )
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
    "CMakeLists.txt": "project(vllm)\nset(VLLM_STABLE_EXT_SRC a.cu)\ndefine_extension_target()\n",  # noqa: E501
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
    patched: dict[
        str, bytes
    ]  # expected content of each patched file (from the git checkout)


def make_series(base: Path, dest: Path, variant: str = "a") -> MadeSeries:
    """Patches from real commits (git format-patch) on a scratch checkout of `base`,
    plus an overlay and csrc. `variant` changes the content, to model an older/newer
    series."""
    work = dest.parent / f"scratch-{dest.name}"
    subprocess.run(["cp", "-a", str(base), str(work)], check=True)
    git(work, "init", "-q")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "pristine")
    envs = (work / "vllm/envs.py").read_text().splitlines(keepends=True)
    envs[3] = f"VAR_3 = 'patched-{variant}'\n"
    envs.insert(50, f"EXL3_{variant.upper()} = True\n")
    (work / "vllm/envs.py").write_text("".join(envs))
    git(
        work,
        "commit",
        "-q",
        "-am",
        f"envs: two far-apart hunks ({variant})\n\nWhy: test.",
    )
    (work / "CMakeLists.txt").write_text(
        (work / "CMakeLists.txt")
        .read_text()
        .replace("a.cu)", f"a.cu exl3_{variant}.cu)")
    )
    (work / "vllm/tail.txt").write_text(f"line one\nno newline at end\nadded {variant}")
    git(
        work,
        "commit",
        "-q",
        "-am",
        "cmake and a file without final newline\n\nWhy: test.",
    )
    (dest / "patches").mkdir(parents=True)
    git(work, "format-patch", "-q", "-o", str(dest / "patches"), "HEAD~2..HEAD")
    write_tree(
        dest,
        {
            "overlay/vllm/model_executor/layers/quantization/exl3/__init__.py": f"# {variant}\n",  # noqa: E501
            "overlay/vllm/exl3_new_module.py": f"X = '{variant}'\n",
            "overlay/tests/quantization/test_exl3_harness.py": "def test_x():\n    pass\n",  # noqa: E501
            "csrc/libtorch_stable/quantization/exl3/kernel.cu": f"// kernel {variant}\n",  # noqa: E501
        },
    )
    patched = {
        rel: (work / rel).read_bytes()
        for rel in ("vllm/envs.py", "CMakeLists.txt", "vllm/tail.txt")
    }
    return MadeSeries(dest, patched)


def make_wheel(
    dest_dir: Path,
    files: dict[str, bytes | str],
    version: str = "0.26.0",
    name: str = "vllm",
    tag: str = "cp38-abi3-manylinux_2_28_x86_64",
) -> Path:
    """A wheel archive holding `files` plus minimal dist-info (METADATA, WHEEL,
    RECORD).
    """
    import base64
    import zipfile

    dist_info = f"{name}-{version}.dist-info"
    members = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
    members[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n".encode()
    )
    members[f"{dist_info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n".encode()
    )
    record = []
    for path, data in members.items():
        digest = (
            base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            .rstrip(b"=")
            .decode()
        )
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    members[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in members.items():
            info = zipfile.ZipInfo(path)
            info.external_attr = (0o755 if path.endswith(".so") else 0o644) << 16
            zf.writestr(info, data)
    return out


def check_record(wheel: Path) -> dict[str, bytes]:
    """Asserts the wheel's RECORD lists every member with its true hash and size;
    returns the members' contents."""
    import base64
    import csv
    import io
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        contents = {n: zf.read(n) for n in zf.namelist()}
    (record_name,) = [n for n in contents if n.endswith(".dist-info/RECORD")]
    rows = list(csv.reader(io.StringIO(contents[record_name].decode())))
    assert sorted(r[0] for r in rows) == sorted(contents), (
        "RECORD does not list every member"
    )
    for path, h, size in rows:
        if path == record_name:
            assert h == "" and size == ""
            continue
        data = contents[path]
        digest = (
            base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            .rstrip(b"=")
            .decode()
        )
        assert h == f"sha256={digest}" and int(size) == len(data), path
    return contents
