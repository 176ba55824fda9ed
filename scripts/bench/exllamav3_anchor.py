# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ExLlamaV3 1.6.5 as the benchmark's anchor: its JIT build in the background, a guarded
import.

ExLlamaV3 compiles its CUDA extension on first import (torch.utils.cpp_extension.load,
minutes). An earlier run lost its same-run anchor this way: the build finished, but the
benchmark's own import then hung until the run's time limit. Two ways torch's JIT does
that: a `lock` file left in the build directory by an import that was killed mid-build
(every later import waits for it forever), or build flags that differ between the two
imports (another TORCH_CUDA_ARCH_LIST), so the second import silently recompiles
everything. So here:
  * the build runs in its own process session (survives the shell that started it) into
    a private TORCH_EXTENSIONS_DIR, and writes its exit status to a done-file;
  * the benchmark's import uses the very same environment (ENV below), waits for the
    done-file, removes `lock` files only once the builder has exited, and runs under an
    alarm with a message that says which of the two happened.

    python exllamav3_anchor.py build --state /tmp/exl3_next [--jobs 12]   # returns at
    once python exllamav3_anchor.py wait --state /tmp/exl3_next --timeout 300  # exit 0
    when built
"""

from __future__ import annotations

import argparse
import os
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

# The arch list is part of the build flags: builder and importer must agree on it, or
# the import recompiles (the H200 is sm_90).
ARCH_LIST = "9.0"
POLL_S = 2.0


class AnchorUnavailable(RuntimeError):
    pass


def paths(state: Path) -> dict[str, Path]:
    return {
        "site": state / "site",
        "ext": state / "torch_ext",
        "done": state / "build.done",
        "log": state / "build.log",
        "started": state / "build.started",
    }


def env_for(state: Path, jobs: int | None = None) -> dict[str, str]:
    """Environment of both the builder and the importer (same flags, same build
    directory)."""
    p = paths(state)
    env = {
        "TORCH_EXTENSIONS_DIR": str(p["ext"]),
        "TORCH_CUDA_ARCH_LIST": ARCH_LIST,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(p["site"]), os.environ.get("PYTHONPATH")])
        ),
    }
    if jobs:
        env["MAX_JOBS"] = str(jobs)
    return env


def start_build(state: Path, jobs: int) -> bool:
    """Start `import exllamav3.ext` in a new process session; False if one was started
    before."""
    p = paths(state)
    p["ext"].mkdir(parents=True, exist_ok=True)
    if p["started"].exists():
        return False
    p["started"].write_text(str(time.time()))
    env = {**os.environ, **env_for(state, jobs)}
    script = (
        f"{sys.executable} -c 'import exllamav3.ext' > {p['log']} 2>&1; "
        f"echo $? > {p['done']}.tmp && mv {p['done']}.tmp {p['done']}"
    )
    subprocess.Popen(
        ["bash", "-c", script],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return True


def wait_built(state: Path, timeout_s: float) -> int | None:
    """The builder's exit status once it has finished, or None after timeout_s (at once
    when no build was started)."""
    p = paths(state)
    t_end = time.monotonic() + timeout_s
    while not p["done"].exists():
        if not p["started"].exists() or time.monotonic() > t_end:
            return None
        time.sleep(POLL_S)
    return int(p["done"].read_text().strip() or "1")


def remove_stale_locks(state: Path) -> list[str]:
    """Delete torch's build `lock` files. Only called after the builder exited: a lock
    then is left over from a killed import and would block every later import forever.
    """
    removed = []
    for lock in paths(state)["ext"].rglob("lock"):
        lock.unlink(missing_ok=True)
        removed.append(str(lock))
    return removed


def load_linear_class(state: Path, wait_s: float, import_timeout_s: float):
    """ExLlamaV3's LinearEXL3, imported in this process under the builder's environment.

    Raises AnchorUnavailable with the reason (build not finished, build failed, import
    timed out) instead of hanging."""
    p = paths(state)
    if not p["started"].exists():
        raise AnchorUnavailable(f"no ExLlamaV3 build was started under {state}")
    rc = wait_built(state, wait_s)
    if rc is None:
        raise AnchorUnavailable(
            f"ExLlamaV3 build still running after {wait_s:.0f} s (log {p['log']})"
        )
    if rc != 0:
        tail = p["log"].read_text(errors="replace")[-600:] if p["log"].exists() else ""
        raise AnchorUnavailable(f"ExLlamaV3 build failed (exit {rc}): {tail}")
    removed = remove_stale_locks(state)
    if removed:
        print(
            f"removed stale torch build locks: {removed}", file=sys.stderr, flush=True
        )
    env = env_for(state)
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
    # The build's `pip install --target` folder is a site directory of its own.
    site.addsitedir(str(p["site"]))

    def on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
        raise AnchorUnavailable(
            f"import of ExLlamaV3 did not finish in {import_timeout_s:.0f} s although "
            "its build "
            "exited 0: it is compiling again (build flags differ from the builder's: "
            "check "
            f"TORCH_CUDA_ARCH_LIST={ARCH_LIST} and {p['ext']}) or waiting on a lock "
            "file"
        )

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(import_timeout_s)))
    t0 = time.monotonic()
    try:
        from exllamav3.modules.quant.exl3 import LinearEXL3
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    print(
        f"ExLlamaV3 imported in {time.monotonic() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return LinearEXL3


def add_state_arguments(ap: argparse.ArgumentParser, use: str) -> None:
    """--exl3-state and its waits, for a script that measures ExLlamaV3 (`use`: what
    the build serves there)."""
    ap.add_argument(
        "--exl3-state",
        type=Path,
        default=None,
        help="folder of scripts/bench/exllamav3_anchor.py's background build of "
        f"ExLlamaV3 1.6.5 (site/, torch_ext/) for {use}; without it an installed "
        "exllamav3 is used",
    )
    ap.add_argument("--exl3-wait-s", type=float, default=300)
    ap.add_argument("--exl3-import-timeout-s", type=float, default=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("build", "wait"))
    ap.add_argument(
        "--state",
        type=Path,
        required=True,
        help="private folder for site/, the "
        "build directory and the done-file (wheels installed into <state>/site)",
    )
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    if args.action == "build":
        started = start_build(args.state, args.jobs)
        print(
            "ExLlamaV3 build " + ("started" if started else "already started"),
            flush=True,
        )
        return 0
    rc = wait_built(args.state, args.timeout)
    p = paths(args.state)
    log = p["log"]
    status = (
        f"exit {rc}"
        if rc is not None
        else "still running"
        if p["started"].exists()
        else "never started"
    )
    print(f"ExLlamaV3 build: {status}", flush=True)
    if log.exists():
        print(log.read_text(errors="replace")[-800:], flush=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
