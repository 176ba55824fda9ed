# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks vLLM's two-line SPDX header on Python files: the license line, then the
copyright line, at the top of the file (after a shebang line, if there is one). An empty
file (an empty `__init__.py`) needs none.

    python ci/check_spdx.py FILE...    exit status 1, one line per file that lacks it
"""

from __future__ import annotations

import sys
from pathlib import Path

HEADER = (
    "# SPDX-License-Identifier: Apache-2.0",
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
)


def is_python(path: Path) -> bool:
    if path.suffix == ".py":
        return True
    if path.suffix:
        return False
    with path.open("rb") as f:
        first = f.readline()
    return first.startswith(b"#!") and b"python" in first


def problem(path: Path) -> str | None:
    lines = path.read_text(encoding="utf-8").splitlines()
    if not any(line.strip() for line in lines):
        return None
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    top = tuple(lines[: len(HEADER)])
    if top == HEADER:
        return None
    missing = [h for h in HEADER if h not in top]
    what = (
        " and ".join(h.removeprefix("# ").split(":")[0] for h in missing) or "the order"
    )
    return f"{path}: the first lines must be the SPDX header ({what} wrong or missing)"


def main(argv: list[str]) -> int:
    problems = [
        p
        for a in argv
        if (f := Path(a)).is_file() and is_python(f)
        if (p := problem(f))
    ]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
