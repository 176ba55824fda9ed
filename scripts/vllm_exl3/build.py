# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`build`: an installable wheel of the patched vLLM 0.26.0 in dist/.

Quick path (default): the official release wheel, unpacked, the series applied in
wheel-tree mode, our kernels compiled into `vllm/_exl3_C.abi3.so` (a separate small
stable-ABI extension: the release's `_C_stable_libtorch` stays as shipped), RECORD
regenerated, version `0.26.0+exl3.<commit>`. `--from-source`: vLLM's own full build of
the patched sdist, with our kernels compiled into `_C_stable_libtorch` (the release
path). The wheel archives themselves (unpacking, writing with a fresh RECORD) are read
and written here too, for `build` and `bundle`.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tomllib

from . import ToolError, vllm_cmake
from .apply import apply_onto
from .fetch import (
    Progress,
    copy_sdist_tree,
    ensure_pinned,
    ensure_sdist_tree,
    wheels_dir,
)
from .repo import (
    BUILD_LABEL_PREFIX,
    ROOT,
    VLLM_VERSION,
    WHEELS,
    Series,
    default_cache_dir,
    default_venv,
    git_label,
    host_machine,
)
from .series import STATE_DIR

DEFAULT_ARCHS = "9.0;12.0;12.1"
# kernels_build.DEFAULT_OUT: objects compiled by `python -m vllm_exl3.kernels_build` or
# by the compile test (tests/kernels/test_compile.py) are reused here, and the other
# way round (they are kept per architecture set).
KERNEL_BUILD_DIR = ROOT / "build" / "exl3"
KERNEL_MODULE = "vllm/_exl3_C.abi3.so"
# Seconds between "still compiling" lines while a long subprocess runs.
_HEARTBEAT_S = 30

# The compile step runs in the pinned venv (it needs torch 2.11's headers); the tool
# itself may run under any Python 3.11+. build_extension(out_dir, archs, jobs) -> Path
# is the kernel build's interface. The venv finds this package through PYTHONPATH.
_KERNEL_SNIPPET = """
import inspect, json, sys
from pathlib import Path
from vllm_exl3.kernels_build import build_extension
params = inspect.signature(build_extension).parameters
kw = {{"verbose": True}} if "verbose" in params else {{}}
try:
    path = build_extension(Path({out!r}), {archs!r}, {jobs!r}, **kw)
except Exception as e:
    print(f"kernel build failed: {{e}}", file=sys.stderr)
    sys.exit(1)
print(json.dumps(str(path)))
"""


def _archs(spec: str) -> list[str]:
    archs = [a.strip() for a in spec.replace(",", ";").split(";") if a.strip()]
    if not archs:
        raise ToolError("--archs is empty")
    return archs


def _run_with_heartbeat(
    cmd: list[str], what: str, env: dict[str, str] | None = None, capture: bool = False
) -> subprocess.CompletedProcess:
    """Run a long step, printing elapsed time every _HEARTBEAT_S so a log shows it is
    alive."""
    t0 = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(_HEARTBEAT_S):
            print(
                f"  {what}: {time.monotonic() - t0:.0f}s ...",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=beat, daemon=True).start()
    try:
        return subprocess.run(
            cmd, env=env, text=True, stdout=subprocess.PIPE if capture else None
        )
    finally:
        done.set()
        print(f"  {what}: finished in {time.monotonic() - t0:.0f}s", file=sys.stderr)


def _venv_python(args: argparse.Namespace) -> Path:
    if args.python:
        return args.python
    venv = default_venv(args.cache_dir)
    # Always through the script: it reuses a complete environment at once, and waits
    # for another command that is still creating it.
    env = dict(os.environ, VLLM_EXL3_CACHE=str(args.cache_dir))
    subprocess.run(["bash", str(ROOT / "ci" / "setup-env.sh")], check=True, env=env)
    return venv / "bin" / "python"


def build_kernels(python: Path, archs: list[str], jobs: int) -> Path:
    if importlib.util.find_spec(f"{__package__}.kernels_build") is None:
        raise ToolError(
            "the kernel build (scripts/vllm_exl3/kernels_build.py) is missing from "
            "this "
            "checkout; use --no-kernels for a Python-only wheel"
        )
    print(
        f"build: compiling the EXL3 kernels for {';'.join(archs)} with {jobs} job(s) "
        f"({python})"
    )
    snippet = _KERNEL_SNIPPET.format(out=str(KERNEL_BUILD_DIR), archs=archs, jobs=jobs)
    scripts = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": scripts + (os.pathsep + path if path else "")}
    r = _run_with_heartbeat(
        [str(python), "-c", snippet], "compiling kernels", env=env, capture=True
    )
    if r.returncode != 0:
        raise ToolError("the kernel build failed (see the compiler output above)")
    return Path(json.loads(r.stdout.strip().splitlines()[-1]))


def quick_build(
    wheel: Path,
    series: Series,
    dist: Path,
    work: Path,
    kernels: Path | None,
    label: str,
) -> Path:
    """Official wheel + series (wheel-tree mode) + optional kernel module -> dist/."""
    name = WheelName.parse(wheel.name)
    if name.version != VLLM_VERSION:
        raise ToolError(
            f"{wheel.name} is vLLM {name.version}; the series is for {VLLM_VERSION}"
        )
    tree = work / "wheel-tree"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    unpack(wheel, tree)
    _, plan = apply_onto(tree, series)
    shutil.rmtree(
        tree / STATE_DIR
    )  # the record describes this staging tree, not an install
    print(f"build: applied the series ({len(plan.writes)} files)")
    if kernels is not None:
        shutil.copyfile(kernels, tree / KERNEL_MODULE)
        os.chmod(tree / KERNEL_MODULE, 0o755)
    new = set_version(tree, name, f"{VLLM_VERSION}+{BUILD_LABEL_PREFIX}.{label}")
    out = dist / new.filename
    write(tree, new, out)
    shutil.rmtree(tree)
    return out


_REQUIREMENTS_PROBE = """
import json, sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
problems = []
for text in json.loads(sys.argv[1]):
    req = Requirement(text)
    try:
        have = version(req.name)
    except PackageNotFoundError:
        problems.append(f"{text}: not installed")
        continue
    if not req.specifier.contains(have, prereleases=True):
        problems.append(f"{text}: {have} installed")
print(json.dumps(problems))
"""


def from_source(args: argparse.Namespace, series: Series, python: Path) -> int:
    """vLLM's own setup.py build of the patched sdist (CMake + nvcc of everything)."""
    src = ensure_sdist_tree(args.cache_dir, offline=args.offline)
    problems = []
    cuda_home = vllm_cmake.cuda_toolkit()
    if cuda_home is None:
        problems.append(
            "no CUDA 13 toolkit (bin/nvcc and include/cuda_runtime.h) at $CUDA_HOME, "
            "next to the nvcc on PATH, or at /usr/local/cuda; set CUDA_HOME"
        )
    # --no-build-isolation builds with what --python has: check it against the sdist's
    # own [build-system] requirements.
    with open(src / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    probe = subprocess.run(
        [str(python), "-c", _REQUIREMENTS_PROBE, json.dumps(requires)],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        problems.append(
            f"{python} cannot check build requirements: {probe.stderr.strip()}"
        )
    else:
        problems += [f"{python}: {p}" for p in json.loads(probe.stdout)]
    if problems:
        raise ToolError(
            "cannot build from source (vLLM's build requirements):\n  "
            + "\n  ".join(problems)
        )
    tree = args.work_dir / f"vllm-{VLLM_VERSION}-src"
    shutil.rmtree(tree, ignore_errors=True)
    tree.parent.mkdir(parents=True, exist_ok=True)
    copy_sdist_tree(src, tree)
    apply_onto(tree, series)
    shutil.rmtree(tree / STATE_DIR)
    env = {
        **os.environ,
        # CMake's CUDA detection starts from the nvcc it finds; a wrapper script on PATH
        # (e.g. /usr/local/bin/nvcc) hides the toolkit's include/ and lib64/.
        "CUDA_HOME": str(cuda_home),
        "PATH": f"{cuda_home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "VLLM_TARGET_DEVICE": "cuda",
        "TORCH_CUDA_ARCH_LIST": " ".join(_archs(args.archs)),
        "MAX_JOBS": str(args.jobs),
    }
    # Precompiled mode would replace _C_stable_libtorch, and with it our kernels.
    for var in ("VLLM_USE_PRECOMPILED", "VLLM_PRECOMPILED_WHEEL_LOCATION"):
        env.pop(var, None)
    # CUTLASS at the sdist's pin from its pinned wheel (vllm_cmake), given to CMake
    # through setup.py's CMAKE_ARGS; the seven other repositories are still fetched.
    cutlass = vllm_cmake.cutlass_dir(args.cache_dir, args.offline)
    vllm_cmake.check_cutlass_pin(tree, cutlass)
    env["CMAKE_ARGS"] = " ".join(
        [env.get("CMAKE_ARGS", ""), *vllm_cmake.cutlass_args(cutlass)]
    ).strip()
    print(
        f"build: vLLM's full build of {tree} (CMake fetches 7 repositories unless "
        "their *_SRC_DIR variables point at local copies; hours on a small machine; "
        "--only target builds _C_stable_libtorch alone, offline)"
    )
    args.dist_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(python),
        "-m",
        "pip",
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "-v",
        "-w",
        str(args.dist_dir),
        str(tree),
    ]
    r = _run_with_heartbeat(cmd, "vLLM build", env=env)
    if r.returncode != 0:
        raise ToolError(
            f"vLLM's build failed (exit {r.returncode}); tree kept at {tree}. If CMake "
            "could not "
            "fetch a repository (no network), point the *_SRC_DIR variables (see "
            "--help) at "
            "local checkouts of the pinned commits."
        )
    print(f"build: wheel in {args.dist_dir}")
    return 0


def _check_source_options(args: argparse.Namespace) -> None:
    only = ("--background", "--install-into", "--source-pack")
    given = [flag for flag in only if getattr(args, flag[2:].replace("-", "_"))]
    if given and not args.only:
        raise ToolError(f"{', '.join(given)} need(s) --from-source --only")
    if args.only and not args.from_source:
        raise ToolError("--only needs --from-source")
    if args.install_into and args.only != "target":
        raise ToolError("--install-into needs --only target (a built library)")


def run(args: argparse.Namespace) -> int:
    _check_source_options(args)
    # CMake runs in the prepared tree, so the stand-in paths handed to it must not be
    # relative to the caller's directory.
    args.build_dir = args.build_dir.resolve()
    if args.status:
        return vllm_cmake.status(args.build_dir)
    series = Series.load(args.series)
    if args.pack:
        sources = vllm_cmake.sources_from_cache(args.cache_dir, args.offline)
        out = vllm_cmake.write_pack(sources, series, args.pack)
        print(f"{out} ({out.stat().st_size / 2**20:.1f} MiB)")
        return 0
    if args.only:
        if args.background:
            return vllm_cmake.start_background(args, sys.argv)
        return vllm_cmake.run_build(args, _venv_python(args))
    if args.from_source:
        return from_source(args, series, _venv_python(args))
    t0 = time.monotonic()
    if args.wheel:
        wheel = args.wheel
    else:
        machine = host_machine()
        if machine not in WHEELS:
            raise ToolError(
                f"no pinned vLLM wheel for {machine}; known: {', '.join(WHEELS)}"
            )
        filename, sha = WHEELS[machine]
        wheel = ensure_pinned(filename, sha, wheels_dir(args.cache_dir), args.offline)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.kernels_so:
        kernels = args.kernels_so
        suffix = ""
    elif args.no_kernels:
        kernels = None
        suffix = ".nokernels"
    else:
        kernels = build_kernels(_venv_python(args), _archs(args.archs), args.jobs)
        suffix = ""
    label = (git_label(series.root) or series.fingerprint("wheel")[:8]) + suffix
    out = quick_build(wheel, series, args.dist_dir, args.work_dir, kernels, label)
    print(f"{out}")
    print(
        f"build: {out.stat().st_size / 1e6:.0f} MB in {time.monotonic() - t0:.0f}s"
        + (
            ""
            if kernels
            else " (no EXL3 kernels: the overlay falls back to the reference path)"
        )
    )
    # A plain install: the wheel's metadata is vLLM 0.26.0's, so pip brings torch
    # 2.11.0 and every dependency at vLLM's pins (--no-deps would leave an environment
    # that cannot start).
    print(
        f"install: pip install {out}  (Python 3.10-3.13; for an offline host: "
        "scripts/vllm-exl3 bundle)"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "build",
        help="build a wheel of the patched vLLM into dist/ (quick by default)",
        description=(
            "Quick (default): take the official vLLM wheel (pinned sha256, cached), "
            "apply the "
            "series in wheel-tree mode, compile our kernels into vllm/_exl3_C.abi3.so "
            "with the "
            "pinned venv's torch (ci/setup-env.sh), and write "
            "dist/vllm-0.26.0+exl3.<commit>-"
            "<tag>.whl. --from-source: apply the series to the pinned sdist and run "
            "vLLM's own "
            "build (pip wheel --no-build-isolation) with our kernels in "
            "_C_stable_libtorch; needs the CUDA 13 toolkit, cmake>=3.26.1, ninja, "
            "setuptools-scm, setuptools-rust and torch 2.11.0 in --python's "
            "environment, CUTLASS from its pinned wheel, network or the *_SRC_DIR "
            "variables (VLLM_FLASH_ATTN_SRC_DIR, FLASH_MLA_SRC_DIR, DEEPGEMM_SRC_DIR, "
            "QUTLASS_SRC_DIR, TRITON_KERNELS_SRC_DIR, FMHA_SM100_SRC_DIR, "
            "TML_FA4_SRC_DIR) for the other repositories its CMake fetches, and hours "
            "on a small machine. --from-source --only objects|target: vLLM's CMake for "
            "_C_stable_libtorch alone, offline (scripts/README.md)."
        ),
    )
    p.add_argument(
        "--archs",
        default=DEFAULT_ARCHS,
        help=f"CUDA architectures, ';'-separated (default {DEFAULT_ARCHS})",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="parallel compile jobs (default: all CPUs)",
    )
    kernels = p.add_mutually_exclusive_group()
    kernels.add_argument(
        "--no-kernels",
        action="store_true",
        help="a Python-only wheel (the EXL3 method then runs the reference path)",
    )
    kernels.add_argument(
        "--kernels-so",
        type=Path,
        help="use this already built _exl3_C.abi3.so instead of compiling",
    )
    kernels.add_argument(
        "--from-source",
        action="store_true",
        help="vLLM's full build with our kernels in _C_stable_libtorch",
    )
    p.add_argument(
        "--only",
        choices=("objects", "target"),
        help="with --from-source: vLLM's CMake, offline, for _C_stable_libtorch "
        "alone: 'objects' compiles and checks our objects of it (the CI step), "
        "'target' builds the whole library (a CUDA host)",
    )
    p.add_argument(
        "--install-into",
        type=Path,
        metavar="SITE",
        help="with --only target: replace SITE/vllm/_C_stable_libtorch.abi3.so (the "
        "release one kept as .release) and move SITE/vllm/_exl3_C.abi3.so aside",
    )
    p.add_argument(
        "--background",
        action="store_true",
        help="with --only: run detached (it outlives the shell); see --status",
    )
    p.add_argument(
        "--status",
        action="store_true",
        help="report the --only build in --build-dir: exit 0 done, 1 failed or "
        f"stopped, {vllm_cmake.STATUS_RUNNING} running",
    )
    p.add_argument(
        "--build-dir",
        type=Path,
        default=ROOT / "build" / "vllm-cmake",
        help="the --only build's folder (default build/vllm-cmake)",
    )
    p.add_argument(
        "--pack",
        type=Path,
        metavar="FILE",
        help="write the --only build's inputs (the pristine sdist's build files, "
        "CUTLASS) to FILE (.tar.xz, about 2 MB) for a host without network; no build",
    )
    p.add_argument(
        "--source-pack",
        type=Path,
        metavar="FILE",
        help="with --only: build from a --pack FILE instead of the cache (offline)",
    )
    p.add_argument(
        "--wheel",
        type=Path,
        help="start from this vLLM 0.26.0 wheel instead of the pinned official one",
    )
    p.add_argument(
        "--python",
        type=Path,
        help="interpreter with torch 2.11.0 for compiling (default: the pinned venv)",
    )
    p.add_argument(
        "--dist-dir", type=Path, default=ROOT / "dist", help="output directory"
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=ROOT / "build" / "wheel",
        help="scratch directory for the wheel (kernel objects go to build/exl3/)",
    )
    p.add_argument(
        "--series",
        type=Path,
        default=ROOT,
        help="repository root holding overlay/, csrc/, patches/ "
        "(default: this checkout)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="cache directory (default: $VLLM_EXL3_CACHE or ~/.cache/vllm-exl3)",
    )
    p.add_argument("--offline", action="store_true", help="never touch the network")
    p.set_defaults(func=run)


# Wheel archives (PEP 427): unpack one to a tree, and write a tree back as a wheel with
# a fresh RECORD, optionally under a new version and with only some of its files.

_CHUNK = 1 << 20
# Fixed timestamp for every member (the earliest a zip can hold), so identical trees
# give identical wheels.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class WheelName:
    name: str
    version: str
    tag: str  # python-abi-platform, e.g. cp38-abi3-manylinux_2_28_x86_64

    @classmethod
    def parse(cls, filename: str) -> WheelName:
        parts = filename.removesuffix(".whl").split("-")
        if not filename.endswith(".whl") or len(parts) not in (5, 6):
            raise ToolError(f"{filename} is not a wheel file name")
        return cls(parts[0], parts[1], "-".join(parts[-3:]))

    @property
    def filename(self) -> str:
        return f"{self.name}-{self.version}-{self.tag}.whl"

    @property
    def dist_info(self) -> str:
        return f"{self.name}-{self.version}.dist-info"


def unpack(
    wheel: Path, dest: Path, keep: Callable[[str], bool] = lambda _p: True
) -> None:
    """Extract the members `keep` accepts, keeping the executable bits recorded in the
    archive."""
    with zipfile.ZipFile(wheel) as zf:
        infos = [i for i in zf.infolist() if keep(i.filename)]
        prog = Progress(f"unpacking {wheel.name}", sum(i.file_size for i in infos))
        for info in infos:
            if info.filename.startswith("/") or ".." in Path(info.filename).parts:
                raise ToolError(
                    f"{wheel}: refusing member {info.filename!r} (outside the tree)"
                )
            target = dest / info.filename
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    prog.advance(len(chunk))
            if (info.external_attr >> 16) & 0o111:
                os.chmod(target, 0o755)
        prog.finish()


def set_version(tree: Path, old: WheelName, version: str) -> WheelName:
    """Rename the dist-info directory and rewrite METADATA's Version for `version`."""
    new = WheelName(old.name, version, old.tag)
    src = tree / old.dist_info
    if not (src / "METADATA").is_file():
        raise ToolError(f"{src} has no METADATA; not an unpacked {old.filename}")
    meta = (src / "METADATA").read_text(encoding="utf-8")
    meta, n = re.subn(r"(?m)^Version: .*$", f"Version: {version}", meta, count=1)
    if n != 1:
        raise ToolError(f"{src}/METADATA has no Version field")
    (src / "METADATA").write_text(meta, encoding="utf-8")
    src.rename(tree / new.dist_info)
    return new


def _record_hash(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    return f"sha256={digest}", path.stat().st_size


def write(
    tree: Path,
    name: WheelName,
    out: Path,
    keep: Callable[[str], bool] = lambda _p: True,
) -> list[str]:
    """Zip `tree` as wheel `name` into `out` (a file path), members filtered by `keep`,
    with a regenerated RECORD; the dist-info directory goes last, RECORD last of all.
    Returns the member paths written."""
    record_path = f"{name.dist_info}/RECORD"
    files = sorted(
        p.relative_to(tree).as_posix()
        for p in tree.rglob("*")
        if p.is_file() and not p.is_symlink()
    )
    files = [f for f in files if f != record_path and keep(f)]
    if not any(f.startswith(name.dist_info + "/") for f in files):
        raise ToolError(
            f"{tree} has no {name.dist_info}/; cannot write {name.filename}"
        )
    files.sort(key=lambda f: (f.startswith(name.dist_info + "/"), f))
    record = io.StringIO()
    rows = csv.writer(record, lineterminator="\n")
    prog = Progress(
        f"writing {out.name}", sum((tree / f).stat().st_size for f in files)
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for f in files:
            path = tree / f
            h, size = _record_hash(path)
            rows.writerow([f, h, size])
            info = zipfile.ZipInfo(f, _ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.file_size = size  # lets zipfile decide on zip64 itself
            mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            with open(path, "rb") as src, zf.open(info, "w") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
            prog.advance(size)
        rows.writerow([record_path, "", ""])
        info = zipfile.ZipInfo(record_path, _ZIP_EPOCH)
        info.external_attr = (stat.S_IFREG | 0o644) << 16
        zf.writestr(info, record.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    prog.finish()
    tmp.replace(out)
    return files + [record_path]
