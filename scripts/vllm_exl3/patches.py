# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patch workflow (see patches/README.md): `dev-tree` makes a git checkout of the
pristine pinned vLLM with the series applied as commits (`git am`, one commit per patch,
its message intact); after editing, committing, rebasing there, `export-patches` writes
the commits back as the series (`git format-patch`), replacing the old one. Patches are
never edited by hand."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from . import ToolError
from .fetch import copy_sdist_tree, ensure_sdist_tree
from .repo import ROOT, VLLM_VERSION, Series, default_cache_dir

# Tag on the pristine commit of a dev tree: the base every export starts from.
BASE_TAG = "vllm-exl3-base"
# Committer identity inside dev trees (authors come from the patches themselves).
_IDENTITY = ["-c", "user.name=vllm-exl3", "-c", "user.email=vllm-exl3@localhost"]
# format-patch settings that make a re-export byte-identical when nothing changed: no
# commit ids, no version signature, no diffstat, full blob ids (abbreviations grow with
# the repository), no "[PATCH n/m]" numbering (it would rewrite every subject when a
# patch is added).
EXPORT_FLAGS = [
    "--no-signature",
    "--zero-commit",
    "--no-stat",
    "--full-index",
    "--no-numbered",
    "--no-renames",
    "--no-binary",
]


def _git(
    tree: Path, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """git in `tree`, with `env` added (an identity, a date, an index file)."""
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # Personal and system git settings (diff.noprefix, format.signature, autocrlf...)
    # would change what format-patch writes; dev trees use git's defaults only.
    env.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1", **extra)
    r = subprocess.run(
        ["git", *_IDENTITY, *args], cwd=tree, env=env, capture_output=True, text=True
    )
    if check and r.returncode != 0:
        raise ToolError(f"git {' '.join(args)} in {tree} failed:\n{r.stdout}{r.stderr}")
    return r


def make_dev_tree(base: Path, dest: Path, patches: list[Path], label: str) -> int:
    """Copy `base` to `dest`, commit it as the pristine base, `git am` the patches;
    returns how many applied. Stops at the first patch that does not apply, leaving git
    am in progress."""
    if dest.exists() and any(dest.iterdir()):
        raise ToolError(f"{dest} exists and is not empty")
    if dest.exists():
        dest.rmdir()
    copy_sdist_tree(base, dest)
    _git(dest, "init", "-q")
    # -f: the sdist ships .gitignore files; the base must hold every file it has.
    _git(dest, "add", "-f", "-A", ".")
    _git(dest, "commit", "-q", "--no-verify", "-m", f"{label} pristine")
    _git(dest, "tag", BASE_TAG)
    if not patches:
        return 0
    r = _git(dest, "am", "-q", "--whitespace=nowarn", *map(str, patches), check=False)
    if r.returncode != 0:
        done = int(_git(dest, "rev-list", "--count", f"{BASE_TAG}..HEAD").stdout)
        raise ToolError(
            f"patch {patches[done].name} does not apply on {label} (patches before it "
            "are "
            f"committed in {dest}).\n{r.stdout}{r.stderr}\nResolve it there as with "
            "any git am: "
            "fix the files, `git add` them, `git am --continue` (or `git am --skip`), "
            "then run "
            "export-patches."
        )
    return len(patches)


def export_series(
    dev: Path, patches_dir: Path
) -> tuple[list[str], list[str], list[str]]:
    """Replace `patches_dir/*.patch` with the dev tree's commits after the base; returns
    (added, changed, removed) file names."""
    if (
        not (dev / ".git").exists()
        or _git(dev, "rev-parse", "-q", "--verify", BASE_TAG, check=False).returncode
    ):
        raise ToolError(
            f"{dev} is not a dev tree made by `vllm-exl3 dev-tree` (no {BASE_TAG} tag)"
        )
    if (dev / ".git" / "rebase-apply").exists():
        raise ToolError(
            f"{dev}: a git am is in progress; finish it (git am --continue) first"
        )
    dirty = _git(dev, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty:
        raise ToolError(
            f"{dev} has uncommitted changes; commit them (one commit per patch):\n"
            + dirty
        )
    merges = _git(dev, "rev-list", "--merges", f"{BASE_TAG}..HEAD").stdout.split()
    if merges:
        raise ToolError(
            f"{dev}: the history after {BASE_TAG} has merge commits; keep it linear"
        )
    patches_dir.mkdir(parents=True, exist_ok=True)
    old = {p.name: p.read_bytes() for p in patches_dir.glob("*.patch")}
    with tempfile.TemporaryDirectory(prefix="vllm-exl3-export-") as tmp:
        _git(dev, "format-patch", *EXPORT_FLAGS, "-o", tmp, f"{BASE_TAG}..HEAD")
        new = {p.name: p.read_bytes() for p in Path(tmp).glob("*.patch")}
    for name in old:
        (patches_dir / name).unlink()
    for name, data in new.items():
        (patches_dir / name).write_bytes(data)
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    changed = sorted(n for n in set(new) & set(old) if new[n] != old[n])
    return added, changed, removed


def run_dev_tree(args: argparse.Namespace) -> int:
    series = Series.load(args.series)
    base = args.base or ensure_sdist_tree(args.cache_dir, offline=args.offline)
    label = args.label or f"vllm {VLLM_VERSION}"
    n = make_dev_tree(base, args.dir, list(series.patches), label)
    print(
        f"{args.dir}: git checkout of {label} ({BASE_TAG}) with {n} patch(es) as "
        "commits"
    )
    print("edit, commit (one commit per patch; message: why, upstream intent), then:")
    print(f"  scripts/vllm-exl3 export-patches {args.dir}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    patches_dir = Series.load(args.series).root / "patches"
    added, changed, removed = export_series(args.dir, patches_dir)
    total = len(list(patches_dir.glob("*.patch")))
    print(
        f"{patches_dir}: {total} patch(es); added {len(added)}, changed "
        f"{len(changed)}, "
        f"removed {len(removed)}"
    )
    for label, names in (("added", added), ("changed", changed), ("removed", removed)):
        for name in names:
            print(f"  {label}: {name}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dev-tree",
        help="make a git checkout of the pristine vLLM with the series as commits",
        description=(
            f"Unpack the pinned vLLM {VLLM_VERSION} sdist into DIR as a git "
            "repository "
            f"(commit '<label> pristine', tag {BASE_TAG}) and apply patches/*.patch "
            "with git am, "
            "one commit per patch. Edit the series there with ordinary git (commit, "
            "rebase -i), "
            "then run export-patches. See patches/README.md."
        ),
    )
    p.add_argument(
        "dir", type=Path, help="where to create the checkout (absent or empty)"
    )
    p.add_argument(
        "--base",
        type=Path,
        help="start from this pristine tree instead of the pinned sdist (e.g. a new "
        "vLLM release when porting the series)",
    )
    p.add_argument(
        "--label",
        help=f"name of the base in its commit (default: vllm {VLLM_VERSION})",
    )
    p.add_argument(
        "--series", type=Path, default=ROOT, help="repository root holding patches/"
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="cache directory (default: $VLLM_EXL3_CACHE or ~/.cache/vllm-exl3)",
    )
    p.add_argument("--offline", action="store_true", help="never touch the network")
    p.set_defaults(func=run_dev_tree)

    e = subparsers.add_parser(
        "export-patches",
        help="write a dev tree's commits back as patches/ (git format-patch)",
        description=(
            f"git format-patch the commits after {BASE_TAG} in DIR into patches/, "
            "replacing the "
            "old series. Deterministic: exporting an unchanged dev tree rewrites "
            "identical files."
        ),
    )
    e.add_argument("dir", type=Path, help="a checkout made by dev-tree")
    e.add_argument(
        "--series", type=Path, default=ROOT, help="repository root holding patches/"
    )
    e.set_defaults(func=run_export)
