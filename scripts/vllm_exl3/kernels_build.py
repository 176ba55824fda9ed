# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Quick build of the EXL3 kernels into the standalone stable-ABI extension
`_exl3_C.abi3.so`.

Compiles the translation units of `csrc/libtorch_stable/quantization/exl3/`,
`csrc/libtorch_stable/attention/exl3_sparse_mla/` and
`csrc/libtorch_stable/exl3_mma.cu` (SOURCE_GLOBS, the CMake patch's globs) and the
per-rate units exl3's generate_kernels.py writes (into the build folder) against the
torch headers of the running Python (torch 2.11, stable ABI only) with the local nvcc,
in parallel, one object per translation unit, and links them with
`standalone_module.cpp` (the Python entry point).
Importing the result registers `torch.ops._C.exl3_linear` / `exl3_reconstruct`. The full
build compiles the same sources into vLLM's `_C_stable_libtorch` instead (a CMake
source-list patch).

    python -m vllm_exl3.kernels_build --out build/exl3 --arch 9.0 --jobs 16

`target_toolchain` builds the same extension for another environment: the venv of a
root file system (a serving image's), for its machine. There nvcc's host compiler is
that machine's g++ (Debian's cross compiler for another machine), and torch, the CUDA
runtime and cuBLAS are the root's own. The device code does not depend on the host
machine: an object compiled for sm_121 on x86_64 against the aarch64 root holds the same
cubin as one compiled by the aarch64 nvcc inside that root (docker/README.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .cxx_runtime import library_problem
from .repo import host_machine, kernel_generator

REPO = Path(__file__).resolve().parents[2]
# Where vLLM's stable-ABI extension keeps its sources; ours are laid out as there.
STABLE_SOURCES = REPO / "csrc/libtorch_stable"
SOURCES = STABLE_SOURCES / "quantization/exl3"
SPARSE_MLA_SOURCES = STABLE_SOURCES / "attention/exl3_sparse_mla"
# The extension's translation units under STABLE_SOURCES: the EXL3 GEMM's, the
# sparse-MLA attention kernel's (it registers its op the same way) and the host side
# of the primitives both share. The CMake patch globs the same (a test compares).
SOURCE_GLOBS = (
    "quantization/exl3/*.cu",
    "quantization/exl3/*.cpp",
    "attention/exl3_sparse_mla/*.cu",
    "attention/exl3_sparse_mla/*.cpp",
    "exl3_*.cu",
)
# Under the build folder: the sources generate_kernels.py writes at build time.
GENERATED_DIR = "generated"
EXTENSION = "_exl3_C.abi3.so"
# Where `scripts/vllm-exl3 build` (build.KERNEL_BUILD_DIR) and the compile test both
# build, so the objects one compiled are reused by the other.
DEFAULT_OUT = REPO / "build" / "exl3"
# The entry point belongs to the quick build only; the full build uses
# REGISTER_EXTENSION.
STANDALONE = "standalone_module.cpp"
# Oldest torch whose stable ABI we target (vLLM 0.26's CMake uses the same value).
TORCH_TARGET_VERSION = "0x020B000000000000ULL"
# No --use_fast_math: the decode must round exactly like the format's fp16 adds and
# fmas, and the epilogue's fp32 must not flush or approximate.
NVCC_FLAGS = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr"]
CXX_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-Wall", "-Wno-unknown-pragmas"]
DEFINES = ["-DUSE_CUDA", f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]


class BuildError(RuntimeError):
    pass


# The device architectures the kernels are built for: every one with mma.sync
# m16n8k16 (fp16 and bf16) and cp.async, the instructions of their portable path. Each
# maps to the entry of the CMake patch's EXL3_ARCHS (patches/0003) whose image runs on
# it: Hopper's is arch-specific (9.0a: the wgmma paths), the Blackwell ones are family
# images (10.0f, 12.0f). README, the user guide and Exl3Config.get_min_capability (the
# lowest) say the same (tests/tooling/test_support_claims.py).
BUILT_ARCHS = {
    "80": "8.0",
    "86": "8.6",
    "89": "8.9",
    "90": "9.0a",
    "100": "10.0f",
    "120": "12.0f",
    "121": "12.0f",
}
# The ones the kernels are tuned for (shared-memory and register budgets), compiled
# unit by unit by CI (tests/kernels/test_compile.py) and by `scripts/vllm-exl3 build`
# by default. Of them only sm_90 has run (H100, H200). The others are built from the
# same mma.sync code and compile-checked, and have never run.
TARGET_ARCHS = ("90", "120", "121")


def dotted(arch: str) -> str:
    """'121' -> '12.1' (the CMake and TORCH_CUDA_ARCH_LIST spelling)."""
    return f"{int(arch) // 10}.{int(arch) % 10}"


def normalize_arch(arch: str) -> str:
    """'9.0', '90', 'sm_90', 'compute_90' -> '90'; '12.1' -> '121'. Refuses, naming
    them, an architecture outside BUILT_ARCHS."""
    a = arch.strip().lower().removeprefix("sm_").removeprefix("compute_")
    if "." in a:
        major, minor = a.split(".", 1)
        a = major + minor
    if not a.isdigit():
        raise BuildError(
            f"unrecognised CUDA architecture {arch!r} (use e.g. 9.0, 12.0, sm_121)"
        )
    if a not in BUILT_ARCHS:
        built = ", ".join(map(dotted, BUILT_ARCHS))
        raise BuildError(
            f"CUDA architecture {arch!r} (sm_{a}): the EXL3 kernels are built for "
            f"{built} only (they need mma.sync m16n8k16 and cp.async, sm_80 on)"
        )
    return a


# Hopper is built with its arch-specific features (sm_90a): the wgmma paths need them,
# and an sm_90a image runs on exactly the devices an sm_90 one does (compute
# capability 9.0).
ARCH_FEATURES = {"90": "90a"}


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        a = ARCH_FEATURES.get(a, a)
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return flags


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    cxx: str
    cuda_include: list[str]
    torch_include: Path
    torch_lib: Path
    python_include: str
    cublas_lib: Path
    # Building for another environment (target_toolchain): nvcc's host compiler, the
    # CUDA runtime linked (nvcc's own is for this machine), and include directories the
    # C++ compiler searches after its own (the root's /usr/include, for the
    # machine-specific header Debian's Python.h includes).
    ccbin: str | None = None
    cudart_lib: Path | None = None
    include_after: tuple[str, ...] = ()


def _nvidia_dir(sub: str) -> Path | None:
    """The pip-installed CUDA 13 tree (nvidia/cu13/<sub>) torch's wheel depends on."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        d = Path(root) / "cu13" / sub
        if d.is_dir():
            return d
    return None


# Debian's cross compilers are named after the GNU triplet of their machine.
CROSS_CXX = "{machine}-linux-gnu-g++"
# The CUDA runtime's and cuBLAS's libraries in their CUDA 13 wheels (nvidia/cu13/lib).
CUDART_SONAME = "libcudart.so.13"
CUBLAS_SONAME = "libcublas.so.13"


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        raise BuildError("nvcc not found on PATH (CUDA 13 toolkit needed)")
    return nvcc


def find_cuobjdump(dirs: list[Path] | None = None) -> Path:
    """cuobjdump from `dirs` (default: nvcc's toolkit's bin/ and the
    nvidia-cuda-cuobjdump wheel's), else PATH; any 13.x reads sm_90 and sm_12x code."""
    if dirs is None:
        dirs = [_cuda_home(find_nvcc()) / "bin"]
        dirs += [w] if (w := _nvidia_dir("bin")) else []
    candidates = [d / "cuobjdump" for d in dirs]
    if found := shutil.which("cuobjdump"):
        candidates.append(Path(found))
    hit = next((c for c in candidates if c.is_file()), None)
    if hit is None:
        raise BuildError(
            "cuobjdump not found (the toolkit's bin/, the nvidia-cuda-cuobjdump "
            "wheel, PATH)"
        )
    return hit


def host_compiler(machine: str) -> str:
    """nvcc's host compiler for code that runs on `machine`: this machine's g++ ($CXX)
    for its own, Debian's cross compiler for another."""
    if machine == host_machine():
        return os.environ.get("CXX", "g++")
    cxx = CROSS_CXX.format(machine=machine)
    if shutil.which(cxx) is None:
        raise BuildError(
            f"{cxx} not found: the host compiler for {machine} (Debian: apt-get "
            f"install g++-{machine.replace('_', '-')}-linux-gnu)"
        )
    return cxx


def _cuda_home(nvcc: str) -> Path:
    """The toolkit of `nvcc`, which may be a wrapper script outside it
    (/usr/local/bin/nvcc here)."""
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (cuda_home / "include" / "cuda_runtime.h").exists():
        cuda_home = Path(nvcc).resolve().parent.parent
    return cuda_home


def find_toolchain() -> Toolchain:
    nvcc = find_nvcc()
    cuda_home = _cuda_home(nvcc)
    cuda_include = [str(cuda_home / "include")]
    wheel_include = _nvidia_dir("include")
    if not (cuda_home / "include" / "cublas_v2.h").exists():
        if wheel_include is None:
            raise BuildError(
                "cublas_v2.h found neither in the CUDA toolkit nor in nvidia/cu13"
            )
        cuda_include.append(str(wheel_include))
    candidates = [cuda_home / "lib64" / "libcublas.so"]
    wheel_lib = _nvidia_dir("lib")
    if wheel_lib:
        candidates.append(wheel_lib / CUBLAS_SONAME)
    cublas = next((c for c in candidates if c.exists()), None)
    if cublas is None:
        raise BuildError(
            f"libcublas not found (looked in {', '.join(map(str, candidates))})"
        )
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        raise BuildError("torch is not importable from this Python")
    torch_dir = Path(spec.origin).parent
    return Toolchain(
        nvcc=nvcc,
        cxx=os.environ.get("CXX", "g++"),
        cuda_include=cuda_include,
        torch_include=torch_dir / "include",
        torch_lib=torch_dir / "lib",
        python_include=sysconfig.get_paths()["include"],
        cublas_lib=cublas,
    )


def target_toolchain(root: Path, site: Path, machine: str) -> Toolchain:
    """Build against the Python environment `site` (site-packages) of the root file
    system `root` for `machine` (x86_64, aarch64) with this machine's nvcc.

    nvcc's host compiler is this machine's g++ for its own machine and Debian's cross
    compiler otherwise. CUDA's headers are the toolkit's own (its CCCL folder named
    explicitly: nvcc adds it only for its own machine's target tree); torch, the CUDA
    runtime and cuBLAS are the root's, and Python's headers are the root's
    (python3-dev)."""
    nvcc = find_nvcc()
    cxx = host_compiler(machine)
    cuda_home = _cuda_home(nvcc)
    cuda_include = [str(cuda_home / "include"), str(cuda_home / "include" / "cccl")]
    nvidia = site / "nvidia" / "cu13"
    if not (cuda_home / "include" / "cublas_v2.h").exists():
        cuda_include.append(str(nvidia / "include"))
    pythons = sorted((root / "usr" / "include").glob("python3.*"))
    problems = [
        f"{p} is missing"
        for p in (
            site / "torch" / "include",
            nvidia / "lib" / CUDART_SONAME,
            nvidia / "lib" / CUBLAS_SONAME,
        )
        if not p.exists()
    ]
    if len(pythons) != 1:
        problems.append(
            f"{root}/usr/include holds {len(pythons)} python3.* header folders, "
            "not one (python3-dev)"
        )
    if problems:
        raise BuildError(f"cannot build against {site}: " + "; ".join(problems))
    return Toolchain(
        nvcc=nvcc,
        cxx=cxx,
        cuda_include=cuda_include,
        torch_include=site / "torch" / "include",
        torch_lib=site / "torch" / "lib",
        python_include=str(pythons[0]),
        cublas_lib=nvidia / "lib" / CUBLAS_SONAME,
        ccbin=cxx,
        cudart_lib=nvidia / "lib" / CUDART_SONAME,
        include_after=(str(root / "usr" / "include"),),
    )


def _includes(tc: Toolchain) -> list[str]:
    return [f"-I{SOURCES}", f"-I{tc.torch_include}", f"-I{tc.python_include}"] + [
        f"-I{d}" for d in tc.cuda_include
    ]


def sources(out_dir: Path, with_standalone: bool = True) -> list[Path]:
    """The translation units of the extension: the checked-in ones and the generated
    per-rate units (written into out_dir/generated, unchanged files left alone)."""
    generated = kernel_generator().write_build_sources(Path(out_dir) / GENERATED_DIR)
    names = {p.name for p in generated}
    checked_in = [
        p
        for pattern in SOURCE_GLOBS
        for p in STABLE_SOURCES.glob(pattern)
        if p.name not in names  # a stale generated copy beside the sources
        and (with_standalone or p.name != STANDALONE)
    ]
    return sorted(checked_in + generated, key=lambda p: p.name)


# A registration block of our sources, `STABLE_TORCH_LIBRARY_FRAGMENT(_C, m) { ... }`,
# and one `.def("schema")` in it (the schema may be split into adjacent literals).
_FRAGMENT = re.compile(
    r"STABLE_TORCH_LIBRARY_FRAGMENT\(_C,\s*\w+\)\s*\{(.*?)\n\}", re.S
)
_DEF = re.compile(r"\.def\(\s*((?:\"[^\"]*\"\s*)+)\)")


def op_schemas(files: Iterable[Path]) -> dict[str, str]:
    """name -> schema of every op the given sources define in `_C`."""
    schemas = {}
    for src in sorted(files):
        for block in _FRAGMENT.findall(src.read_text()):
            for literals in _DEF.findall(block):
                schema = "".join(re.findall(r"\"([^\"]*)\"", literals))
                schemas[schema.split("(", 1)[0]] = schema
    return schemas


def _stale(obj: Path, src: Path) -> bool:
    if not obj.exists():
        return True
    # Any header of the source's directory, of the EXL3 directory (the generated units
    # include its headers) or of the shared one (exl3_mma.cuh, exl3_tensor_checks.h)
    # may be included, and this file holds the flags: rebuild when either is newer.
    newest = max(
        [
            p.stat().st_mtime
            for d in {src.parent, SOURCES, STABLE_SOURCES}
            for p in d.iterdir()
            if p.is_file()
        ]
        + [Path(__file__).stat().st_mtime]
    )
    return obj.stat().st_mtime < max(newest, src.stat().st_mtime)


def _compile_commands(
    tc: Toolchain, archs: list[str], obj_dir: Path, srcs: list[Path]
) -> list[tuple[Path, Path, list[str]]]:
    jobs = []
    ccbin = ["-ccbin", tc.ccbin] if tc.ccbin else []
    after = [f for d in tc.include_after for f in ("-idirafter", d)]
    for src in srcs:
        obj = obj_dir / (src.name + ".o")
        if src.suffix == ".cu":
            cmd = [
                tc.nvcc,
                *ccbin,
                *NVCC_FLAGS,
                *gencode_flags(archs),
                *DEFINES,
                *_includes(tc),
                "-c",
                str(src),
                "-o",
                str(obj),
            ]
        else:
            cmd = [
                tc.cxx,
                *CXX_FLAGS,
                *DEFINES,
                *_includes(tc),
                *after,
                "-c",
                str(src),
                "-o",
                str(obj),
            ]
        jobs.append((src, obj, cmd))
    return jobs


def _link_command(
    tc: Toolchain, archs: list[str], objects: list[Path], target: Path
) -> list[str]:
    # nvcc links its own CUDA runtime unless the toolchain names the environment's.
    cudart = ["-cudart", "shared" if tc.cudart_lib is None else "none"]
    cudart_lib = (
        [f"-L{tc.cudart_lib.parent}", f"-l:{tc.cudart_lib.name}"]
        if tc.cudart_lib
        else []
    )
    return [
        tc.nvcc,
        *(["-ccbin", tc.ccbin] if tc.ccbin else []),
        "-shared",
        *cudart,
        *gencode_flags(archs),
        "-o",
        str(target),
        *map(str, objects),
        *cudart_lib,
        f"-L{tc.torch_lib}",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_cuda",
        "-lc10",
        f"-L{tc.cublas_lib.parent}",
        f"-l:{tc.cublas_lib.name}",
        # Installed as vllm/_exl3_C.abi3.so: torch and the CUDA wheels sit beside vllm/.
        "-Xlinker",
        "-rpath=$ORIGIN/../torch/lib:$ORIGIN/../nvidia/cu13/lib",
    ]


def _run(cmd: list[str], what: str) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{what} failed:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return time.monotonic() - t0


def _object_dir(out_dir: Path, archs: list[str]) -> tuple[list[str], Path, Path]:
    """The architectures normalized, out_dir resolved, and the folder (made) their
    objects go to."""
    archs = sorted({normalize_arch(a) for a in archs}, key=int)
    if not archs:
        raise BuildError("no CUDA architecture given")
    out_dir = Path(out_dir).resolve()
    obj_dir = out_dir / "obj" / ("sm" + "_".join(archs))
    obj_dir.mkdir(parents=True, exist_ok=True)
    return archs, out_dir, obj_dir


def compile_units(
    out_dir: Path, archs: list[str], names: list[str], jobs: int
) -> list[Path]:
    """Only the named translation units (generated or checked in), compiled for `archs`
    with the build's own commands into out_dir; their objects."""
    archs, out_dir, obj_dir = _object_dir(out_dir, archs)
    tc = find_toolchain()
    by_name = {s.name: s for s in sources(out_dir, with_standalone=False)}
    missing = sorted(set(names) - set(by_name))
    if missing:
        raise BuildError(f"no translation unit named {', '.join(missing)}")
    work = _compile_commands(tc, archs, obj_dir, [by_name[n] for n in names])
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(lambda w: _run(w[2], f"compiling {w[0].name}"), work))
    return [o for _, o, _ in work]


def build_extension(
    out_dir: Path,
    archs: list[str],
    jobs: int,
    compile_only: bool = False,
    verbose: bool = False,
    toolchain: Toolchain | None = None,
) -> Path:
    """Build `_exl3_C.abi3.so` into out_dir (returned), or only its objects if
    compile_only (then the object directory is returned). Unchanged objects are reused.
    `toolchain`: another environment's (target_toolchain); default this Python's.
    """
    archs, out_dir, obj_dir = _object_dir(out_dir, archs)
    tc = toolchain or find_toolchain()
    srcs = sources(out_dir, with_standalone=not compile_only)
    work = [
        (s, o, c)
        for s, o, c in _compile_commands(tc, archs, obj_dir, srcs)
        if _stale(o, s)
    ]
    # Largest translation units first, so the long ones don't start last.
    work.sort(key=lambda w: (w[0].suffix != ".cu", -w[0].stat().st_size))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            pool.submit(_run, cmd, f"compiling {src.name}"): src for src, _, cmd in work
        }
        for fut in concurrent.futures.as_completed(futures):
            seconds = fut.result()
            if verbose:
                print(f"  {futures[fut].name}: {seconds:.1f} s", file=sys.stderr)
    if compile_only:
        return obj_dir
    objects = [o for _, o, _ in _compile_commands(tc, archs, obj_dir, srcs)]
    return link_extension(tc, archs, objects, out_dir / EXTENSION)


def link_extension(
    tc: Toolchain,
    archs: list[str],
    objects: list[Path],
    target: Path,
    host_link_flags: tuple[str, ...] = (),
) -> Path:
    """Link `objects` into `target` and check that it takes the shared C++ runtime
    (cxx_runtime.py): a BuildError otherwise, the library left in place.
    `host_link_flags` go to nvcc's host compiler."""
    cmd = _link_command(tc, archs, objects, target)
    at = cmd.index("-shared") + 1
    for flag in reversed(host_link_flags):
        cmd[at:at] = ["-Xcompiler", flag]
    _run(cmd, "linking " + target.name)
    problem = library_problem(
        target, tc.ccbin or "nvcc's default host compiler (the g++ on PATH)"
    )
    if problem:
        raise BuildError(problem)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--arch",
        action="append",
        default=None,
        help="CUDA architecture (repeatable): one of "
        + ", ".join(map(dotted, BUILT_ARCHS))
        + " (default 9.0)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        path = build_extension(
            args.out, args.arch or ["9.0"], args.jobs, args.compile_only, verbose=True
        )
    except BuildError as e:
        print(f"kernels_build: {e}", file=sys.stderr)
        return 1
    print(f"{path} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
