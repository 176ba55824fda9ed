# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One C++ runtime per process (scripts/vllm_exl3/cxx_runtime.py): a library linked with
a static libstdc++ is refused after the link, and a compiler that would link one is
refused before `build --from-source --only target` starts. Real g++ links, no GPU."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from minitree import run_tool
from vllm_exl3 import cxx_runtime

SOURCE = """
#include <sstream>
#include <string>
// What our ops' error messages do: a number formatted into a std::ostream.
extern "C" int message_length(long n) {
  std::ostringstream s;
  s << "rows " << n;
  return static_cast<int>(s.str().size());
}
"""

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def link(tmp_path: Path, name: str, *flags: str) -> Path:
    src = tmp_path / "message.cpp"
    src.write_text(SOURCE)
    lib = tmp_path / name
    subprocess.run(
        ["g++", "-shared", "-fPIC", "-O1", *flags, str(src), "-o", str(lib)],
        check=True,
        capture_output=True,
    )
    return lib


@needs_gxx
def test_needed_libraries_read_the_dynamic_section(tmp_path: Path) -> None:
    lib = link(tmp_path, "shared.so")
    got = cxx_runtime.needed_libraries(lib)
    assert cxx_runtime.LIBSTDCXX in got
    if shutil.which("readelf"):
        out = subprocess.run(
            ["readelf", "-d", str(lib)], capture_output=True, text=True, check=True
        ).stdout
        assert got == [
            line.split("[", 1)[1].rstrip("]")
            for line in out.splitlines()
            if "(NEEDED)" in line
        ]
    assert cxx_runtime.library_problem(lib, "g++") is None


@needs_gxx
def test_a_static_libstdcxx_is_refused_by_name(tmp_path: Path) -> None:
    lib = link(tmp_path, "static.so", "-static-libstdc++")
    assert cxx_runtime.LIBSTDCXX not in cxx_runtime.needed_libraries(lib)
    problem = cxx_runtime.library_problem(lib, "/opt/gcc/bin/g++")
    assert problem is not None
    assert str(lib) in problem and "/opt/gcc/bin/g++" in problem
    assert "statically" in problem and "std::locale" in problem


@needs_gxx
def test_what_the_check_prevents(tmp_path: Path) -> None:
    """Why a static libstdc++ is refused: in a process where torch has loaded the shared
    one, the static copy's stream drops the number of "rows 12345" (the GPU host's
    whole-target library crashed there instead); the shared one formats it."""
    libs = {
        "static": link(tmp_path, "static.so", "-static-libstdc++"),
        "shared": link(tmp_path, "shared.so"),
    }
    probe = (
        "import ctypes, sys, torch\n"
        "print(ctypes.CDLL(sys.argv[1]).message_length(12345))"
    )
    got = {
        name: subprocess.run(
            [sys.executable, "-c", probe, str(lib)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for name, lib in libs.items()
    }
    assert got == {"static": str(len("rows ")), "shared": str(len("rows 12345"))}


def test_not_an_elf_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "lib.so"
    bad.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        cxx_runtime.needed_libraries(bad)


def fake_compiler(tmp_path: Path) -> Path:
    """A g++ wrapper that, like the GPU host's, finds no libstdc++.so."""
    exe = tmp_path / "g++-wrapper"
    exe.write_text('#!/bin/sh\necho "${1#-print-file-name=}"\n')
    exe.chmod(0o755)
    return exe


@needs_gxx
def test_the_compiler_check_tells_a_wrapper_without_libstdcxx_so(
    tmp_path: Path,
) -> None:
    assert cxx_runtime.static_libstdcxx_problem("g++") is None
    exe = fake_compiler(tmp_path)
    problem = cxx_runtime.static_libstdcxx_problem(str(exe))
    assert problem is not None and "finds no libstdc++.so" in problem
    assert "'libstdc++.so'" in problem and str(exe) in problem
    missing = cxx_runtime.static_libstdcxx_problem(str(tmp_path / "no-such-g++"))
    assert missing is not None and "not on PATH" in missing


def test_build_only_target_refuses_such_a_compiler_before_building(
    tmp_path: Path,
) -> None:
    exe = fake_compiler(tmp_path)
    build = tmp_path / "build"
    r = run_tool(
        "build",
        "--from-source",
        "--only",
        "target",
        "--archs",
        "9.0",
        "--offline",
        "--build-dir",
        build,
        env={"CXX": str(exe), "CUDAHOSTCXX": str(exe)},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "finds no libstdc++.so" in r.stderr and str(exe) in r.stderr
    assert not (build / "build").exists()  # nothing configured
