# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`fetch`: the pinned vLLM source distribution, downloaded once into the cache,
sha256-checked and unpacked. Also the cache access `build` uses for the pinned release
wheel."""

from __future__ import annotations

import argparse
import os
import shutil
import tarfile
from pathlib import Path

from . import ToolError
from .index import IndexUnreachable, download, find_file, sha256_file
from .progress import Progress
from .repo import SDIST_NAME, SDIST_SHA256, VLLM_VERSION, default_cache_dir

# Written into an unpacked tree last; a tree without it is an interrupted unpack and is
# redone.
_UNPACKED_MARKER = ".vllm-exl3-unpacked"
_SAFE_EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def wheels_dir(cache: Path) -> Path:
    """Shared with ci/setup-env.sh (same default, same override), so the ~300 MB release
    wheel is downloaded once for both."""
    env = os.environ.get("VLLM_EXL3_WHEELS")
    return Path(env).expanduser() if env else cache / "wheels"


def ensure_pinned(filename: str, sha256: str, dest_dir: Path, offline: bool) -> Path:
    """The pinned file from the cache, downloading it when absent. A cached copy whose
    hash differs is discarded and fetched again."""
    path = dest_dir / filename
    if path.is_file():
        if sha256_file(path) == sha256:
            return path
        print(
            f"fetch: cached {path} does not match its pinned sha256; fetching it again"
        )
        if offline:
            raise ToolError(
                f"{path} is corrupt (sha256 mismatch) and --offline forbids fetching "
                "it again"
            )
    cold = (
        f"the cache has no copy of {filename} ({dest_dir}). Connect to the package "
        "index, or "
        f"place the file there by hand (sha256 {sha256})"
    )
    if offline:
        raise ToolError(f"offline (--offline) and {cold}")
    try:
        link = find_file("vllm", filename)
        print(f"fetch: {filename} from {link.index}")
        download(link, path, sha256)
    except IndexUnreachable as e:
        raise ToolError(
            f"offline: the package index is unreachable ({e}), and {cold}"
        ) from e
    return path


def _unpack(archive: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".unpacking")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        prog = Progress(f"unpacking {archive.name}", len(members), unit="files")
        for m in members:
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise ToolError(
                    f"{archive}: refusing member {m.name!r} (outside the tree)"
                )
            # Where available, the "data" filter also rejects links out of the tree and
            # devices.
            tar.extract(m, tmp, **_SAFE_EXTRACT)
            prog.advance(1)
        prog.finish()
    (top,) = [p for p in tmp.iterdir()]  # an sdist holds exactly one top directory
    shutil.rmtree(dest, ignore_errors=True)
    top.rename(dest)
    tmp.rmdir()
    (dest / _UNPACKED_MARKER).write_text(SDIST_SHA256 + "\n")


def ensure_sdist_tree(cache: Path, offline: bool = False) -> Path:
    """The unpacked pristine sdist (shared: never modify it; copy it first)."""
    tree = cache / "src" / f"vllm-{VLLM_VERSION}"
    marker = tree / _UNPACKED_MARKER
    if marker.is_file() and marker.read_text().strip() == SDIST_SHA256:
        return tree
    archive = ensure_pinned(SDIST_NAME, SDIST_SHA256, cache / "sdist", offline)
    _unpack(archive, tree)
    return tree


def pristine_files(tree: Path) -> list[str]:
    """Files of an unpacked sdist as shipped (our unpack marker excluded)."""
    return sorted(
        p.relative_to(tree).as_posix()
        for p in tree.rglob("*")
        if p.is_file() and p.name != _UNPACKED_MARKER
    )


def copy_sdist_tree(src: Path, dest: Path) -> None:
    """A working copy of the pristine tree without our unpack marker."""
    shutil.copytree(
        src, dest, symlinks=True, ignore=shutil.ignore_patterns(_UNPACKED_MARKER)
    )


def run(args: argparse.Namespace) -> int:
    tree = ensure_sdist_tree(args.cache_dir, offline=args.offline)
    print(tree)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fetch",
        help=f"download, verify and unpack the vLLM {VLLM_VERSION} sdist",
        description=(
            f"Download {SDIST_NAME} from pip's configured package index into the "
            "cache, "
            f"verify its pinned sha256 ({SDIST_SHA256[:16]}...) and unpack it. "
            "Prints the "
            "unpacked tree's path. With a warm cache no network is used."
        ),
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="cache directory (default: $VLLM_EXL3_CACHE or ~/.cache/vllm-exl3)",
    )
    p.add_argument("--offline", action="store_true", help="never touch the network")
    p.set_defaults(func=run)
