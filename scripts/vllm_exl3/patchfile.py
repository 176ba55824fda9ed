# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reading `git format-patch` files: the message, and each file's diff split into hunks,
so a patch can be checked (and, for a wheel tree, filtered) per file and per hunk."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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
