# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Progress lines for long steps (downloads, unpacking, zipping) on stderr. On a
terminal one line is redrawn; otherwise (CI logs) a line is printed every
PROGRESS_LOG_STEP of the work."""

from __future__ import annotations

import sys
import time

# Fraction of the work between two printed lines when stderr is not a terminal: 10
# lines per step keeps CI logs short but shows a stuck step.
PROGRESS_LOG_STEP = 0.1
# Redraw at most this often on a terminal (seconds).
_REDRAW_S = 0.2


class Progress:
    def __init__(
        self, label: str, total: int, unit: str = "MB", scale: float = 1e6
    ) -> None:
        self.label, self.total, self.unit, self.scale = (
            label,
            max(total, 1),
            unit,
            scale,
        )
        self.done = 0
        self._tty = sys.stderr.isatty()
        self._next_log = PROGRESS_LOG_STEP
        self._last_draw = 0.0
        self._t0 = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        frac = self.done / self.total
        if self._tty:
            now = time.monotonic()
            if now - self._last_draw >= _REDRAW_S or self.done >= self.total:
                self._last_draw = now
                sys.stderr.write(f"\r{self._line()}")
                sys.stderr.flush()
        elif frac >= self._next_log:
            while self._next_log <= frac:
                self._next_log += PROGRESS_LOG_STEP
            print(self._line(), file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self._tty:
            sys.stderr.write(
                f"\r{self._line()}  ({time.monotonic() - self._t0:.0f}s)\n"
            )
            sys.stderr.flush()

    def _line(self) -> str:
        pct = 100.0 * min(self.done / self.total, 1.0)
        if self.unit == "MB":
            amount = (
                f"{self.done / self.scale:.1f}/{self.total / self.scale:.1f} "
                f"{self.unit}"
            )
        else:
            amount = f"{self.done}/{self.total} {self.unit}"
        return f"  {self.label}: {amount} ({pct:3.0f}%)"
