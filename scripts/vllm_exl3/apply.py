# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`apply`: put the overlay and CUDA sources into a vLLM tree and apply the patch
series; `--check` (dry run, per patch and hunk), `--revert` (byte-identical restore) and
`--replace` (revert an earlier application, then apply this one)."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from . import ToolError
from .repo import ROOT, VLLM_VERSION, Series, TargetTree, git_label, identify
from .series import (
    STATE_DIR,
    Plan,
    State,
    make_plan,
    reader_for,
    record_and_write,
)


def _refuse(tree: TargetTree, reasons: list[str]) -> ToolError:
    lines = "\n".join(f"  - {r}" for r in reasons)
    return ToolError(
        f"refusing to apply onto {tree.root}: {len(reasons)} problem(s):\n{lines}"
    )


def _print_report(tree: TargetTree, series: Series, plan: Plan) -> None:
    print(f"tree: {tree.describe}")
    print(f"series: {series.root}")
    added = sum(1 for w in plan.writes if w.origin.startswith(("overlay/", "csrc/")))
    print(
        f"overlay + csrc: {added} file(s) to add, {len(plan.identical)} already "
        "identical"
    )
    for s in plan.skipped_sources:
        print(f"  skipped {s}")
    if not plan.patches:
        print("patches: none in the series")
    for v in plan.patches:
        state = (
            "applies"
            if v.applies
            else ("ALREADY APPLIED" if v.already_applied else "FAILS")
        )
        print(f"patch {v.name}: {state}  ({v.subject})")
        for fv in v.files:
            if fv.skipped:
                print(f"    {fv.path}: skipped ({fv.skipped})")
                continue
            print(
                f"    {fv.path}: "
                + ("applies" if fv.applies else "MISSING" if fv.missing else "FAILS")
            )
            for i, h in enumerate(fv.hunks, 1):
                where = (
                    h.header.split(" @@", 1)[0] + " @@"
                )  # drop git's function context
                print(f"      hunk {i} {where}: {'applies' if h.applies else 'FAILS'}")


def _print_writes(plan: Plan) -> None:
    for w in plan.writes:
        verb = "delete" if w.content is None else "write "
        print(f"  {verb} {w.path}  <- {w.origin}")


def apply_onto(root: Path, series: Series) -> tuple[TargetTree, Plan]:
    """Apply onto a tree that holds no earlier application (used by `build` on a freshly
    unpacked wheel); raises listing every reason when the series does not apply."""
    tree = identify(root)
    if State.load(tree.root) is not None:
        raise ToolError(f"{tree.root} already holds a vllm-exl3 application")
    current = reader_for(tree.root)
    plan = make_plan(series, tree.kind, current)
    reasons = tree.problems + plan.problems
    if reasons:
        raise _refuse(tree, reasons)
    record_and_write(
        tree.root,
        plan,
        series.fingerprint(tree.kind),
        tree.kind,
        tree.version,
        f"{series.root} @ {git_label(series.root) or 'no git'}",
        current,
    )
    return tree, plan


@contextlib.contextmanager
def _tree_lock(root: Path) -> Iterator[None]:
    """One apply/revert per tree at a time (several test runs may share one venv). The
    lock file lives outside the tree so the tree itself stays byte-identical."""
    key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"vllm-exl3-{key}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another vllm-exl3 apply on {root} ...", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(args: argparse.Namespace) -> int:
    if not args.tree.is_dir():
        raise ToolError(f"{args.tree} is not a directory")
    with _tree_lock(args.tree.resolve()):
        return _run_locked(args)


def _run_locked(args: argparse.Namespace) -> int:
    series = Series.load(args.series)
    tree = identify(args.tree)
    state = State.load(tree.root)
    fp = series.fingerprint(tree.kind)

    if args.revert:
        if state is None:
            print(
                f"{tree.root}: no vllm-exl3 application recorded ({STATE_DIR}/ "
                "absent); "
                "nothing to revert"
            )
            return 0
        notes = state.revert(force=args.force)
        for n in notes:
            print(f"  note: {n}")
        print(
            f"reverted {len(state.entries)} file(s) in {tree.root}; the tree is as "
            "before "
            f"the application of {state.applied_at}"
        )
        return 0

    current = reader_for(tree.root)
    read = current
    if state is not None:
        changed = state.changed_since()
        if state.series == fp and not changed:
            print(
                f"{tree.root}: this series is already applied ({len(state.entries)} "
                "files, "
                f"{state.applied_at}); nothing to do"
            )
            return 0
        if not args.replace and not args.check:
            why = (
                f"files written by it were changed since: {'; '.join(changed)}"
                if changed
                else "it is a different series (overlay, csrc or patches changed)"
            )
            raise ToolError(
                f"{tree.root} holds an earlier vllm-exl3 application ({state.source}, "
                f"{state.applied_at}); {why}. Use --replace to revert it and apply "
                "this one, "
                "or --revert."
            )
        if changed and not args.force and not args.check:
            raise ToolError(
                "refusing to replace: files written by the earlier application were "
                "changed "
                "since (--force discards those changes):\n  " + "\n  ".join(changed)
            )
        read = state.pristine_reader(current)

    plan = make_plan(series, tree.kind, read, per_hunk=args.check)
    reasons = tree.problems + plan.problems
    if args.check:
        _print_report(tree, series, plan)
        if state is not None:
            print(
                f"note: {tree.root} holds an earlier application ({state.applied_at}); "
                "this "
                "check is against the tree as it was before it (what --replace would "
                "do)"
            )
        if reasons:
            print(f"\nthe series does NOT apply: {len(reasons)} problem(s):")
            for r in reasons:
                print(f"  - {r}")
            return 1
        print(
            f"\nthe series applies cleanly: {len(plan.writes)} file(s) would be written"
        )
        _print_writes(plan)
        return 0
    if reasons:
        raise _refuse(tree, reasons)

    if state is not None:
        state.revert(force=args.force)
        print(
            f"reverted the earlier application ({state.applied_at}, "
            f"{len(state.entries)} files)"
        )
    for s in plan.skipped_sources:
        print(f"skipped {s}")
    for v in plan.patches:
        for fv in v.files:
            if fv.skipped:
                print(f"skipped {v.name}: {fv.path} ({fv.skipped})")
    label = git_label(series.root) or "no git"
    record_and_write(
        tree.root,
        plan,
        fp,
        tree.kind,
        tree.version,
        f"{series.root} @ {label}",
        current,
    )
    _print_writes(plan)
    print(
        f"applied onto {tree.describe}: {len(plan.writes)} file(s) written, "
        f"{len(plan.patches)} patch(es); record in {tree.root / STATE_DIR}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "apply",
        help="apply the overlay, csrc and patch series onto a vLLM tree (or "
        "check/revert)",
        description=(
            "Apply this repository's overlay/, csrc/ (both laid out as in vLLM's "
            "tree) and patches/ onto "
            f"a vLLM {VLLM_VERSION} tree: an unpacked sdist, or an installed "
            "wheel "
            "(site-packages; there csrc/ and patches to files outside vllm/ are "
            "skipped). "
            f"What was done is recorded in <tree>/{STATE_DIR}/, so applying twice is a "
            "no-op and "
            "--revert restores the tree byte for byte. Refuses, listing every reason, "
            "a tree of "
            "another version or with locally modified files it must patch or overwrite."
        ),
    )
    p.add_argument("tree", type=Path, help="vLLM tree: unpacked sdist or site-packages")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        action="store_true",
        help="dry run: report per patch, file and hunk whether it applies",
    )
    mode.add_argument(
        "--revert",
        action="store_true",
        help="undo a recorded application (refuses if files we wrote were "
        "changed since, unless --force)",
    )
    mode.add_argument(
        "--replace",
        action="store_true",
        help="revert an earlier application (possibly of another series), then "
        "apply this one",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --revert/--replace: restore even files changed since we wrote them",
    )
    p.add_argument(
        "--series",
        type=Path,
        default=ROOT,
        help="repository root holding overlay/, csrc/, patches/ "
        "(default: this checkout)",
    )
    p.set_defaults(func=run)
