# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`build --from-source --only` (scripts/vllm_exl3/vllm_cmake.py): the checks the CI
step (ci/compile_in_vllm_target.sh) applies to our objects of vLLM's _C_stable_libtorch,
each shown to fail on a planted fault; the offline source pack; installing the built
library; the background build's status. The step itself (vLLM's CMake configure and
nvcc on our 23 units) runs in ci/test.sh, not here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from minitree import run_tool
from vllm_exl3 import vllm_cmake
from vllm_exl3.repo import SDIST_SHA256, Series, default_cache_dir

# --- The symbol rule ----------------------------------------------------------


@pytest.mark.parametrize(
    "symbol,scope",
    [
        # Ours: functions, template instantiations, statics inside lambdas, guards,
        # nvcc's anonymous namespace inside ours, nvcc's host stub of a kernel.
        ("_ZN9vllm_exl312rate_kernelsEi", "vllm_exl3"),
        ("_ZNK9vllm_exl34Plan4sizeEv", "vllm_exl3"),
        ("_ZZZN9vllm_exl33fooILi8EEEviENKUlT_E_clIiEEDaS1_E4done", "vllm_exl3"),
        ("_ZGVZN9vllm_exl33fooEvE1x", "vllm_exl3"),
        (
            "_ZN9vllm_exl355_GLOBAL__N__03d94f9f_22_exl3_plan_cpp_a1b2c3d41fEv",
            "vllm_exl3",
        ),
        ("_Z55__device_stub__ZN9vllm_exl324exl3_device_sleep_kernelEl", "vllm_exl3"),
        # The headers' namespaces: std (and its abbreviations), torch, c10.
        ("_ZTVSt19bad_optional_access", "std"),
        ("DW.ref._ZTISt13runtime_error", "std"),
        ("_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE6appendEPKc", "std"),
        ("_ZNSaIcED2Ev", "std"),
        ("_ZSt20__throw_bad_optional_accessv", "std"),
        ("_ZNK5torch6stable6Tensor11scalar_typeEv", "torch"),
        ("_ZTSZN5torch6stable6TensorC4EP16AtenTensorOpaqueEUlS3_E_", "torch"),
        ("_ZN3c108toStringENS_10ScalarTypeE", "c10"),
        ("_ZnwmPv", "std"),  # placement new, inline in <new>
        # At global scope: a function, a class's member, a C name.
        ("_Z6div_upii", "::div_up"),
        ("_ZN4dim3C2Ejjj", "dim3"),
        ("_Z32__device_stub__Z12leaky_kernelPi", "::leaky_kernel"),
        ("__gxx_personality_v0", None),
        ("exl3_c_function", None),
    ],
)
def test_owner_reads_the_manglings(symbol: str, scope: str | None) -> None:
    assert vllm_cmake.owner(symbol) == scope


# Compiled with g++ -O0 (inline functions then stay as weak definitions): what may and
# may not come out of our objects. The names in PLANTED must be reported, nothing else.
SYMBOL_SOURCE = r"""
#include <string>
namespace vllm_exl3 {
int ours(int x) { return x + 1; }
template <int N> int scaled(int x) { return x * N; }
template int scaled<3>(int);
inline int counted(int x) { static int calls = 0; return x + ++calls; }
int use_counted(int x) { return counted(x); }
std::string label(int x) { return std::to_string(x) + "!"; }
namespace { int hidden(int x) { return x; } }
int use_hidden(int x) { return hidden(x); }
}  // namespace vllm_exl3
int leaked_global(int x) { return x; }
inline int leaked_inline(int x) { return x - 1; }
namespace vllm_exl3 { int use_leaked(int x) { return leaked_inline(x); } }
namespace torch { int planted(int x) { return x; } }
extern "C" int leaked_c(int x) { return x; }
"""
PLANTED = {
    "_Z13leaked_globali": "global scope",
    "_Z13leaked_inlinei": "global scope",
    "_ZN5torch7plantedEi": "strong definition in namespace torch",
    "leaked_c": "global C symbol",
}


def _nm(obj: Path) -> list[str]:
    r = subprocess.run(
        ["nm", "-P", "--defined-only", str(obj)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_symbol_rule_reports_exactly_the_planted_symbols(tmp_path: Path) -> None:
    if shutil.which("g++") is None or shutil.which("nm") is None:
        pytest.skip("g++ and nm needed")
    src, obj = tmp_path / "planted.cpp", tmp_path / "planted.o"
    src.write_text(SYMBOL_SOURCE)
    r = subprocess.run(
        ["g++", "-std=c++20", "-O0", "-fPIC", "-c", str(src), "-o", str(obj)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    lines = _nm(obj)
    # The allowed kinds really are in the object: weak std instantiations, our weak
    # inline function and its unique static.
    kinds = {ln.split()[0]: ln.split()[1] for ln in lines}
    assert kinds["_ZN9vllm_exl37countedEi"] == "W"
    assert kinds["_ZZN9vllm_exl37countedEiE5calls"] == "u"
    assert any(vllm_cmake.owner(n) == "std" and k == "W" for n, k in kinds.items())
    problems = vllm_cmake.symbol_problems("planted.cpp", lines)
    assert {p.symbol: p.reason for p in problems}.keys() == PLANTED.keys()
    for p in problems:
        assert PLANTED[p.symbol] in p.reason, (p.symbol, p.reason)
        assert p.obj == "planted.cpp"


# --- Flags and architectures --------------------------------------------------

NVCC = (
    "/usr/local/cuda/bin/nvcc -forward-unknown-to-host-compiler -DUSE_CUDA "
    "-I/tree/csrc -O3 -DNDEBUG -std=c++20 --compress-mode=size -DENABLE_FP8 "
    "{extra}{gencode} -MD -MT {obj} -MF {obj}.d -x cu -c /tree/{src} -o {obj}"
)
GENCODE = "-gencode arch=compute_{0},code=sm_{0} "


def _nvcc(src: str, codes: tuple[str, ...], extra: str = "") -> str:
    return NVCC.format(
        extra=extra,
        gencode="".join(GENCODE.format(c) for c in codes),
        obj=f"CMakeFiles/t.dir/{src}.o",
        src=src,
    )


def test_flag_problems_name_the_file_and_the_flag() -> None:
    reference = _nvcc("csrc/libtorch_stable/activation_kernels.cu", ("80", "90"))
    want = ["9.0a", "12.0f"]
    ours = "csrc/libtorch_stable/quantization/exl3/exl3_rate_k4.cu"
    assert (
        vllm_cmake.flag_problems(ours, _nvcc(ours, ("90a", "120f")), reference, want)
        == []
    )
    extra = _nvcc(ours, ("90a", "120f"), extra="--use_fast_math ")
    (problem,) = vllm_cmake.flag_problems(ours, extra, reference, want)
    assert problem.startswith(ours) and "--use_fast_math" in problem
    (problem,) = vllm_cmake.flag_problems(ours, _nvcc(ours, ("90a",)), reference, want)
    assert problem.startswith(ours) and "['9.0a']" in problem and "12.0f" in problem


def test_a_compile_failure_is_attributed_to_its_architecture(tmp_path: Path) -> None:
    nvcc = vllm_cmake.cuda_toolkit()
    if nvcc is None:
        pytest.skip("no CUDA toolkit")
    src = tmp_path / "planted.cu"
    src.write_text(
        "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200\n"
        '#error "planted: the sm_120 family only"\n'
        "#endif\n"
        "__global__ void k(int* p) { *p = 1; }\n"
    )
    command = (
        f"{nvcc / 'bin' / 'nvcc'} -std=c++20 -O2 "
        + "".join(GENCODE.format(c) for c in ("90a", "120f"))
        + f"-MD -MT o -MF {tmp_path / 'o.d'} -x cu -c {src} -o {tmp_path / 'o.o'}"
    )
    message = vllm_cmake.attribute_failure(command, "csrc/planted.cu")
    assert message.startswith("csrc/planted.cu: fails for arch 12.0f (")
    assert "planted: the sm_120 family only" in message and "9.0a" not in message


def test_requested_architectures_map_to_the_cmake_blocks() -> None:
    assert vllm_cmake.expected_archs(["9.0", "12.0", "12.1"]) == ["9.0a", "12.0f"]
    assert vllm_cmake.expected_archs(["12.1"]) == ["12.0f"]
    assert vllm_cmake.dotted_gencode("120f") == "12.0f"
    assert vllm_cmake.dotted_gencode("90a") == "9.0a"


# --- The sources: stand-ins, the pack, the incremental tree -------------------


def _cached_sources() -> vllm_cmake.Sources:
    """The pinned sdist and CUTLASS as the CI step left them in the cache (nothing is
    downloaded here)."""
    cache = default_cache_dir()
    sdist = cache / "src" / "vllm-0.26.0"
    cutlass = cache / f"cutlass-{vllm_cmake.CUTLASS_REVISION}"
    if not (sdist / "CMakeLists.txt").is_file() or not cutlass.is_dir():
        pytest.skip("the pinned sdist or CUTLASS is not in the cache (run the CI step)")
    return vllm_cmake.Sources(sdist, cutlass)


def test_every_repository_vllm_fetches_has_a_stand_in_or_is_cutlass() -> None:
    """A repository a future pin adds to cmake/external_projects would be fetched at
    configure time (and fail offline): it must be named in STANDINS."""
    sources = _cached_sources()
    named = set()
    for f in (sources.sdist / "cmake" / "external_projects").glob("*.cmake"):
        named |= set(re.findall(r"\$\{([\w-]+)_SOURCE_DIR\}", f.read_text()))
    named.discard("CMAKE")
    assert named == {name for _, name in vllm_cmake.STANDINS}
    files = vllm_cmake.standin_files(sources.sdist)
    assert "flash_mla/flash_mla_interface.py" in files["flashmla"]  # read at configure
    assert vllm_cmake.cutlass_version(sources.cutlass) == vllm_cmake.CUTLASS_REVISION


def test_the_pack_gives_the_same_tree_and_a_second_sync_writes_nothing(
    tmp_path: Path,
) -> None:
    sources = _cached_sources()
    series = Series.load()
    pack = vllm_cmake.write_pack(sources, series, tmp_path / "inputs.tar.xz")
    assert pack.stat().st_size < 4 * 2**20  # carried to the GPU host with the repo
    packed = vllm_cmake.sources_from_pack(pack, tmp_path / "cache", series)
    assert packed.patched  # the host applies nothing (it may have no git)
    a = vllm_cmake.prepare_tree(sources, series, tmp_path / "a")
    b = vllm_cmake.prepare_tree(packed, series, tmp_path / "b")
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files_a)
    rate = a / "csrc/libtorch_stable/quantization/exl3/exl3_rate_k4.cu"
    assert rate.is_file()  # the generated units are in the tree
    before = rate.stat().st_mtime_ns
    vllm_cmake.prepare_tree(sources, series, tmp_path / "a")
    assert rate.stat().st_mtime_ns == before  # unchanged: ninja keeps its object
    assert vllm_cmake.cutlass_version(packed.cutlass) == vllm_cmake.CUTLASS_REVISION


@pytest.mark.parametrize(
    "manifest,message",
    [
        ({"vllm": "0.34.0", "sdist_sha256": "0" * 64}, "another vLLM sdist"),
        (
            {"sdist_sha256": SDIST_SHA256, "series": "0" * 64, "commit": "abc12345"},
            "holds the series of abc12345",
        ),
    ],
)
def test_a_pack_of_another_sdist_or_series_is_refused(
    tmp_path: Path, manifest: dict, message: str
) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / vllm_cmake.PACK_MANIFEST).write_text(json.dumps(manifest))
    with tarfile.open(tmp_path / "old.tar.xz", "w:xz") as tar:
        tar.add(stage / vllm_cmake.PACK_MANIFEST, arcname=vllm_cmake.PACK_MANIFEST)
    with pytest.raises(vllm_cmake.ToolError, match=message):
        vllm_cmake.sources_from_pack(
            tmp_path / "old.tar.xz", tmp_path / "cache", Series.load()
        )


# --- The math libraries' headers a wheel-assembled toolkit lacks ---------------


def _machine(tmp_path: Path, toolkit: list[str], wheels: list[str]):
    cuda, nvidia = tmp_path / "cuda", tmp_path / "site/nvidia"
    for root, names in ((cuda / "include", toolkit), (nvidia / "cu13/include", wheels)):
        root.mkdir(parents=True)
        for name in names:
            (root / name).write_text(name)
    return vllm_cmake.Machine(
        Path("python"), cuda, Path("cmake"), Path("ninja"), (nvidia,)
    )


def test_library_headers_come_from_the_wheels_where_the_toolkit_lacks_them(
    tmp_path: Path,
) -> None:
    wheels = ["cublas_v2.h", "cublas_api.h", "curand_kernel.h", "curand.h", "other.h"]
    machine = _machine(tmp_path, ["cuda_runtime.h"], wheels)
    standins = tmp_path / "standins"
    # Our objects need cuBLAS only; the whole target also CUTLASS's curand_kernel.h.
    got = vllm_cmake._library_headers(machine, standins, "objects")
    assert sorted(p.name for p in got.iterdir()) == ["cublas_api.h", "cublas_v2.h"]
    got = vllm_cmake._library_headers(machine, standins, "target")
    assert sorted(p.name for p in got.iterdir()) == sorted(wheels[:4])
    # A toolkit that has them all needs no stand-in.
    full = _machine(tmp_path / "full", ["cublas_v2.h", "curand_kernel.h"], [])
    assert vllm_cmake._library_headers(full, tmp_path / "s2", "target") is None
    # Missing everywhere: named, with the wheel that brings it.
    bare = _machine(tmp_path / "bare", ["cublas_v2.h"], [])
    assert vllm_cmake._library_headers(bare, tmp_path / "s3", "objects") is None
    with pytest.raises(vllm_cmake.ToolError, match="curand_kernel.h.*nvidia-curand"):
        vllm_cmake._library_headers(bare, tmp_path / "s3", "target")


# --- Installing the library, the background build's status --------------------


def test_install_into_keeps_the_release_library_once(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm/_C_stable_libtorch.abi3.so").write_bytes(b"release")
    (site / "vllm/_exl3_C.abi3.so").write_bytes(b"quick")
    built = tmp_path / "install/_C_stable_libtorch.abi3.so"
    built.parent.mkdir()
    built.write_bytes(b"ours-1")
    vllm_cmake.install_into(built, site)
    built.write_bytes(b"ours-2")
    done = vllm_cmake.install_into(built, site)
    assert (site / "vllm/_C_stable_libtorch.abi3.so").read_bytes() == b"ours-2"
    assert (site / "vllm/_C_stable_libtorch.abi3.so.release").read_bytes() == b"release"
    assert not (site / "vllm/_exl3_C.abi3.so").exists()
    assert (site / "vllm/_exl3_C.abi3.so.unused").read_bytes() == b"quick"
    assert not any("release" in line for line in done)  # kept once, not overwritten
    with pytest.raises(vllm_cmake.ToolError, match="no installed vLLM"):
        vllm_cmake.install_into(built, tmp_path / "empty")


def _status(work: Path, **state) -> subprocess.CompletedProcess:
    work.mkdir(parents=True, exist_ok=True)
    (work / vllm_cmake.STATE_FILE).write_text(json.dumps(state))
    return run_tool("build", "--status", "--build-dir", work)


def test_status_tells_running_done_failed_and_stopped(tmp_path: Path) -> None:
    now = time.time()
    running = _status(
        tmp_path / "r", pid=os.getpid(), phase="build", rc=None, started=now
    )
    assert running.returncode == vllm_cmake.STATUS_RUNNING, running.stdout
    again = run_tool(
        "build",
        "--from-source",
        "--only",
        "objects",
        "--python",
        sys.executable,
        "--build-dir",
        tmp_path / "r",
    )  # a second build into the same folder
    assert again.returncode == 1 and "a build is running" in again.stderr, again.stderr
    done = _status(tmp_path / "d", pid=1, phase="done", rc=0, started=now)
    assert done.returncode == 0 and "done" in done.stdout
    failed = _status(tmp_path / "f", phase="failed", rc=1, error="boom", started=now)
    assert failed.returncode == 1 and "boom" in failed.stdout
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stopped = _status(tmp_path / "s", pid=gone.pid, phase="build", rc=None, started=now)
    assert stopped.returncode == 1 and "run the same command again" in stopped.stdout


def test_a_relative_build_dir_is_taken_from_the_callers_directory(
    tmp_path: Path,
) -> None:
    # CMake configures inside the prepared tree: a relative folder handed on as given
    # pointed the stand-ins below that tree (DEEPGEMM_SRC_DIR is not a directory).
    work = tmp_path / "rel"
    work.mkdir()
    (work / vllm_cmake.STATE_FILE).write_text(
        json.dumps(dict(pid=1, phase="done", rc=0, started=time.time()))
    )
    r = run_tool("build", "--status", "--build-dir", "rel", cwd=tmp_path)
    assert r.returncode == 0 and f"({work})" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--only", "objects"], "--only needs --from-source"),
        (
            ["--from-source", "--only", "objects", "--install-into", "x"],
            "--only target",
        ),
        (["--background"], "need(s) --from-source --only"),
    ],
)
def test_option_combinations_are_refused(args: list[str], message: str) -> None:
    r = run_tool("build", *args)
    assert r.returncode == 1 and message in r.stderr, r.stderr
