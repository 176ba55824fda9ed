# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""This repository's layout: where the overlay, the CUDA sources and the patch series
live, and where each lands in a vLLM tree."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Repository `csrc/X` lands at `csrc/libtorch_stable/X` in the vLLM tree, next to the
# sources of vLLM's stable-ABI extension that the CMake patch adds ours to.
CSRC_DEST = "csrc/libtorch_stable"

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
KERNEL_GENERATOR = "csrc/quantization/exl3/generate_kernels.py"


def _generated_csrc(root: Path) -> tuple[SourceFile, ...]:
    generator = root / KERNEL_GENERATOR
    if not generator.is_file():
        return ()
    spec = importlib.util.spec_from_file_location("exl3_generate_kernels", generator)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = Path(KERNEL_GENERATOR).parent.relative_to("csrc").as_posix()
    return tuple(
        SourceFile(
            generator,
            f"{KERNEL_GENERATOR} ({name})",
            f"{CSRC_DEST}/{folder}/{name}",
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
        csrc = tuple(
            SourceFile(
                p,
                p.relative_to(root).as_posix(),
                f"{CSRC_DEST}/{p.relative_to(root / 'csrc').as_posix()}",
            )
            for p in _files_under(root / "csrc")
        ) + _generated_csrc(root)
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
