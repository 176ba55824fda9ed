# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What an application did to a tree, recorded in `<tree>/.vllm-exl3/`: a manifest
(every file added, modified or deleted, with hashes before and after) and a pristine
copy of every file that existed before. That record makes a second apply a no-op, lets
`--replace` swap series, and lets `--revert` restore the tree byte for byte, refusing
when files we wrote were changed since."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ToolError
from .series import Plan, Reader

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
