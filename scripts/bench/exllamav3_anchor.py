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

The build can also run ahead, on any machine with nvcc and the GPU host's Python and
torch (no GPU): `prebuild` compiles ExLlamaV3's extension from its wheel into
exllamav3_ext.so with a manifest of what it is bound to, and `build --prebuilt DIR` on
the GPU host checks that manifest against its own interpreter, installs the module into
site/, where ExLlamaV3's ext.py imports a precompiled extension instead of compiling:
the build then finishes at once.

    python exllamav3_anchor.py prebuild --wheel exllamav3-1.6.5-py3-none-any.whl \
        --out /tmp/exl3_prebuilt [--include DIR]   # about 30 minutes on 2 cores
    python exllamav3_anchor.py build --state /tmp/exl3 --prebuilt /tmp/exl3_prebuilt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# The arch list is part of the build flags: builder and importer must agree on it, or
# the import recompiles (the H200 is sm_90).
ARCH_LIST = "9.0"
POLL_S = 2.0


# ExLlamaV3's name for its extension (ext.py's `extension_name`): the module torch's JIT
# build writes, and the one ext.py imports instead of compiling when it is on sys.path.
EXT_NAME = "exllamav3_ext"
MANIFEST_NAME = f"{EXT_NAME}.json"
# Characters of the build log's end quoted when the build wrote no module.
LOG_TAIL_CHARS = 1200
# Run by `prebuild` under the unpacked wheel: ExLlamaV3's own ext.py, with bare parent
# packages instead of the package's __init__ (it imports the whole library and its
# dependencies, none of which the build needs). The build ends in an import of the fresh
# module; where that fails (no driver), the module is on disk by then.
PREBUILD_SCRIPT = """
import os, sys, types
root = os.path.join(sys.argv[1], "exllamav3")
for name, sub in (("exllamav3", ""), ("exllamav3.util", "util")):
    m = types.ModuleType(name)
    m.__path__ = [os.path.join(root, sub) if sub else root]
    sys.modules[name] = m
import exllamav3.ext
"""


class AnchorUnavailable(RuntimeError):
    pass


def ext_abi() -> dict[str, str]:
    """What a compiled extension is bound to: the interpreter, torch's build and the
    arch list."""
    import torch

    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": torch.__version__,
        "arch_list": ARCH_LIST,
    }


def default_includes() -> list[Path]:
    """The CUDA headers torch's pip wheels bring (site-packages/nvidia/*/include),
    which ExLlamaV3's sources include beside the toolkit's."""
    roots = [Path(p) for p in site.getsitepackages()]
    return sorted({d for r in roots for d in r.glob("nvidia/*/include") if d.is_dir()})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prebuild(wheel: Path, out: Path, jobs: int, includes: list[Path]) -> Path:
    """Compile ExLlamaV3's extension from its wheel into out/exllamav3_ext.so (no GPU
    needed) and write its manifest; returns the module's path."""
    m = re.match(r"exllamav3-([^-]+)-", wheel.name)
    if not m:
        raise AnchorUnavailable(
            f"{wheel}: not an exllamav3 wheel (exllamav3-VERSION-...)"
        )
    if not wheel.is_file():
        raise AnchorUnavailable(f"{wheel}: no such file")
    src, ext_dir = out / "src", out / "torch_ext"
    shutil.rmtree(src, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(src)
    built = ext_dir / EXT_NAME / f"{EXT_NAME}.so"
    built.unlink(missing_ok=True)
    # A `lock` left by a prebuild that was killed would hold this one forever.
    for lock in ext_dir.rglob("lock"):
        lock.unlink()
    cpath = [str(d) for d in includes] + [os.environ.get("CPATH", "")]
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(ext_dir),
        "TORCH_CUDA_ARCH_LIST": ARCH_LIST,
        "MAX_JOBS": str(jobs),
        "CPATH": os.pathsep.join(filter(None, cpath)),
    }
    log = out / "prebuild.log"
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(
            [sys.executable, "-c", PREBUILD_SCRIPT, str(src)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        ).returncode
    if not built.exists():
        tail = log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        raise AnchorUnavailable(
            f"ExLlamaV3's build wrote no {built} (exit {rc}; log {log}): {tail}"
        )
    target = out / f"{EXT_NAME}.so"
    shutil.copyfile(built, target)
    manifest = {
        **ext_abi(),
        "exllamav3": m.group(1),
        "sha256": sha256(target),
        "build_s": round(time.monotonic() - t0, 1),
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def install_prebuilt(state: Path, prebuilt: Path) -> Path:
    """Put prebuild's module (exllamav3_ext.so, or .so.xz) into state/site after
    checking its manifest against this interpreter; returns the installed path."""
    manifest_path = prebuilt / MANIFEST_NAME
    if not manifest_path.exists():
        raise AnchorUnavailable(f"{prebuilt}: no {MANIFEST_NAME} (made by `prebuild`)")
    manifest = json.loads(manifest_path.read_text())
    here = ext_abi()
    wrong = [
        f"{k} {manifest.get(k)} (here {v})"
        for k, v in here.items()
        if manifest.get(k) != v
    ]
    if wrong:
        raise AnchorUnavailable(
            f"{manifest_path}: the prebuilt ExLlamaV3 extension was built for another "
            f"interpreter: {', '.join(wrong)}; run `prebuild` under this one"
        )
    plain, packed = prebuilt / f"{EXT_NAME}.so", prebuilt / f"{EXT_NAME}.so.xz"
    site_dir = paths(state)["site"]
    site_dir.mkdir(parents=True, exist_ok=True)
    target = site_dir / f"{EXT_NAME}.so"
    if plain.exists():
        shutil.copyfile(plain, target)
    elif packed.exists():
        target.write_bytes(lzma.decompress(packed.read_bytes()))
    else:
        raise AnchorUnavailable(f"{prebuilt}: neither {plain.name} nor {packed.name}")
    if sha256(target) != manifest["sha256"]:
        target.unlink()
        raise AnchorUnavailable(
            f"{prebuilt}: {EXT_NAME}.so does not match the sha256 of {MANIFEST_NAME}"
        )
    return target


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
    ap.add_argument("action", choices=("build", "wait", "prebuild"))
    ap.add_argument(
        "--state",
        type=Path,
        help="build, wait: private folder for site/, the "
        "build directory and the done-file (wheels installed into <state>/site)",
    )
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument(
        "--prebuilt",
        type=Path,
        help="build: a folder of `prebuild` (exllamav3_ext.so or .so.xz and its "
        "manifest), installed into <state>/site instead of compiling",
    )
    ap.add_argument("--wheel", type=Path, help="prebuild: ExLlamaV3's wheel")
    ap.add_argument("--out", type=Path, help="prebuild: folder for the module")
    ap.add_argument(
        "--include",
        type=Path,
        action="append",
        default=[],
        help="prebuild: a header folder for the compiler (repeatable), beside those "
        "of site-packages/nvidia/*/include",
    )
    args = ap.parse_args(argv)
    if args.action == "prebuild":
        if not (args.wheel and args.out):
            ap.error("prebuild needs --wheel and --out")
        args.out.mkdir(parents=True, exist_ok=True)
        try:
            so = prebuild(
                args.wheel, args.out, args.jobs, args.include + default_includes()
            )
        except AnchorUnavailable as e:
            print(f"ExLlamaV3 prebuild failed: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"ExLlamaV3 extension: {so} ({so.stat().st_size} bytes)", flush=True)
        return 0
    if args.state is None:
        ap.error(f"{args.action} needs --state")
    if args.action == "build":
        if args.prebuilt:
            try:
                so = install_prebuilt(args.state, args.prebuilt)
            except AnchorUnavailable as e:
                print(f"ExLlamaV3 prebuilt: {e}", file=sys.stderr, flush=True)
                return 1
            print(f"ExLlamaV3 prebuilt extension installed: {so}", flush=True)
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
