# SPDX-License-Identifier: Apache-2.0
"""The CMake patch (0003) run by CMake: with vLLM's own cmake/utils.cmake, the EXL3 block of the
patched CMakeLists.txt picks the architectures and the sources (all of csrc/quantization/exl3's
.cu/.cpp but the quick build's standalone module) and gives each its gencode flags. A full
configure of vLLM needs CUTLASS and seven other repositories, so only the block runs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from minitree import ROOT, run_tool, write_tree

BLOCK_START = "  # EXL3 (ExLlamaV3 trellis quantization) kernels."
HARNESS = """cmake_minimum_required(VERSION 3.25)
project(exl3_block LANGUAGES NONE)
include(${VLLM_TREE}/cmake/utils.cmake)
set(CUDA_ARCHS "${TEST_ARCHS}")
set(VLLM_STABLE_EXT_SRC "csrc/libtorch_stable/existing.cu")
include(${CMAKE_SOURCE_DIR}/block.cmake)
message(STATUS "EXL3_ARCHS=${EXL3_ARCHS}")
foreach(src ${VLLM_STABLE_EXT_SRC})
  get_source_file_property(opts ${src} COMPILE_OPTIONS)
  message(STATUS "SRC=${src} OPTS=${opts}")
endforeach()
"""


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    r = run_tool("fetch")
    if r.returncode != 0:
        pytest.skip(f"pinned sdist not available: {r.stderr.strip()}")
    sdist = Path(r.stdout.strip().splitlines()[-1])
    tree = tmp_path_factory.mktemp("cmake") / "tree"
    # Just what the series touches (read from its patches), plus vLLM's CMake helpers.
    touched = {m for p in (ROOT / "patches").glob("*.patch")
               for m in re.findall(r"^\+\+\+ b/(\S+)$", p.read_text(), re.M)}
    for rel in ("PKG-INFO", *sorted(touched)):
        write_tree(tree, {rel: (sdist / rel).read_text()})
    shutil.copytree(sdist / "cmake", tree / "cmake")
    (tree / "csrc/libtorch_stable").mkdir(parents=True)
    applied = run_tool("apply", tree)
    assert applied.returncode == 0, applied.stderr
    return tree


def _configure(tree: Path, work: Path, archs: str) -> tuple[str, dict[str, str]]:
    text = (tree / "CMakeLists.txt").read_text()
    start = text.index(BLOCK_START)
    end = text.index("  endif()\n", text.index("Not building EXL3 kernels", start)) + 10
    write_tree(work, {"CMakeLists.txt": HARNESS, "block.cmake": text[start:end]})
    (work / "csrc").symlink_to(tree / "csrc")  # the block globs relative to the source dir
    r = subprocess.run(["cmake", "-S", str(work), "-B", str(work / "build"),
                        f"-DVLLM_TREE={tree}", f"-DTEST_ARCHS={archs}"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    archs_out = re.search(r"EXL3_ARCHS=(.*)", r.stdout).group(1)
    srcs = dict(re.findall(r"SRC=(\S+) OPTS=(.*)", r.stdout))
    return archs_out, srcs


EXPECTED = sorted(p.name for p in (ROOT / "csrc/quantization/exl3").glob("*")
                  if p.suffix in (".cu", ".cpp") and p.name != "standalone_module.cpp")


@pytest.mark.parametrize("archs,expected", [
    ("7.5;9.0;12.0;12.1", {"9.0a", "12.0f"}),
    ("8.0;8.6;8.9;9.0;10.0;12.0", {"8.0", "8.6", "8.9", "9.0a", "10.0f", "12.0f"}),
])
def test_exl3_sources_join_c_stable_libtorch(tmp_path, patched_tree, archs, expected):
    assert EXPECTED, "no EXL3 sources in csrc/quantization/exl3"
    got_archs, srcs = _configure(patched_tree, tmp_path, archs)
    assert set(got_archs.split(";")) == expected
    exl3 = {Path(s).name: opts for s, opts in srcs.items() if "/quantization/exl3/" in s}
    assert sorted(exl3) == EXPECTED
    for name, opts in exl3.items():
        for arch in expected:
            code = arch.replace(".", "")
            assert f"arch=compute_{code},code=sm_{code}" in opts, (name, opts)
    assert "csrc/libtorch_stable/existing.cu" in srcs  # appended to, not replaced


def test_no_exl3_sources_without_a_supported_arch(tmp_path, patched_tree):
    got_archs, srcs = _configure(patched_tree, tmp_path, "7.5")
    assert got_archs == ""
    assert list(srcs) == ["csrc/libtorch_stable/existing.cu"]
