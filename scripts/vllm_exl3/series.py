# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reading the series' patches, planning an application onto a tree without touching
the tree, and the record of what an application did.

A `git format-patch` file is read into its message and each file's diff split into
hunks, so a patch can be checked (and, for a wheel tree, filtered) per file and per
hunk.

The patched files are copied into a scratch directory (outside any git repository) and
the patches are applied there in order with `git apply`; the overlay and CUDA sources
are compared with what the tree holds. The result is the exact bytes to write per path
plus, for reports, a verdict per patch, per file and per hunk. Applying a plan then only
writes files, so a series that does not apply leaves the tree untouched.

What an application did to a tree is recorded in `<tree>/.vllm-exl3/`: a manifest
(every file added, modified or deleted, with hashes before and after) and a pristine
copy of every file that existed before. That record makes a second apply a no-op, lets
`--replace` swap series, and lets `--revert` restore the tree byte for byte, refusing
when files we wrote were changed since.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import ToolError
from .repo import Kind, Series, SourceFile, in_scope

# The patches: messages, file diffs, hunks.

_HUNK_RE = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


@dataclass(frozen=True)
class Hunk:
    header: str  # the "@@ -a,b +c,d @@ context" line, without newline
    text: str  # header line and body


@dataclass(frozen=True)
class FileDiff:
    path: str  # tree path (the new name, or the old one for a deletion)
    header: str  # "diff --git" line up to the first hunk
    hunks: tuple[Hunk, ...]  # empty for binary or mode-only diffs

    @property
    def text(self) -> str:
        return self.header + "".join(h.text for h in self.hunks)


@dataclass(frozen=True)
class Patch:
    name: str
    subject: str
    files: tuple[FileDiff, ...]


def _strip_prefix(p: str) -> str | None:
    p = p.strip()
    if p == "/dev/null":
        return None
    return p.split("/", 1)[1] if "/" in p else p


def _parse_file(lines: list[str], i: int, where: str) -> tuple[FileDiff, int]:
    start = i
    old = new = None
    i += 1
    while i < len(lines) and not lines[i].startswith(("@@", "diff --git ")):
        if lines[i].startswith("--- "):
            old = _strip_prefix(lines[i][4:])
        elif lines[i].startswith("+++ "):
            new = _strip_prefix(lines[i][4:])
        i += 1
    header = "".join(lines[start:i])
    if (
        old is None and new is None
    ):  # binary or mode-only: names only on the diff --git line
        m = re.match(r"diff --git a/(\S+) b/(\S+)", lines[start])
        if not m:
            raise ValueError(
                f"{where}: cannot read the file names in {lines[start].strip()!r}"
            )
        new = m.group(2)
    hunks = []
    while i < len(lines) and lines[i].startswith("@@"):
        m = _HUNK_RE.match(lines[i])
        if not m:
            raise ValueError(f"{where}: malformed hunk header {lines[i].strip()!r}")
        old_left = int(m.group(1) or 1)
        new_left = int(m.group(2) or 1)
        h_start = i
        i += 1
        while (old_left or new_left) and i < len(lines):
            tag = lines[i][:1]
            if tag == " " or lines[i] in ("\n",):
                old_left, new_left = old_left - 1, new_left - 1
            elif tag == "-":
                old_left -= 1
            elif tag == "+":
                new_left -= 1
            elif tag != "\\":
                raise ValueError(f"{where}: hunk {lines[h_start].strip()!r} ends early")
            i += 1
        if old_left or new_left:
            raise ValueError(f"{where}: hunk {lines[h_start].strip()!r} is truncated")
        if i < len(lines) and lines[i].startswith(
            "\\"
        ):  # "\ No newline at end of file"
            i += 1
        hunks.append(Hunk(lines[h_start].rstrip("\n"), "".join(lines[h_start:i])))
    # Anything after the last hunk up to the next file (e.g. a mail signature) is not
    # diff.
    while i < len(lines) and not lines[i].startswith("diff --git "):
        i += 1
    return FileDiff(new if new is not None else old, header, tuple(hunks)), i


def parse_patch(path: Path) -> Patch:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    subject_lines: list[str] = []
    i = 0
    while (
        i < len(lines) and lines[i].strip()
    ):  # mail headers end at the first blank line
        if lines[i].startswith("Subject:"):
            subject_lines = [lines[i][len("Subject:") :].strip()]
            j = i + 1
            while j < len(lines) and lines[j][:1] in (" ", "\t"):
                subject_lines.append(lines[j].strip())
                j += 1
        i += 1
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(subject_lines))
    files = []
    while i < len(lines):
        if lines[i].startswith("diff --git "):
            fd, i = _parse_file(lines, i, path.name)
            files.append(fd)
        else:
            i += 1
    if not files:
        raise ValueError(f"{path.name}: no diff in this patch")
    return Patch(path.name, subject, tuple(files))


# Reads a tree path: (bytes, mode) or None when absent. Lets a plan be made against the
# tree as it was before an earlier application (pristine copies) without reverting
# first.
Reader = Callable[[str], "tuple[bytes, int] | None"]

_NEW_FILE_MODE = 0o644


@dataclass
class HunkVerdict:
    header: str
    applies: bool


@dataclass
class FileVerdict:
    path: str
    skipped: str | None = (
        None  # why this file's diff is not applied to this kind of tree
    )
    applies: bool = True
    missing: bool = False  # the file to patch is not in the tree
    hunks: list[HunkVerdict] = field(default_factory=list)


@dataclass
class PatchVerdict:
    name: str
    subject: str
    applies: bool
    already_applied: bool = False
    files: list[FileVerdict] = field(default_factory=list)
    git_error: str = ""


@dataclass
class Write:
    path: str
    content: bytes | None  # None: delete
    mode: int
    origin: str  # overlay/..., csrc/... or the patch name(s)


@dataclass
class Plan:
    writes: list[Write]
    identical: list[str]  # overlay/csrc files the tree already holds byte for byte
    patches: list[PatchVerdict]
    skipped_sources: list[str]  # overlay/csrc files outside this kind of tree
    problems: list[str]


def reader_for(root: Path) -> Reader:
    def read(path: str) -> tuple[bytes, int] | None:
        p = root / path
        if not p.is_file():
            return None
        return p.read_bytes(), p.stat().st_mode & 0o777

    return read


def _git(args: list[str], cwd: Path, stdin: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # Never let git discover a repository above the scratch directory: inside one,
    # `git apply` silently skips paths outside the current directory.
    env["GIT_CEILING_DIRECTORIES"] = str(cwd.parent)
    return subprocess.run(
        ["git", *args], cwd=cwd, input=stdin, env=env, capture_output=True, text=True
    )


def _applies(scratch: Path, diff: str, reverse: bool = False) -> tuple[bool, str]:
    args = ["apply", "--check", "--whitespace=nowarn"] + (
        ["--reverse"] if reverse else []
    )
    r = _git(args, scratch, diff)
    return r.returncode == 0, r.stderr.strip()


def _judge_file(scratch: Path, fd: FileDiff) -> FileVerdict:
    """Each hunk checked on its own against the file as the earlier patches left it."""
    fv = FileVerdict(fd.path)
    fv.missing = not (scratch / fd.path).exists() and "new file mode" not in fd.header
    for h in fd.hunks:
        fv.hunks.append(HunkVerdict(h.header, _applies(scratch, fd.header + h.text)[0]))
    # A diff without hunks (mode change, binary) is judged whole.
    fv.applies = (
        all(h.applies for h in fv.hunks) if fd.hunks else _applies(scratch, fd.text)[0]
    )
    return fv


def make_plan(series: Series, kind: Kind, read: Reader, per_hunk: bool = False) -> Plan:
    """What applying `series` onto the tree behind `read` would write. `per_hunk` judges
    every hunk even when the whole patch applies (for --check); otherwise only failing
    patches are broken down."""
    if shutil.which("git") is None:
        raise ToolError(
            "git is required (patches are applied with `git apply`); install git"
        )
    plan = Plan([], [], [], [], [])
    sources = _plan_sources(series, kind, read, plan)
    _plan_patches(series, kind, read, per_hunk, {sf.dest for sf in sources}, plan)
    for v in plan.patches:
        plan.problems += _patch_problems(v)
    return plan


def _plan_sources(
    series: Series, kind: Kind, read: Reader, plan: Plan
) -> list[SourceFile]:
    """Overlay and csrc files: new ones to write, identical ones to leave, conflicts."""
    if kind != "sdist" and series.csrc:
        plan.skipped_sources.append(
            f"csrc/ ({len(series.csrc)} files): a wheel tree has no sources"
        )
    candidates = list(series.overlay) + (list(series.csrc) if kind == "sdist" else [])
    sources = []
    for sf in candidates:
        if not in_scope(kind, sf.dest):
            plan.skipped_sources.append(
                f"{sf.origin}: outside the installed vllm/ package"
            )
            continue
        sources.append(sf)
        data = sf.read_bytes()
        current = read(sf.dest)
        if current is None:
            mode = _NEW_FILE_MODE | sf.exec_bits
            plan.writes.append(Write(sf.dest, data, mode, sf.origin))
        elif current[0] == data:
            plan.identical.append(sf.dest)
        else:
            plan.problems.append(
                f"{sf.dest}: the tree already has this file with different content, "
                "not written "
                f"by vllm-exl3 (would be overwritten by {sf.origin})"
            )
    return sources


def _plan_patches(
    series: Series,
    kind: Kind,
    read: Reader,
    per_hunk: bool,
    source_dests: set[str],
    plan: Plan,
) -> None:
    """The patches applied in order to scratch copies of the files they touch."""
    patches = [parse_patch(p) for p in series.patches]
    touched: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-exl3-plan-") as tmp:
        scratch = Path(tmp) / "tree"
        scratch.mkdir()
        originals: dict[str, tuple[bytes, int] | None] = {}
        for fd in (fd for patch in patches for fd in patch.files):
            if not in_scope(kind, fd.path) or fd.path in originals:
                continue
            originals[fd.path] = read(fd.path)
            if originals[fd.path] is not None:
                dst = scratch / fd.path
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(originals[fd.path][0])
                os.chmod(dst, originals[fd.path][1])
        for patch in patches:
            plan.patches.append(_apply_one(scratch, patch, kind, per_hunk, touched))
        for path, origin in touched.items():
            if path in source_dests:
                raise ToolError(
                    f"series error: {path} is both a new file and patched ({origin})"
                )
            before = originals.get(path)
            p = scratch / path
            after = (p.read_bytes(), p.stat().st_mode & 0o777) if p.exists() else None
            if after != before:
                mode = after[1] if after else (before[1] if before else _NEW_FILE_MODE)
                plan.writes.append(
                    Write(path, after[0] if after else None, mode, ", ".join(origin))
                )


def _patch_problems(v: PatchVerdict) -> list[str]:
    if v.applies:
        return []
    if v.already_applied:
        return [
            f"patch {v.name}: already applied to this tree, but not by vllm-exl3 (no "
            ".vllm-exl3/ record); start from a pristine tree"
        ]
    problems = []
    for fv in v.files:
        if fv.skipped or fv.applies:
            continue
        if fv.missing:
            problems.append(f"patch {v.name}: {fv.path} is missing from the tree")
            continue
        bad = [
            f"hunk {i} ({h.header})" for i, h in enumerate(fv.hunks, 1) if not h.applies
        ]
        problems.append(
            f"patch {v.name}: {fv.path}: "
            + (", ".join(bad) if bad else "the file diff")
            + " does not apply (the file was modified locally or is from another "
            "version)"
        )
    if not problems:  # each file applies alone, the combination does not
        problems.append(f"patch {v.name}: does not apply: {v.git_error}")
    return problems


def _apply_one(
    scratch: Path,
    patch: Patch,
    kind: Kind,
    per_hunk: bool,
    touched: dict[str, list[str]],
) -> PatchVerdict:
    kept = [fd for fd in patch.files if in_scope(kind, fd.path)]
    verdict = PatchVerdict(patch.name, patch.subject, applies=True)
    diff = "".join(fd.text for fd in kept)
    ok, err = _applies(scratch, diff) if kept else (True, "")
    for fd in patch.files:
        if not in_scope(kind, fd.path):
            verdict.files.append(
                FileVerdict(fd.path, skipped="not part of an installed wheel")
            )
        elif per_hunk or not ok:
            verdict.files.append(_judge_file(scratch, fd))
    if not ok:
        verdict.applies = False
        verdict.git_error = err
        verdict.already_applied = _applies(scratch, diff, reverse=True)[0]
    else:
        if kept:
            r = _git(["apply", "--whitespace=nowarn"], scratch, diff)
            if r.returncode != 0:  # --check passed, so this is an environment problem
                raise ToolError(
                    f"git apply of {patch.name} failed after its check: {r.stderr}"
                )
        for fd in kept:
            touched.setdefault(fd.path, []).append(patch.name)
    return verdict


# The record of an application.

STATE_DIR = ".vllm-exl3"
_MANIFEST = "manifest.json"
_PRISTINE = "pristine"
_FORMAT = 1


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Entry:
    path: str
    action: str  # "added" | "modified" | "deleted"
    origin: str
    sha256_before: str | None
    sha256_after: str | None
    mode_before: int | None


@dataclass
class State:
    tree: Path
    series: str
    kind: str
    vllm_version: str | None
    source: str  # series root and commit label, for messages
    applied_at: str
    entries: list[Entry] = field(default_factory=list)
    dirs_created: list[str] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return self.tree / STATE_DIR

    @classmethod
    def load(cls, tree: Path) -> State | None:
        manifest = tree / STATE_DIR / _MANIFEST
        if not manifest.is_file():
            if (tree / STATE_DIR).exists():
                raise ToolError(
                    f"{tree / STATE_DIR} exists but has no {_MANIFEST} (an interrupted "
                    "application?); restore the tree from its original and delete that "
                    "directory"
                )
            return None
        try:
            raw = json.loads(manifest.read_text())
            if raw.get("format") != _FORMAT:
                raise ValueError(f"unknown manifest format {raw.get('format')!r}")
            entries = [Entry(**e) for e in raw["entries"]]
            return cls(
                tree,
                raw["series"],
                raw["kind"],
                raw["vllm_version"],
                raw["source"],
                raw["applied_at"],
                entries,
                raw["dirs_created"],
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ToolError(
                f"{manifest} is unreadable ({e}); cannot tell what was applied"
            ) from e

    def _pristine(self, path: str) -> Path:
        return self.dir / _PRISTINE / path

    def changed_since(self) -> list[str]:
        """Every file we wrote (or deleted) whose current state differs from what we
        left."""
        out = []
        for e in self.entries:
            p = self.tree / e.path
            if e.sha256_after is None:
                if p.exists():
                    out.append(f"{e.path}: vllm-exl3 deleted it, but it exists again")
            elif not p.is_file():
                out.append(f"{e.path}: written by vllm-exl3, now missing")
            elif _sha(p.read_bytes()) != e.sha256_after:
                out.append(f"{e.path}: modified after vllm-exl3 wrote it")
        return out

    def broken_record(self) -> list[str]:
        """Pristine copies that no longer match their recorded hash (cannot restore
        those)."""
        out = []
        for e in self.entries:
            if e.sha256_before is None:
                continue
            p = self._pristine(e.path)
            if not p.is_file() or _sha(p.read_bytes()) != e.sha256_before:
                out.append(
                    f"{e.path}: its pristine copy in {STATE_DIR}/{_PRISTINE} is "
                    "missing "
                    "or damaged"
                )
        return out

    def pristine_reader(self, current: Reader) -> Reader:
        """Reads the tree as it was before this application, without changing it."""
        by_path = {e.path: e for e in self.entries}

        def read(path: str) -> tuple[bytes, int] | None:
            e = by_path.get(path)
            if e is None:
                return current(path)
            if e.sha256_before is None:
                return None
            return self._pristine(path).read_bytes(), e.mode_before or 0o644

        return read

    def revert(self, force: bool) -> list[str]:
        """Restore the tree; returns notes (directories left because they hold other
        files)."""
        broken = self.broken_record()
        if broken:
            raise ToolError("cannot revert:\n  " + "\n  ".join(broken))
        changed = self.changed_since()
        if changed and not force:
            raise ToolError(
                "refusing to revert, files written by vllm-exl3 were changed since "
                "(their changes "
                "would be lost; --force restores anyway):\n  " + "\n  ".join(changed)
            )
        for e in self.entries:
            p = self.tree / e.path
            if e.action == "added":
                p.unlink(missing_ok=True)
                if p.suffix == ".py":  # bytecode Python wrote for a module we added
                    for pyc in (p.parent / "__pycache__").glob(f"{p.stem}.*.pyc"):
                        pyc.unlink()
            else:
                data = self._pristine(e.path).read_bytes()
                p.parent.mkdir(parents=True, exist_ok=True)
                with open(p, "wb") as f:  # in place: keeps the inode's owner
                    f.write(data)
                os.chmod(p, e.mode_before or 0o644)
        notes = []
        for d in sorted(self.dirs_created, key=lambda s: s.count("/"), reverse=True):
            dp = self.tree / d
            cache = dp / "__pycache__"
            if cache.is_dir() and all(c.suffix == ".pyc" for c in cache.iterdir()):
                shutil.rmtree(cache)
            if dp.is_dir():
                if any(dp.iterdir()):
                    notes.append(f"left {d}/: it holds files vllm-exl3 did not write")
                else:
                    dp.rmdir()
        shutil.rmtree(self.dir)
        return notes


def record_and_write(
    tree: Path,
    plan: Plan,
    series_fp: str,
    kind: str,
    version: str | None,
    source: str,
    read: Reader,
) -> State:
    """Save pristine copies and the manifest first, then write the plan's files, so even
    an interrupted application can be reverted (with --force)."""
    state = State(
        tree,
        series_fp,
        kind,
        version,
        source,
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    created: set[str] = set()
    for w in plan.writes:
        before = read(w.path)
        if before is None:
            action = "added"
            parent = Path(w.path).parent
            while parent != Path(".") and not (tree / parent).exists():
                created.add(parent.as_posix())
                parent = parent.parent
        else:
            action = "deleted" if w.content is None else "modified"
            dst = state._pristine(w.path)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(before[0])
        state.entries.append(
            Entry(
                w.path,
                action,
                w.origin,
                _sha(before[0]) if before else None,
                _sha(w.content) if w.content is not None else None,
                before[1] if before else None,
            )
        )
    state.dirs_created = sorted(created)
    state.dir.mkdir(parents=True, exist_ok=True)
    manifest = {"format": _FORMAT, "tool": "vllm-exl3", **asdict(state)}
    manifest["tree"] = str(tree)
    (state.dir / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for w in plan.writes:
        p = tree / w.path
        if w.content is None:
            p.unlink()
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.write(w.content)
        os.chmod(p, w.mode)
    return state
