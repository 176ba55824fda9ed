# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The series this repository holds: what it is pinned to, where its overlay, CUDA
sources and patches live (overlay/ and csrc/ are laid out as in the vLLM tree: a file's
path there is its path here, less `overlay/`), and recognising the vLLM trees it
applies onto: an unpacked sdist (or a git checkout made from one) or an
installed wheel (a site-packages directory, or an unpacked wheel).

The pinned files' hashes were computed locally on the downloaded files and agree with
the package index's published sha256; a file that hashes differently is refused."""

from __future__ import annotations

import email.parser
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Literal

# What the series is pinned to.

VLLM_VERSION = "0.26.0"

SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502"

# The vLLM release the upstream series is ported to (`vllm-exl3 series`,
# patches/0.34.0/).
UPSTREAM_VERSION = "0.34.0"

# Every vLLM source distribution the tool fetches: version -> sha256 (computed on the
# downloaded file; the index publishes the same).
SDISTS = {
    VLLM_VERSION: SDIST_SHA256,
    UPSTREAM_VERSION: (
        "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
    ),
}


def sdist_name(version: str) -> str:
    return f"vllm-{version}.tar.gz"


# Official release wheels, by machine (host_machine()). The quick build starts from
# these.
WHEELS = {
    "x86_64": (
        f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl",
        "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de",
    ),
    # Downloaded once on 2026-11-30 (for docker/): it hashes to the index's published
    # sha256.
    "aarch64": (
        f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_aarch64.whl",
        "52a4c3e55c2c80cc8793e52ccc244457ceade25b0ad7caa1c15e5002a95a1b2c",
    ),
}


def host_machine() -> str:
    """This machine as the release wheels name it (platform.machine(), with the other
    spellings of the same two machines mapped)."""
    m = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m.lower(), m)


# This repository's layout.

ROOT = Path(__file__).resolve().parents[2]

# Never part of what we ship into a tree: interpreter caches and build products.
_EXCLUDED_DIRS = {"__pycache__", ".pytest_cache"}
_EXCLUDED_SUFFIXES = (".pyc", ".pyo", ".o", ".so")


def default_cache_dir() -> Path:
    env = os.environ.get("VLLM_EXL3_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm-exl3"


SETUP_ENV = ROOT / "ci" / "setup-env.sh"


def default_venv(cache: Path | None = None) -> Path:
    """The pinned environment made by ci/setup-env.sh (torch headers for compiling
    kernels): `venv-<first 16 hex digits of the script's sha256>` in the cache, the path
    the script itself uses, so checkouts at different commits sharing one cache keep
    their own environments."""
    env = os.environ.get("VLLM_EXL3_VENV")
    if env:
        return Path(env).expanduser()
    stamp = hashlib.sha256(SETUP_ENV.read_bytes()).hexdigest()[:16]
    return (cache or default_cache_dir()) / f"venv-{stamp}"


def _files_under(base: Path) -> list[Path]:
    if not base.is_dir():
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(_EXCLUDED_SUFFIXES):
                out.append(Path(dirpath) / name)
    return out


@dataclass(frozen=True)
class SourceFile:
    """One file placed into a vLLM tree: where it comes from and its path there."""

    source: Path  # the file, or the generator of a generated one
    origin: str  # path relative to the series root, for messages and the manifest
    dest: str  # path relative to the vLLM tree root (posix)
    generated: bytes | None = None  # the content of a generated file

    def read_bytes(self) -> bytes:
        return self.source.read_bytes() if self.generated is None else self.generated

    @property
    def exec_bits(self) -> int:
        return 0 if self.generated is not None else self.source.stat().st_mode & 0o111


# Writes the kernels' per-rate translation units at build time (as vLLM's Marlin
# generator): placed into a tree with the CUDA sources, where CMake's glob finds them.
KERNEL_GENERATOR = "csrc/libtorch_stable/quantization/exl3/generate_kernels.py"


def kernel_generator(root: Path = ROOT) -> ModuleType | None:
    """`root`'s kernel generator as a module (it belongs to no package), or None where
    the series has none. No bytecode is written beside the CUDA sources."""
    generator = root / KERNEL_GENERATOR
    if not generator.is_file():
        return None
    spec = importlib.util.spec_from_file_location("exl3_generate_kernels", generator)
    module = importlib.util.module_from_spec(spec)
    write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = write_bytecode
    return module


def _generated_csrc(root: Path) -> tuple[SourceFile, ...]:
    module = kernel_generator(root)
    if module is None:
        return ()
    generator = root / KERNEL_GENERATOR
    folder = Path(KERNEL_GENERATOR).parent.as_posix()
    return tuple(
        SourceFile(
            generator,
            f"{KERNEL_GENERATOR} ({name})",
            f"{folder}/{name}",
            text.encode(),
        )
        for name, text in sorted(module.build_sources().items())
    )


@dataclass(frozen=True)
class Series:
    """The overlay, the CUDA sources and the ordered patches of one series root."""

    root: Path
    overlay: tuple[SourceFile, ...]
    csrc: tuple[SourceFile, ...]
    patches: tuple[Path, ...]

    @classmethod
    def load(cls, root: Path = ROOT) -> Series:
        root = root.resolve()
        overlay = tuple(
            SourceFile(
                p,
                p.relative_to(root).as_posix(),
                p.relative_to(root / "overlay").as_posix(),
            )
            for p in _files_under(root / "overlay")
        )
        # csrc/ is laid out as in the vLLM tree: a file's path there is its path here.
        csrc = tuple(
            SourceFile(
                p, p.relative_to(root).as_posix(), p.relative_to(root).as_posix()
            )
            for p in _files_under(root / "csrc")
        )
        # Generated units win over stale copies of them written into csrc/ by hand.
        generated = _generated_csrc(root)
        names = {f.dest for f in generated}
        csrc = tuple(f for f in csrc if f.dest not in names) + generated
        patches = tuple(sorted((root / "patches").glob("*.patch")))
        return cls(root, overlay, csrc, patches)

    def fingerprint(self, mode: str) -> str:
        """Identifies exactly what an application in `mode` writes (same value: same
        result)."""
        h = hashlib.sha256(mode.encode())
        for f in (*self.overlay, *self.csrc):
            h.update(f"\0{f.origin}\0{f.dest}\0".encode())
            h.update(f.read_bytes())
        for p in self.patches:
            h.update(f"\0{p.name}\0".encode())
            h.update(p.read_bytes())
        return h.hexdigest()


def git_label(root: Path = ROOT) -> str | None:
    """Short commit of this checkout, with `.dirty` when series files differ from it;
    None outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=8", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "status",
                "--porcelain",
                "--",
                "overlay",
                "csrc",
                "patches",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{sha}.dirty" if dirty else sha


# The vLLM trees the series applies onto.

Kind = Literal["sdist", "wheel"]

# The local-version label our builds carry (`0.26.0+exl3.<commit>`); such a tree
# already holds a series baked in, so applying onto it is refused.
BUILD_LABEL_PREFIX = "exl3"


def _metadata(path: Path) -> dict[str, str]:
    msg = email.parser.Parser().parsestr(
        path.read_text(encoding="utf-8", errors="replace"), headersonly=True
    )
    return {k: str(v) for k, v in msg.items()}


@dataclass
class TargetTree:
    root: Path
    kind: Kind
    version: str | None
    version_source: str | None
    problems: list[str] = field(default_factory=list)

    @property
    def describe(self) -> str:
        return (
            f"{self.root} ({self.kind} tree, vLLM {self.version or 'unknown version'})"
        )


def identify(root: Path) -> TargetTree:
    """What kind of vLLM tree `root` is and which version; every reason it is not a vLLM
    {VLLM_VERSION} tree goes into `problems` (the caller reports them all)."""
    root = root.resolve()
    problems: list[str] = []
    if not (root / "vllm").is_dir():
        problems.append(f"{root} has no vllm/ package directory")
    version = source = None
    if (root / "PKG-INFO").is_file():
        kind: Kind = "sdist"
        meta = _metadata(root / "PKG-INFO")
        version, source = meta.get("Version"), "PKG-INFO"
        if meta.get("Name", "").lower() != "vllm":
            problems.append(f"PKG-INFO names project {meta.get('Name')!r}, not vllm")
        for needed in ("CMakeLists.txt", "csrc/libtorch_stable"):
            if not (root / needed).exists():
                problems.append(
                    f"sdist tree lacks {needed} (not a vLLM 0.26 source layout)"
                )
    else:
        infos = sorted(root.glob("vllm-*.dist-info"))
        kind = "wheel" if infos or not (root / "CMakeLists.txt").exists() else "sdist"
        if len(infos) > 1:
            problems.append(
                "several vLLM installations' metadata: "
                + ", ".join(p.name for p in infos)
            )
        elif infos and (infos[0] / "METADATA").is_file():
            version = _metadata(infos[0] / "METADATA").get("Version")
            source = f"{infos[0].name}/METADATA"
        elif infos:
            problems.append(f"{infos[0].name} has no METADATA")
        else:
            problems.append(
                "cannot tell the vLLM version: no PKG-INFO (sdist) and no "
                "vllm-*.dist-info "
                "(installed wheel)"
            )
    if version is not None:
        public, _, local = version.partition("+")
        if public != VLLM_VERSION:
            problems.append(
                f"the tree is vLLM {version} ({source}); this series is for vLLM "
                f"{VLLM_VERSION}"
            )
        elif local.startswith(BUILD_LABEL_PREFIX):
            problems.append(
                f"the tree is a vllm-exl3 build ({version}, {source}) that already "
                "contains a "
                f"series; install the official vLLM {VLLM_VERSION} to apply onto"
            )
    return TargetTree(root, kind, version, source, problems)


def in_scope(kind: Kind, dest: str) -> bool:
    """Whether a file at tree path `dest` exists in this kind of tree. An installed
    wheel holds only the Python package: no CMake files, no csrc/, no tests/."""
    return kind == "sdist" or dest.startswith("vllm/")
