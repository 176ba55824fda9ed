# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's own CMake build of the patched sdist, offline: our objects of
`_C_stable_libtorch` (`build --from-source --only objects`, the CI step), or that whole
target installed into a vLLM in place of the release library (`--only target`, a CUDA
host). Never all of vLLM.

The tree is the pinned sdist's build inputs (CMakeLists.txt, cmake/, csrc/, PKG-INFO and
the files the patches edit) with the series applied, configured exactly as vLLM's
setup.py configures it (Ninja, CMAKE_BUILD_TYPE=Release as the release wheels,
TORCH_CUDA_ARCH_LIST from --archs, NVCC_THREADS=1) and built with ninja by target name.
Nothing is fetched at configure time (FETCHCONTENT_FULLY_DISCONNECTED):

- CUTLASS, the one repository `_C_stable_libtorch` compiles against, at the revision the
  sdist pins (v4.4.2), comes from a PyPI wheel that ships its headers and its Python
  generator (flashinfer-python 0.6.10: include/, tools/util/include/ and
  python/cutlass_library/ are byte-identical to CUTLASS's v4.4.2 tag; the Machete
  generator runs at configure time). The wheel has no CUTLASS CMakeLists.txt, so the
  CUTLASS_* include variables its CMake would set are given directly.
- The seven other repositories (vllm-flash-attn, FlashMLA, DeepGEMM, QuTLASS,
  triton_kernels, fmha_sm100, tml-fa4) feed only their own targets, which are never
  built here: each gets a stand-in directory holding empty files at exactly the paths
  the sdist's cmake/external_projects/*.cmake read or list, so configure and generate
  pass.
- On a toolkit without them (CI's: nvcc and headers from NVIDIA's wheels), the cuBLAS
  headers (and for the whole target cuRAND's) come from the wheels torch depends on
  (LIBRARY_HEADERS), and the libraries torch's
  CMake links every target against (libcuda, libnvrtc, libcudart) from the driver and
  torch's wheels; for objects alone, where there are none (CI), stand-in paths: no
  object is linked.

`--pack FILE` writes those inputs (the sdist's build files with the series applied, and
CUTLASS: about 2 MB) for a host without network or git; `--source-pack FILE` builds from
one, refusing a pack of another series. The build is
incremental (unchanged files keep their timestamps) and resumable: `--background`
detaches it, `--status` reports it, and running the same command again continues where
a stopped one left off.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import ToolError
from .apply import apply_onto
from .cxx_runtime import library_problem, link_compiler, static_libstdcxx_problem
from .fetch import ensure_pinned, ensure_sdist_tree, wheels_dir
from .repo import SDIST_SHA256, VLLM_VERSION, Series, git_label
from .series import STATE_DIR, parse_patch

TARGET = "_C_stable_libtorch"
# Where CMake's Ninja generator puts the target's objects: <this>/<source path>.o.
OBJECT_DIR = f"CMakeFiles/{TARGET}.dir"
# The quick build's entry point; not part of vLLM's target (patch 0003 excludes it).
STANDALONE = "standalone_module.cpp"
# vLLM's own sources whose compile commands are the reference for ours: the target's
# flags, less the per-file architecture flags.
REFERENCE_SOURCES = {
    "CUDA": "csrc/libtorch_stable/activation_kernels.cu",
    "CXX": "csrc/libtorch_stable/torch_bindings.cpp",
}
# What of the sdist vLLM's CMake reads for this target (plus the files the patches
# edit, so the series applies).
BUILD_INPUTS = ("CMakeLists.txt", "cmake", "csrc", "PKG-INFO")
# vLLM's [build-system] requirement (pyproject.toml).
CMAKE_MINIMUM = (3, 26, 1)


@dataclass(frozen=True)
class PinnedWheel:
    project: str
    filename: str
    sha256: str  # computed on the downloaded file; agrees with the index's


# CUTLASS: the revision CMakeLists.txt pins (checked against the tree at configure) and
# the wheel that carries it.
CUTLASS_REVISION = "v4.4.2"
CUTLASS_WHEEL = PinnedWheel(
    "flashinfer-python",
    "flashinfer_python-0.6.10-py3-none-any.whl",
    "8bdfc2db80e462c41a1bc35dffeae9c6b4d012dee75e0766432c8efbdfd4398d",
)
CUTLASS_IN_WHEEL = "flashinfer/data/cutlass/"
# What vLLM's CMake uses of a CUTLASS checkout: CUTLASS_INCLUDE_DIR,
# CUTLASS_TOOLS_UTIL_INCLUDE_DIR, and ${CUTLASS_DIR}/python for the Machete generator.
CUTLASS_PARTS = ("include/", "tools/util/include/", "python/cutlass_library/")

# cmake and ninja when the machine's own are missing or too old: pinned wheels (x86_64
# only; elsewhere install cmake>=3.26.1 and ninja), the executable's path inside each.
TOOL_WHEELS = {
    "x86_64": {
        "cmake": (
            PinnedWheel(
                "cmake",
                "cmake-3.31.10-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                "2f766bb46367e5e0559fa33184653754bce044583a06014dcaebf8e6dff8a1f1",
            ),
            "cmake/data/bin/cmake",
        ),
        "ninja": (
            PinnedWheel(
                "ninja",
                "ninja-1.13.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                "fb46acf6b93b8dd0322adc3a4945452a4e774b75b91293bafcc7b7f8e6517dfa",
            ),
            "ninja-1.13.0.data/scripts/ninja",
        ),
    }
}

# The seven other repositories: the CMake variable that points vLLM at a local tree,
# and the FetchContent name in their ${<name>_SOURCE_DIR}. triton_kernels.cmake reads
# its own variable from the environment only, so FetchContent's override is used (a
# cache variable survives ninja's automatic re-configure; the environment does not).
STANDINS = (
    ("VLLM_FLASH_ATTN_SRC_DIR", "vllm-flash-attn"),
    ("FLASH_MLA_SRC_DIR", "flashmla"),
    ("DEEPGEMM_SRC_DIR", "deepgemm"),
    ("QUTLASS_SRC_DIR", "qutlass"),
    ("FETCHCONTENT_SOURCE_DIR_TRITON_KERNELS", "triton_kernels"),
    ("FMHA_SM100_SRC_DIR", "fmha_sm100"),
    ("TML_FA4_SRC_DIR", "tml_fa4"),
)
# A file path under ${<name>_SOURCE_DIR} in vLLM's CMake (globs and directories are
# left out: they need nothing to exist).
_STANDIN_FILE_RE = re.compile(
    r"\$\{([\w-]+)_SOURCE_DIR\}/([\w./-]+\.(?:cu|cuh|cpp|h|hpp|py))\b"
)

STATE_FILE = "state.json"
LOG_FILE = "build.log"
CONFIGURE_KEY = ".vllm-exl3-configure.json"
SYNC_MANIFEST = ".vllm-exl3-synced.json"
PACK_MANIFEST = "pack.json"
# Exit status of --status while the background build runs.
STATUS_RUNNING = 2


# --- Machine pieces -----------------------------------------------------------


def cuda_toolkit() -> Path | None:
    """The CUDA toolkit: $CUDA_HOME, next to the nvcc on PATH, or /usr/local/cuda."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]))
    if nvcc := shutil.which("nvcc"):
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        if (root / "bin" / "nvcc").is_file() and (
            root / "include" / "cuda_runtime.h"
        ).is_file():
            return root
    return None


_PYTHON_PROBE = """
import importlib.util, json
spec = importlib.util.find_spec("nvidia")
torch = importlib.util.find_spec("torch")
print(json.dumps({
    "nvidia": list(spec.submodule_search_locations or []) if spec else [],
    "torch": torch.origin if torch else None,
}))
"""


@dataclass(frozen=True)
class Machine:
    python: Path  # vLLM's VLLM_PYTHON_EXECUTABLE: has torch 2.11.0
    cuda: Path
    cmake: Path
    ninja: Path
    nvidia_dirs: tuple[Path, ...]  # torch's CUDA wheels (nvidia/cu13)

    def nvidia(self, sub: str) -> list[Path]:
        return [
            d / "cu13" / sub for d in self.nvidia_dirs if (d / "cu13" / sub).is_dir()
        ]

    def env(self, archs: list[str]) -> dict[str, str]:
        # CMake's CUDA detection starts from the nvcc it finds first: a wrapper script
        # elsewhere on PATH (/usr/local/bin/nvcc) hides the toolkit's include/ and lib/.
        path = f"{self.cuda / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        return {
            **os.environ,
            "CUDA_HOME": str(self.cuda),
            "PATH": path,
            # torch's CMake reads the architectures from the environment, also when
            # ninja re-runs CMake by itself.
            "TORCH_CUDA_ARCH_LIST": " ".join(archs),
        }


def _version_of(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(g) for g in m.groups()) if m else None


def _machine_name() -> str:
    m = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m.lower(), m)


def _unzip(wheel: Path, dest: Path, prefix: str = "") -> None:
    """Extract the members under `prefix` (stripped), keeping executable bits."""
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not info.filename.startswith(prefix) or info.is_dir():
                continue
            rel = info.filename[len(prefix) :]
            if rel.startswith("/") or ".." in Path(rel).parts:
                raise ToolError(f"{wheel}: refusing member {info.filename!r}")
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            if (info.external_attr >> 16) & 0o111:
                os.chmod(target, 0o755)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def _tool(name: str, minimum: tuple[int, ...], cache: Path, offline: bool) -> Path:
    """The machine's `name` when it meets `minimum`, else the pinned wheel's."""
    found = shutil.which(name)
    if found and (_version_of(found) or (0,)) >= minimum:
        return Path(found)
    pins = TOOL_WHEELS.get(_machine_name(), {})
    if name not in pins:
        have = f"{found} is {_version_of(found)}" if found else "none on PATH"
        raise ToolError(
            f"{name} >= {'.'.join(map(str, minimum))} is needed ({have}) and no wheel "
            f"of it is pinned for {_machine_name()}: pip install {name}"
        )
    wheel, inside = pins[name]
    unpacked = cache / "build-tools" / wheel.filename.removesuffix(".whl")
    exe = unpacked / inside
    if not exe.is_file():
        path = ensure_pinned(
            wheel.filename, wheel.sha256, wheels_dir(cache), offline, wheel.project
        )
        _unzip(path, unpacked)
    return exe


def find_machine(python: Path, cache: Path, offline: bool) -> Machine:
    # vLLM's CMake wants the interpreter's path (`--python python3` names a command).
    python = Path(shutil.which(str(python)) or python).absolute()
    cuda = cuda_toolkit()
    if cuda is None:
        raise ToolError(
            "no CUDA 13 toolkit (bin/nvcc and include/cuda_runtime.h) at $CUDA_HOME, "
            "next to the nvcc on PATH, or at /usr/local/cuda; set CUDA_HOME"
        )
    probe = subprocess.run(
        [str(python), "-c", _PYTHON_PROBE], capture_output=True, text=True
    )
    if probe.returncode != 0:
        raise ToolError(f"{python} cannot be probed: {probe.stderr.strip()[-500:]}")
    info = json.loads(probe.stdout)
    if not info["torch"]:
        raise ToolError(f"{python} has no torch (vLLM's CMake needs torch 2.11.0)")
    return Machine(
        python=python,
        cuda=cuda,
        cmake=_tool("cmake", CMAKE_MINIMUM, cache, offline),
        ninja=_tool("ninja", (1, 0, 0), cache, offline),
        nvidia_dirs=tuple(Path(p) for p in info["nvidia"]),
    )


# --- Sources: the sdist subset, CUTLASS, the stand-ins ------------------------


def patched_paths(series: Series) -> list[str]:
    """The sdist files the series' patches edit."""
    return sorted({fd.path for p in series.patches for fd in parse_patch(p).files})


def _copy_inputs(src: Path, dest: Path, extra: list[str]) -> None:
    for rel in (*BUILD_INPUTS, *extra):
        s, d = src / rel, dest / rel
        if s.is_dir():
            shutil.copytree(s, d, symlinks=True)
        elif s.is_file():
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)
        else:
            raise ToolError(f"{src} lacks {rel} (not a vLLM {VLLM_VERSION} sdist tree)")


def cutlass_dir(cache: Path, offline: bool) -> Path:
    """CUTLASS's headers and Python generator at CUTLASS_REVISION, from the pinned
    wheel, unpacked once into the cache."""
    dest = cache / f"cutlass-{CUTLASS_REVISION}"
    if not (dest / "include" / "cutlass" / "version.h").is_file():
        wheel = ensure_pinned(
            CUTLASS_WHEEL.filename,
            CUTLASS_WHEEL.sha256,
            wheels_dir(cache),
            offline,
            CUTLASS_WHEEL.project,
        )
        tmp = dest.with_name(dest.name + ".all")
        _unzip(wheel, tmp, CUTLASS_IN_WHEEL)
        keep = dest.with_name(dest.name + ".keep")
        shutil.rmtree(keep, ignore_errors=True)
        for part in CUTLASS_PARTS:
            shutil.copytree(tmp / part, keep / part)
        shutil.rmtree(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        keep.rename(dest)
    return dest


def cutlass_version(root: Path) -> str:
    text = (root / "include" / "cutlass" / "version.h").read_text()
    parts = [
        re.search(rf"#define CUTLASS_{k} (\d+)", text)
        for k in ("MAJOR", "MINOR", "PATCH")
    ]
    if not all(parts):
        raise ToolError(f"{root}/include/cutlass/version.h has no CUTLASS version")
    return "v" + ".".join(m.group(1) for m in parts)


@dataclass(frozen=True)
class Sources:
    """The inputs: the pristine sdist, or a pack's build files with the series already
    applied (`patched`: the host needs no git to apply it), and CUTLASS."""

    sdist: Path
    cutlass: Path
    patched: bool = False


def sources_from_cache(cache: Path, offline: bool) -> Sources:
    return Sources(ensure_sdist_tree(cache, offline), cutlass_dir(cache, offline))


def _patched_inputs(sources: Sources, series: Series, dest: Path) -> None:
    """The build inputs with the series applied, into `dest` (a new folder)."""
    if sources.patched:
        shutil.copytree(sources.sdist, dest, symlinks=True)
        return
    _copy_inputs(sources.sdist, dest, patched_paths(series))
    (dest / "vllm").mkdir(exist_ok=True)  # apply's check that this is a vLLM tree
    apply_onto(dest, series)
    shutil.rmtree(dest / STATE_DIR)  # the record describes this copy


def write_pack(sources: Sources, series: Series, out: Path) -> Path:
    """A tar.xz of the build inputs with this series applied, and CUTLASS, for a host
    without network (or git); its manifest names the series it holds."""
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        _patched_inputs(sources, series, stage / "tree")
        shutil.copytree(sources.cutlass, stage / "cutlass")
        manifest = {
            "vllm": VLLM_VERSION,
            "sdist_sha256": SDIST_SHA256,
            "series": series.fingerprint("sdist"),
            "commit": git_label(series.root),
            "cutlass": cutlass_version(sources.cutlass),
            "cutlass_wheel": dataclasses.asdict(CUTLASS_WHEEL),
        }
        (stage / PACK_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        with tarfile.open(part, "w:xz") as tar:
            for name in (PACK_MANIFEST, "tree", "cutlass"):
                tar.add(stage / name, arcname=name)
        part.replace(out)
    return out


def sources_from_pack(pack: Path, cache: Path, series: Series) -> Sources:
    """Unpack a --pack archive (once per archive content, into cache/packs) and check
    that it holds the pinned sdist with this checkout's series. Its CUTLASS goes where
    the pinned wheel's would (one path for every pack: a new pack does not make CMake
    configure, and ninja rebuild, from scratch)."""
    digest = hashlib.sha256(pack.read_bytes()).hexdigest()[:16]
    dest = cache / "packs" / f"pack-{digest}"
    if not (dest / PACK_MANIFEST).is_file():
        tmp = dest.with_name(dest.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(pack) as tar:
            # Where available (3.11.4 on), the "data" filter refuses members that
            # leave the folder, links out of it and devices.
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, **safe)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    manifest = json.loads((dest / PACK_MANIFEST).read_text())
    if manifest.get("sdist_sha256") != SDIST_SHA256:
        raise ToolError(
            f"{pack} was packed from another vLLM sdist ({manifest.get('vllm')}); "
            f"this series is for vLLM {VLLM_VERSION}: write a new pack with --pack"
        )
    if manifest.get("series") != series.fingerprint("sdist"):
        raise ToolError(
            f"{pack} holds the series of {manifest.get('commit') or 'another checkout'}"
            f", not this checkout's ({git_label(series.root) or series.root}): write "
            "a new pack with --pack from this commit"
        )
    cutlass = cache / f"cutlass-{CUTLASS_REVISION}"
    if cutlass_version(dest / "cutlass") != CUTLASS_REVISION:
        raise ToolError(f"{pack} holds CUTLASS {manifest.get('cutlass')}")
    if not (cutlass / "include" / "cutlass" / "version.h").is_file():
        shutil.rmtree(cutlass, ignore_errors=True)
        shutil.copytree(dest / "cutlass", cutlass)
    return Sources(dest / "tree", cutlass, patched=True)


def standin_files(tree: Path) -> dict[str, list[str]]:
    """FetchContent name -> the files vLLM's CMake reads or lists under its source
    directory."""
    found: dict[str, set[str]] = {name: set() for _, name in STANDINS}
    for f in sorted((tree / "cmake" / "external_projects").glob("*.cmake")):
        for name, rel in _STANDIN_FILE_RE.findall(f.read_text()):
            if name in found:
                found[name].add(rel)
    return {name: sorted(files) for name, files in found.items()}


def _put(dest: Path, data: bytes) -> None:
    """Write `dest` only when its bytes differ: a rewritten header or CMake input would
    make ninja recompile or re-configure."""
    if dest.is_file() and dest.read_bytes() == data:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)


def make_standins(tree: Path, dest: Path) -> dict[str, Path]:
    """CMake variable -> a stand-in directory for each repository we never build."""
    out = {}
    for (var, name), files in zip(STANDINS, standin_files(tree).values(), strict=True):
        root = dest / name
        root.mkdir(parents=True, exist_ok=True)
        for rel in files:
            _put(root / rel, b"")
        out[var] = root
    return out


def sync_tree(staging: Path, tree: Path) -> int:
    """Make `tree` hold `staging`'s files, rewriting only the files whose bytes differ
    (ninja then recompiles only what changed) and removing those an earlier sync wrote
    that are gone; files CMake generated in the tree are left alone. Returns the number
    of files written."""
    new = sorted(
        p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file()
    )
    manifest = tree / SYNC_MANIFEST
    old = set(json.loads(manifest.read_text())) if manifest.is_file() else set()
    written = 0
    for rel in new:
        s, d = staging / rel, tree / rel
        same_size = d.is_file() and d.stat().st_size == s.stat().st_size
        if same_size and d.read_bytes() == s.read_bytes():
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(s, d)
        shutil.copymode(s, d)
        written += 1
    for rel in sorted(old - set(new)):
        (tree / rel).unlink(missing_ok=True)
    manifest.write_text(json.dumps(new) + "\n")
    return written


def prepare_tree(sources: Sources, series: Series, work: Path) -> Path:
    """work/src: the build inputs with the series applied (incrementally updated)."""
    staging = work / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    _patched_inputs(sources, series, staging)
    tree = work / "src"
    written = sync_tree(staging, tree)
    shutil.rmtree(staging)
    print(f"vllm-cmake: {tree} ({written} file(s) changed)")
    return tree


# --- Configure ----------------------------------------------------------------


def arch_key(arch: str) -> float:
    """Sort key of a CMake architecture ('9.0a' before '12.0f')."""
    return float(arch.rstrip("af"))


def expected_archs(archs: list[str]) -> list[str]:
    """The EXL3 block's architectures (patch 0003) for requested ones: the kernels'
    BUILT_ARCHS map (9.0 -> 9.0a, 12.0 and 12.1 -> the 12.0f family image)."""
    # Imported here: `build` loads this module, and works (quick build with
    # --no-kernels) in a copy of the tool without the kernel build.
    from .kernels_build import BUILT_ARCHS, BuildError, normalize_arch

    try:
        built = {BUILT_ARCHS[normalize_arch(a)] for a in archs}
        return sorted(built, key=arch_key)
    except BuildError as e:
        raise ToolError(str(e)) from e


def _driver_libraries() -> list[Path]:
    """The driver's libcuda.so.1 as the dynamic loader's cache lists it, and where
    driver containers put it."""
    try:
        cache = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True
        ).stdout
    except OSError:
        cache = ""
    listed = re.findall(r"^\s*libcuda\.so\.1 .*=> (\S+)$", cache, re.M)
    usual = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64")
    return [Path(p) for p in listed] + [Path(d) / "libcuda.so.1" for d in usual]


def _link_libraries(machine: Machine, only: str, standins: Path) -> dict[str, str]:
    """Cache values for the libraries torch's CMake links every target against, where
    CMake would not find them in the toolkit itself (a toolkit assembled from NVIDIA's
    wheels has no stubs/ and only versioned names): the driver's own libcuda, and
    torch's nvrtc and cudart wheels. Objects are never linked: there a stand-in path
    is enough."""
    lib = machine.cuda / "lib64"
    wheel_libs = machine.nvidia("lib")
    # variable -> (where CMake looks itself, the fallbacks in order)
    where = {
        "CUDA_cuda_driver_LIBRARY": (
            [lib / "stubs" / "libcuda.so", lib / "libcuda.so"],
            _driver_libraries(),
        ),
        "CUDA_nvrtc_LIBRARY": (
            [lib / "libnvrtc.so"],
            [lib / "libnvrtc.so.13"] + [d / "libnvrtc.so.13" for d in wheel_libs],
        ),
    }
    cudart = [lib / "libcudart.so.13"] + [d / "libcudart.so.13" for d in wheel_libs]
    for var in ("CUDA_CUDART_LIBRARY", "CUDA_cudart_LIBRARY"):  # FindCUDA, CUDAToolkit
        where[var] = ([lib / "libcudart.so"], cudart)
    out, missing = {}, []
    for var, (own, fallbacks) in where.items():
        if var in user_cmake_args() or any(c.is_file() for c in own):
            continue
        hit = next((c for c in fallbacks if c.is_file()), None)
        if hit is None and only == "objects":
            hit = standins / "link" / Path(own[-1]).name
            _put(hit, b"")
        if hit is None:
            missing.append(f"{own[-1].name} ({', '.join(map(str, own + fallbacks))})")
        else:
            out[var] = str(hit)
    if missing:
        raise ToolError(
            f"linking {TARGET} needs " + "; ".join(missing) + ": none found (or give "
            "the path in CMAKE_ARGS, -D<variable>=<path>)"
        )
    return out


# The CUDA math libraries' headers vLLM's sources include, each with the header that
# marks it and the wheel torch's dependencies bring it in: cublas_v2.h (vLLM's
# torch_utils.h, our exl3_ops.cpp) and curand_kernel.h (CUTLASS's tensor_fill.h, which
# the W4A8 grouped GEMMs of the whole target include).
LIBRARY_HEADERS = (
    ("cublas_v2.h", "cublas*.h", "nvidia-cublas", ("objects", "target")),
    ("curand_kernel.h", "curand*.h", "nvidia-curand", ("target",)),
)


def _library_headers(machine: Machine, standins: Path, only: str) -> Path | None:
    """A directory with the math libraries' headers the toolkit lacks (a toolkit
    assembled from NVIDIA's wheels has none), copied from torch's CUDA wheels."""
    dest = standins / "library-include"
    copied = False
    for marker, pattern, wheel, needed_by in LIBRARY_HEADERS:
        if only not in needed_by or (machine.cuda / "include" / marker).is_file():
            continue
        found = [d for d in machine.nvidia("include") if (d / marker).is_file()]
        if not found:
            raise ToolError(
                f"{marker} is neither in {machine.cuda}/include nor in torch's "
                f"{wheel} wheel"
            )
        for h in found[0].glob(pattern):
            _put(dest / h.name, h.read_bytes())
        copied = True
    return dest if copied else None


def check_cutlass_pin(tree: Path, cutlass: Path) -> None:
    m = re.search(
        r'set\(CUTLASS_REVISION "([^"]+)"\)', (tree / "CMakeLists.txt").read_text()
    )
    pinned = m.group(1) if m else None
    have = cutlass_version(cutlass)
    if pinned != have or pinned != CUTLASS_REVISION:
        raise ToolError(
            f"CMakeLists.txt pins CUTLASS {pinned}; the CUTLASS given is {have} "
            f"(vllm_cmake.CUTLASS_REVISION {CUTLASS_REVISION}): they must agree"
        )


def cutlass_args(cutlass: Path) -> list[str]:
    """CUTLASS for vLLM's CMake: its source directory, and the variables CUTLASS's own
    CMakeLists.txt (absent from the wheel) would set."""
    return [
        f"-DVLLM_CUTLASS_SRC_DIR={cutlass}",
        f"-DCUTLASS_DIR={cutlass}",
        f"-DCUTLASS_INCLUDE_DIR={cutlass / 'include'}",
        f"-DCUTLASS_TOOLS_UTIL_INCLUDE_DIR={cutlass / 'tools' / 'util' / 'include'}",
    ]


def user_cmake_args() -> dict[str, str]:
    """$CMAKE_ARGS, which vLLM's setup.py appends to its CMake command, as
    {variable: -D argument}; appended here too, so it overrides what is found."""
    out = {}
    for arg in shlex.split(os.environ.get("CMAKE_ARGS", "")):
        m = re.match(r"-D([A-Za-z_][\w-]*)(?::\w+)?=", arg)
        if m:
            out[m.group(1)] = arg
        else:
            raise ToolError(f"CMAKE_ARGS: {arg!r} is not a -DNAME=VALUE argument")
    return out


def cmake_args(
    machine: Machine, tree: Path, work: Path, cutlass: Path, only: str
) -> list[str]:
    standins = work / "standins"
    args = [
        f"-DCMAKE_MAKE_PROGRAM={machine.ninja}",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DVLLM_TARGET_DEVICE=cuda",
        f"-DVLLM_PYTHON_EXECUTABLE={machine.python}",
        f"-DFETCHCONTENT_BASE_DIR={work / 'deps'}",
        "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",
        "-DNVCC_THREADS=1",
        f"-DCMAKE_CUDA_COMPILER={machine.cuda / 'bin' / 'nvcc'}",
        *cutlass_args(cutlass),
    ]
    args += [f"-D{var}={d}" for var, d in make_standins(tree, standins).items()]
    args += [
        f"-D{var}={path}"
        for var, path in _link_libraries(machine, only, standins).items()
    ]
    if (headers := _library_headers(machine, standins, only)) is not None:
        args += [
            f"-DCMAKE_{lang}_STANDARD_INCLUDE_DIRECTORIES={headers}"
            for lang in ("CXX", "CUDA")
        ]
    return args + list(user_cmake_args().values())


def configure(
    machine: Machine, tree: Path, work: Path, cutlass: Path, archs: list[str], only: str
) -> Path:
    """Configure into work/build unless it is configured with the same arguments
    (ninja re-runs CMake by itself when a CMake file changes)."""
    check_cutlass_pin(tree, cutlass)
    build = work / "build"
    args = cmake_args(machine, tree, work, cutlass, only)
    key = {"args": args, "archs": archs, "cmake": str(machine.cmake)}
    stamp = build / CONFIGURE_KEY
    configured = (build / "build.ninja").is_file() and stamp.is_file()
    if configured and json.loads(stamp.read_text()) == key:
        return build
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    cmd = [str(machine.cmake), "-S", str(tree), "-B", str(build), "-G", "Ninja", *args]
    log = work / "configure.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        r = subprocess.run(
            cmd, env=machine.env(archs), stdout=out, stderr=subprocess.STDOUT
        )
    if r.returncode != 0:
        tail = log.read_text().splitlines()[-40:]
        raise ToolError(
            "vLLM's CMake configure failed ("
            + log.as_posix()
            + "):\n"
            + "\n".join(tail)
        )
    text = log.read_text()
    m = re.search(r"Building EXL3 kernels for archs: (\S+)", text)
    got = sorted(m.group(1).split(";"), key=arch_key) if m else []
    want = expected_archs(archs)
    if got != want:
        raise ToolError(
            f"for TORCH_CUDA_ARCH_LIST={' '.join(archs)} patch 0003's EXL3 block chose "
            f"{got or 'no architecture'}; the kernels are built for {want} there "
            f"(kernels_build.BUILT_ARCHS); see {log}"
        )
    stamp.write_text(json.dumps(key, indent=1) + "\n")
    print(
        f"vllm-cmake: configured in {time.monotonic() - t0:.0f}s; EXL3 archs "
        f"{';'.join(got)}"
    )
    return build


# --- Build --------------------------------------------------------------------


def our_sources(series: Series) -> list[str]:
    """Tree paths of our translation units in the target (checked in and generated)."""
    return sorted(
        f.dest
        for f in series.csrc
        if f.dest.endswith((".cu", ".cpp")) and Path(f.dest).name != STANDALONE
    )


def object_of(source: str) -> str:
    return f"{OBJECT_DIR}/{source}.o"


def _ninja(machine: Machine, build: Path, archs: list[str], *args: str, **kw):
    return subprocess.run(
        [str(machine.ninja), "-C", str(build), *args],
        env=machine.env(archs),
        text=True,
        **kw,
    )


def compile_command(machine: Machine, build: Path, archs: list[str], obj: str) -> str:
    r = _ninja(machine, build, archs, "-t", "commands", "-s", obj, capture_output=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise ToolError(f"ninja knows no command for {obj}: {r.stderr.strip()}")
    return r.stdout.strip().splitlines()[-1]


def check_target_membership(
    machine: Machine, build: Path, archs: list[str], sources: list[str]
) -> list[str]:
    r = _ninja(machine, build, archs, "-t", "targets", "all", capture_output=True)
    targets = {line.split(":", 1)[0] for line in r.stdout.splitlines()}
    missing = [s for s in sources if object_of(s) not in targets]
    if missing:
        raise ToolError(
            f"not compiled into {TARGET} by the patched CMakeLists.txt: "
            + ", ".join(missing)
        )
    stray = [
        t
        for t in targets
        if t.startswith(OBJECT_DIR) and t.endswith(f"/{STANDALONE}.o")
    ]
    if stray:
        raise ToolError(f"{TARGET} compiles the quick build's entry point: {stray}")
    return [object_of(s) for s in sources]


_GENCODE_RE = re.compile(r"arch=compute_(\w+),code=sm_(\w+)")


def gencodes(command: str) -> list[str]:
    """The `-gencode arch=compute_X,code=sm_X` values of an nvcc command, as 'X'."""
    return [a for a, s in _GENCODE_RE.findall(command) if a == s]


def dotted_gencode(code: str) -> str:
    """'90a' -> '9.0a', '120f' -> '12.0f' (CMake's spelling)."""
    m = re.fullmatch(r"(\d+)(\d)([af]?)", code)
    return f"{m.group(1)}.{m.group(2)}{m.group(3)}" if m else code


def attribute_failure(command: str, source: str) -> str:
    """Which architectures a failing nvcc command fails for, with the compiler's first
    error for each: the command again once per -gencode, each alone (output to a
    scratch file)."""
    codes = gencodes(command)
    argv = shlex.split(command)
    failing = []
    with tempfile.TemporaryDirectory() as tmp:
        if not codes:
            first = _first_error(_only_gencode(argv, None, Path(tmp) / "probe.o"))
            return f"{source}: the host compiler fails with {TARGET}'s flags ({first})"
        for code in codes:
            first = _first_error(_only_gencode(argv, code, Path(tmp) / "probe.o"))
            if first is not None:
                failing.append(f"{dotted_gencode(code)} ({first})")
    if not failing:
        together = ", ".join(map(dotted_gencode, codes))
        return f"{source}: fails only with all of {together} together"
    return f"{source}: fails for arch " + "; ".join(failing)


def _first_error(argv: list[str]) -> str | None:
    """Run a compile command: None when it succeeds, else its first error line."""
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    errors = [ln.strip() for ln in r.stderr.splitlines() if "error" in ln]
    return errors[0] if errors else r.stderr.strip()[-200:]


def _only_gencode(argv: list[str], code: str | None, out: Path) -> list[str]:
    """A compile command with only the -gencode for `code` (all kept for None),
    writing to `out`, without a dependency file."""
    res, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "-gencode" and i + 1 < len(argv):
            if code is None or argv[i + 1] == f"arch=compute_{code},code=sm_{code}":
                res += [a, argv[i + 1]]
            i += 2
            continue
        if a in ("-MD",):
            i += 1
            continue
        if a in ("-MT", "-MF"):
            i += 2
            continue
        if a == "-o":
            res += ["-o", str(out)]
            i += 2
            continue
        res.append(a)
        i += 1
    return res


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (ninja and its compilers): a
    figure that, unlike the wall time, does not depend on the machine's other load."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def build_objects(
    machine: Machine,
    build: Path,
    archs: list[str],
    objects: list[str],
    jobs: int,
    log: Path,
) -> None:
    """ninja on exactly these targets, keeping going past failures; every failure is
    named with its source file and the architecture it fails for."""
    t0 = time.monotonic()
    cpu0 = _children_cpu()
    with open(log, "a") as out:
        proc = subprocess.Popen(
            [str(machine.ninja), "-C", str(build), f"-j{jobs}", "-k", "0", *objects],
            env=machine.env(archs),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in proc.stdout:
            out.write(line)
            out.flush()
            if line.startswith(("[", "FAILED")):
                print("  " + line.rstrip()[:160], flush=True)
        rc = proc.wait()
    print(
        f"vllm-cmake: ninja finished in {time.monotonic() - t0:.0f}s, "
        f"{_children_cpu() - cpu0:.0f} CPU-s (rc {rc})"
    )
    if rc == 0:
        return
    failed = sorted(
        set(re.findall(r"^FAILED: (?:\[code=\d+\] )?(\S+\.o)\b", log.read_text(), re.M))
    )
    lines = []
    for obj in failed:
        source = obj.removeprefix(OBJECT_DIR + "/").removesuffix(".o")
        cmd = compile_command(machine, build, archs, obj)
        lines.append(attribute_failure(cmd, source))
    raise ToolError(
        f"compiling with {TARGET}'s flags failed (full output: {log}):\n  "
        + "\n  ".join(lines or [f"ninja exit {rc} (no object missing: see the log)"])
    )


# --- Checks -------------------------------------------------------------------

# Flags of a compile command that name its own files (with how many arguments they
# take, the flag included; `-c` is followed by the source), not the target's settings.
_OWN_FILE_FLAGS = {"-o": 2, "-c": 2, "-MT": 2, "-MF": 2, "-MD": 1, "-x": 2}


def target_flags(command: str) -> list[str]:
    """A compile command's flags less its compiler, its own files and its -gencode."""
    argv = shlex.split(command)[1:]
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "-gencode":
            i += 2
        elif a in _OWN_FILE_FLAGS:
            i += _OWN_FILE_FLAGS[a]
        else:
            out.append(a)
            i += 1
    return out


def flag_problems(
    source: str, command: str, reference: str, want: list[str]
) -> list[str]:
    """Our object's command against vLLM's own source of the same language: the same
    target flags, and exactly the EXL3 block's -gencode for a .cu."""
    problems = []
    ours, theirs = target_flags(command), target_flags(reference)
    if ours != theirs:
        extra = [f for f in ours if f not in theirs]
        lacking = [f for f in theirs if f not in ours]
        problems.append(
            f"{source}: flags differ from {TARGET}'s own (vLLM's sources): "
            f"extra {extra or 'none'}, lacking {lacking or 'none (order differs)'}"
        )
    if source.endswith(".cu"):
        got = sorted((dotted_gencode(c) for c in gencodes(command)), key=arch_key)
        if got != want:
            problems.append(f"{source}: -gencode for {got}, expected {want}")
    return problems


def cubin_archs(cuobjdump: Path, obj: Path) -> list[str]:
    """The SASS images in an object ('sm_90a', 'sm_120', ...): cuobjdump names a family
    image (sm_120f) by its base architecture."""
    r = subprocess.run(
        [str(cuobjdump), "--list-elf", str(obj)], capture_output=True, text=True
    )
    return sorted(set(re.findall(r"\.(sm_\w+)\.cubin", r.stdout)))


def find_cuobjdump(machine: Machine) -> Path:
    from .kernels_build import BuildError
    from .kernels_build import find_cuobjdump as find

    try:
        return find([machine.cuda / "bin", *machine.nvidia("bin")])
    except BuildError as e:
        raise ToolError(
            f"{e}: the built objects' architectures cannot be checked"
        ) from e


# Symbols. Everything our objects define with global (or weak, or unique) binding must
# belong to our namespace: all of `_C_stable_libtorch`'s objects are linked into one
# library, where a second strong definition of a name fails the link and a second weak
# one is merged silently with vLLM's (an ODR violation nothing reports). Weak and
# unique definitions owned by the namespaces of the headers our sources include are
# their inline functions and template instantiations, identical in every object that
# instantiates them, and are allowed; a strong one there is a definition in someone
# else's namespace. Anything at global scope, in another namespace, or with C linkage
# fails.
OUR_NAMESPACE = "vllm_exl3"
HEADER_NAMESPACES = ("std", "__gnu_cxx", "torch", "c10")
# The C++ runtime's exception personality routine, referenced from every object with
# exception tables through a weak hidden DW.ref.__gxx_personality_v0 (compiler-made).
RUNTIME_NAMES = ("__gxx_personality_v0",)
_STRONG = set("TDBRGSCA")
_WEAK = set("WVu")
# Itanium ABI: the special names before an encoding (vtable, typeinfo, typeinfo name,
# VTT, TLS init/wrapper, guard variable, reference temporary).
_SPECIAL = ("TV", "TI", "TS", "TT", "TH", "TW", "GV", "GR")
_STD_ABBREVIATIONS = ("St", "Sa", "Sb", "Ss", "Si", "So", "Sd")
# operator new, new[], delete, delete[]: at global scope by the language's rule, the
# standard library's (its placement forms are inline in <new>), so counted as std's: a
# weak copy is the header's, a strong one would replace the program's allocator.
_ALLOCATION_OPERATORS = ("nw", "na", "dl", "da")
# nvcc's name for an anonymous namespace: `_GLOBAL__N__<hash of the file>`, unique to
# its translation unit (nvcc gives such names global binding).
ANONYMOUS = "_GLOBAL__N_"
# nvcc's host stub of a non-template __global__ function: a global-scope function
# named after the kernel's own mangled name (less its leading underscore).
DEVICE_STUB = "__device_stub__"


def owner(symbol: str) -> str | None:
    """The outermost scope a symbol's name belongs to, from its Itanium mangling: the
    namespace or global-scope class of a nested name ('vllm_exl3', 'std', 'torch',
    'dim3'), '::name' for a name at global scope itself, '' for a mangling not read
    here, None for a C name."""
    s = symbol.removeprefix("DW.ref.")
    if not s.startswith("_Z"):
        return None
    s = s[2:]
    while True:
        if s[:2] in _SPECIAL:
            s = s[2:]
        elif s[:2] in ("Th", "Tv"):  # thunks: call offsets, then the target
            s = re.sub(r"^T[hv](?:n?\d+_){1,2}", "", s)
        else:
            break
    return _first_component(s, nested=False)


def _first_component(s: str, nested: bool) -> str:
    s = s.lstrip("PRKVO")  # a typeinfo's type: pointer and qualifiers
    if s.startswith("Z"):  # a local entity: owned by its enclosing function
        return _first_component(s[1:], nested=False)
    if s.startswith("N"):
        return _first_component(s[1:].lstrip("rVKRO"), nested=True)
    if s[:2] in _STD_ABBREVIATIONS or (not nested and s[:2] in _ALLOCATION_OPERATORS):
        return "std"
    s = s.removeprefix("L")  # internal linkage
    m = re.match(r"(\d+)", s)
    if not m:
        return ""
    ident = s[len(m.group(1)) : len(m.group(1)) + int(m.group(1))]
    if ident.startswith(DEVICE_STUB + "Z"):
        return owner("_" + ident[len(DEVICE_STUB) :]) or ""
    return ident if nested else "::" + ident


@dataclass(frozen=True)
class SymbolProblem:
    obj: str
    symbol: str
    kind: str  # nm's letter
    reason: str

    def describe(self, demangled: str) -> str:
        return f"{self.obj}: {demangled} ({self.symbol}, nm {self.kind}): {self.reason}"


def symbol_problems(obj: str, nm_lines: list[str]) -> list[SymbolProblem]:
    """The rule above over `nm -P --defined-only` lines (name, type, value, size)."""
    problems = []
    for line in nm_lines:
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind not in _STRONG and kind not in _WEAK:
            continue  # local
        scope = owner(name)
        if scope == OUR_NAMESPACE or (scope or "").startswith(ANONYMOUS):
            continue
        if scope is None:
            base = name.removeprefix("DW.ref.")
            if base in RUNTIME_NAMES and kind in _WEAK:
                continue
            reason = "a global C symbol outside namespace vllm_exl3"
        elif scope in HEADER_NAMESPACES:
            if kind in _WEAK:
                continue
            reason = (
                f"a strong definition in namespace {scope} (only its inline functions "
                "and template instantiations, weak, may come from our objects)"
            )
        elif scope == "":
            reason = "a mangling this check cannot read"
        elif scope.startswith("::"):
            reason = "defined at global scope, outside namespace vllm_exl3"
        else:
            reason = f"defined in {scope}, a namespace or class other than vllm_exl3"
        problems.append(SymbolProblem(obj, name, kind, reason))
    return problems


def _demangle(names: list[str]) -> list[str]:
    try:
        r = subprocess.run(
            ["c++filt"], input="\n".join(names), capture_output=True, text=True
        )
        out = r.stdout.splitlines()
        return out if len(out) == len(names) else names
    except OSError:
        return names


def check_symbols(build: Path, objects: list[str]) -> list[str]:
    problems: list[SymbolProblem] = []
    for obj in objects:
        r = subprocess.run(
            ["nm", "-P", "--defined-only", str(build / obj)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise ToolError(f"nm cannot read {obj}: {r.stderr.strip()}")
        source = obj.removeprefix(OBJECT_DIR + "/").removesuffix(".o")
        problems += symbol_problems(source, r.stdout.splitlines())
    names = _demangle([p.symbol.removeprefix("DW.ref.") for p in problems])
    return [p.describe(d) for p, d in zip(problems, names, strict=True)]


def check_objects(
    machine: Machine, build: Path, archs: list[str], sources: list[str]
) -> None:
    """The flags, the SASS images and the symbols of our objects; raises naming each
    source file and what is wrong with it."""
    want = expected_archs(archs)
    want_cubins = sorted(f"sm_{a.replace('.', '').removesuffix('f')}" for a in want)
    cuobjdump = find_cuobjdump(machine)
    refs = {
        lang: compile_command(machine, build, archs, object_of(src))
        for lang, src in REFERENCE_SOURCES.items()
    }
    problems = []
    for src in sources:
        cmd = compile_command(machine, build, archs, object_of(src))
        ref = refs["CUDA" if src.endswith(".cu") else "CXX"]
        problems += flag_problems(src, cmd, ref, want)
        if src.endswith(".cu"):
            got = cubin_archs(cuobjdump, build / object_of(src))
            if got != want_cubins:
                problems.append(f"{src}: SASS images {got}, expected {want_cubins}")
    problems += check_symbols(build, [object_of(s) for s in sources])
    if problems:
        raise ToolError(
            f"{len(problems)} problem(s) in our objects of {TARGET}:\n  "
            + "\n  ".join(problems)
        )
    print(
        f"vllm-cmake: {len(sources)} objects checked: {TARGET}'s own flags, "
        f"-gencode {';'.join(want)} (SASS {', '.join(want_cubins)}), every global "
        f"symbol in namespace {OUR_NAMESPACE} (or a weak one of "
        f"{', '.join(HEADER_NAMESPACES)})"
    )


# --- The whole target and its installation ------------------------------------


# The start of exl3_linear's schema as exl3_ops.cpp registers it: in the library's data
# whether or not its symbols are stripped.
OP_SCHEMA = b"exl3_linear(Tensor x"


def install_target(machine: Machine, build: Path, archs: list[str], work: Path) -> Path:
    """CMake's install of the target's component (as setup.py does) into
    work/install."""
    prefix = work / "install"
    shutil.rmtree(prefix, ignore_errors=True)
    r = subprocess.run(
        [
            str(machine.cmake),
            "--install",
            str(build),
            "--prefix",
            str(prefix),
            "--component",
            TARGET,
        ],
        env=machine.env(archs),
        capture_output=True,
        text=True,
    )
    lib = prefix / "vllm" / f"{TARGET}.abi3.so"
    if r.returncode != 0 or not lib.is_file():
        raise ToolError(f"cmake --install of {TARGET} failed: {r.stderr.strip()}")
    if OP_SCHEMA not in lib.read_bytes():
        raise ToolError(f"{lib} does not register _C::exl3_linear (no {OP_SCHEMA!r})")
    problem = library_problem(lib, link_compiler())
    if problem:
        raise ToolError(problem)
    return lib


# Suffixes the release library and the quick build's extension are kept under.
RELEASE_SUFFIX = ".release"
UNUSED_SUFFIX = ".unused"


def install_into(lib: Path, site: Path) -> list[str]:
    """Put `lib` in place of site/vllm/_C_stable_libtorch.abi3.so (the release one kept
    beside it, once), and move the quick build's vllm/_exl3_C.abi3.so aside: the ops
    then come from vLLM's own library alone."""
    vllm = site / "vllm"
    dest = vllm / lib.name
    if not dest.is_file():
        raise ToolError(f"{site} has no installed vLLM ({dest} is missing)")
    done = []
    kept = dest.with_name(dest.name + RELEASE_SUFFIX)
    if not kept.exists():
        shutil.copy2(dest, kept)
        done.append(f"kept the release library as {kept}")
    tmp = dest.with_name(dest.name + ".part")
    shutil.copyfile(lib, tmp)
    os.chmod(tmp, 0o755)
    tmp.replace(dest)
    done.append(f"installed {lib} as {dest}")
    quick = vllm / "_exl3_C.abi3.so"
    if quick.exists():
        quick.replace(quick.with_name(quick.name + UNUSED_SUFFIX))
        done.append(f"moved {quick} aside ({UNUSED_SUFFIX})")
    return done


# --- Driver, background mode, status ------------------------------------------


def _write_state(work: Path, **fields) -> None:
    path = work / STATE_FILE
    state = json.loads(path.read_text()) if path.is_file() else {}
    state.update(fields, updated=time.time())
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(path)


def run_build(args: argparse.Namespace, python: Path) -> int:
    """The foreground build: prepare, configure, compile, check (and install)."""
    work: Path = args.build_dir
    work.mkdir(parents=True, exist_ok=True)
    archs = [a.strip() for a in args.archs.replace(",", ";").split(";") if a.strip()]
    _refuse_if_running(work)
    t0 = time.monotonic()
    _write_state(
        work, pid=os.getpid(), phase="prepare", rc=None, error=None, started=time.time()
    )
    try:
        series = Series.load(args.series)
        if args.only == "target":
            # Before an hour of compiling, not after: the link would take libstdc++.a.
            problem = static_libstdcxx_problem(link_compiler())
            if problem:
                raise ToolError(problem)
        machine = find_machine(python, args.cache_dir, args.offline)
        if args.source_pack:
            sources = sources_from_pack(args.source_pack, args.cache_dir, series)
        else:
            sources = sources_from_cache(args.cache_dir, args.offline)
        tree = prepare_tree(sources, series, work)
        _write_state(work, phase="configure")
        build = configure(machine, tree, work, sources.cutlass, archs, args.only)
        sources_ = our_sources(series)
        objects = check_target_membership(machine, build, archs, sources_)
        _write_state(work, phase="build")
        targets = objects if args.only == "objects" else [TARGET]
        build_objects(machine, build, archs, targets, args.jobs, work / LOG_FILE)
        _write_state(work, phase="check")
        check_objects(machine, build, archs, sources_)
        if args.only == "target":
            lib = install_target(machine, build, archs, work)
            size = lib.stat().st_size / 2**20
            print(f"vllm-cmake: {lib} ({size:.0f} MiB)")
            if args.install_into:
                for line in install_into(lib, args.install_into):
                    print(f"vllm-cmake: {line}")
    except ToolError as e:
        _write_state(work, phase="failed", rc=1, error=str(e)[:4000])
        raise
    seconds = time.monotonic() - t0
    _write_state(work, phase="done", rc=0, seconds=round(seconds))
    print(f"vllm-cmake: done in {seconds:.0f}s ({args.only}, archs {';'.join(archs)})")
    return 0


def start_background(args: argparse.Namespace, argv: list[str]) -> int:
    """Start the same command detached (its own session, so it outlives the caller),
    logging to the build directory; --status follows it."""
    work: Path = args.build_dir
    work.mkdir(parents=True, exist_ok=True)
    _refuse_if_running(work)
    (work / LOG_FILE).unlink(missing_ok=True)
    child = [a for a in argv if a != "--background"]
    with open(work / "background.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, *child],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    _write_state(
        work, pid=proc.pid, phase="starting", rc=None, error=None, started=time.time()
    )
    print(f"vllm-cmake: started pid {proc.pid}; follow with --status ({work})")
    return 0


def _refuse_if_running(work: Path) -> None:
    """Two builds in one folder would run two ninjas on one tree."""
    state = _read_state(work)
    pid = state.get("pid") if state else None
    if state and state.get("rc") is None and pid != os.getpid() and _alive(pid):
        raise ToolError(
            f"a build is running in {work} (pid {pid}): wait for --status to exit 0"
        )


def _read_state(work: Path) -> dict | None:
    path = work / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status(work: Path) -> int:
    """0 done, 1 failed (or nothing started), STATUS_RUNNING while running."""
    state = _read_state(work)
    if state is None:
        print(f"vllm-cmake: no build in {work}")
        return 1
    phase, rc = state.get("phase"), state.get("rc")
    end = time.time() if rc is None else state.get("updated", time.time())
    elapsed = end - state.get("started", end)
    progress = ""
    log = work / LOG_FILE
    if log.is_file():
        steps = re.findall(r"^\[(\d+)/(\d+)\]", log.read_text(errors="replace"), re.M)
        if steps:
            progress = f", ninja step {steps[-1][0]}/{steps[-1][1]}"
    if rc is None and not _alive(state.get("pid")):
        phase, rc = "stopped (the process is gone: run the same command again)", 1
    print(f"vllm-cmake: {phase}{progress}, {elapsed:.0f}s from its start ({work})")
    if state.get("error"):
        print(state["error"])
    if rc is None:
        return STATUS_RUNNING
    bg = work / "background.log"
    if rc and bg.is_file():
        print("".join(bg.read_text(errors="replace").splitlines(True)[-15:]))
    return 0 if rc == 0 else 1
