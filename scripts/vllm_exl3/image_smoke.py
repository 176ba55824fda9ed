# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The smoke test of a serving image, run inside it with the image's Python.
`scripts/vllm-exl3 image` runs it in a chroot of a fresh unpacking of the image, with
this repository's tool, overlay, csrc/ and fixture checkpoint and the test's own tools
(pytest, cuobjdump) in a folder bound into it, never added to the image. No GPU:

- import: vLLM imports, and is our build (0.26.0+exl3.*);
- registration: vLLM lists the exl3 method, every EXL3 op loader finds its op in
  `vllm/_exl3_C.abi3.so`, and each registered op's schema is the one our sources define;
- device code: cuobjdump lists ELF images of the image's GPU only in that extension;
- refusals: every EXL3 op in that extension, given CPU tensors and fake CUDA tensors
  (past its device checks), raises its named error through the stable ABI
  (vllm_exl3.testing.error_path, in a child process: a crash fails the check, not the
  smoke test);
- fixture: the 4.0 bpw fixture loads through vLLM's loader on the CPU reference path
  and its logits match transformers running the weights the reference codec decodes:
  overlay/tests/quantization/exl3/test_exl3_model.py's own test, run by pytest;
- serve: `vllm serve --help` exits 0 with its usage. Without a GPU vLLM's CUDA build
  detects no platform and its argument parser stops ("Failed to infer device type"),
  so this check activates vLLM's CPU platform through vLLM's own platform-plugin entry
  point, declared by a distribution this test writes into its temporary folder (the
  image is not changed).

    python -m vllm_exl3.image_smoke --arch 12.1 --cuobjdump PATH [--json OUT]

Exit status 0 when every check passes. Importing this module needs nothing beyond the
standard library; the checks import vLLM and torch when they run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .kernels_build import (
    ARCH_FEATURES,
    EXTENSION,
    SOURCE_GLOBS,
    STABLE_SOURCES,
    normalize_arch,
    op_schemas,
)
from .repo import BUILD_LABEL_PREFIX, ROOT, VLLM_VERSION

# The fixture test, by its pytest node id under the repository root: the 3inst 4.0 bpw
# checkpoint (tests/fixtures/qwen3-tiny/exl3-4.0bpw).
FIXTURE_TEST = (
    "overlay/tests/quantization/exl3/test_exl3_model.py::"
    "test_whole_model_logits_match_transformers[3inst-4bpw]"
)
# The op loaders of the EXL3 package and of the sparse-MLA backend, by the op each
# makes available: (module, function).
OP_LOADERS = {
    "exl3_linear": (
        "vllm.model_executor.layers.quantization.exl3.ops",
        "load_exl3_ops",
    ),
    "exl3_moe": (
        "vllm.model_executor.layers.quantization.exl3.moe_ops",
        "load_exl3_moe_op",
    ),
    "exl3_embedding": (
        "vllm.model_executor.layers.quantization.exl3.embedding_ops",
        "load_exl3_embedding_op",
    ),
    "exl3_sparse_mla_decode": (
        "vllm.v1.attention.ops.exl3_sparse_mla",
        "load_sparse_mla_op",
    ),
}
# Output kept per check in the record: the end of it, where pytest and argparse say
# what happened.
OUTPUT_TAIL = 3000
# vLLM's entry-point group of platform plugins, and the distribution that declares this
# module's plugin for the `serve` check.
PLATFORM_PLUGINS = "vllm.platform_plugins"
PLUGIN_DIST = "vllm_exl3_image_smoke-0.dist-info"
_ELF_LINE = re.compile(r"^ELF file\s+\d+:\s+(\S+)$")
_ELF_SM = re.compile(r"\.sm_(\w+?)\.cubin$")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


def expected_sm(arch: str) -> str:
    """The device code an image for `arch` carries: '121', or '90a' on Hopper."""
    a = normalize_arch(arch)
    return ARCH_FEATURES.get(a, a)


def elf_images(list_elf_output: str) -> list[str]:
    """The ELF image names `cuobjdump --list-elf` prints, one per line of the form
    `ELF file    1: _exl3_C.abi3.1.sm_121.cubin`."""
    return [
        m.group(1)
        for line in list_elf_output.splitlines()
        if (m := _ELF_LINE.match(line.strip()))
    ]


def device_code_verdict(list_elf_output: str, sm: str) -> tuple[bool, str]:
    """Passes when there are ELF images and every one is sm_`sm`'s."""
    images = elf_images(list_elf_output)
    sms = [m.group(1) if (m := _ELF_SM.search(i)) else "?" for i in images]
    if not images:
        return False, "cuobjdump lists no ELF image"
    others = sorted({s for s in sms if s != sm})
    if others:
        return False, (
            f"{len(images)} ELF images, of other architectures too: "
            + ", ".join(f"sm_{s}" for s in others)
        )
    return True, f"{len(images)} ELF images, all sm_{sm}"


def schema_verdict(
    expected: dict[str, str], registered: dict[str, str]
) -> tuple[bool, str]:
    """Every op our sources define is registered, with the same schema."""
    missing = sorted(expected.keys() - registered.keys())
    differ = sorted(
        n for n in expected.keys() & registered.keys() if expected[n] != registered[n]
    )
    if missing or differ:
        return False, (
            f"not registered: {missing or 'none'}; schema differs: {differ or 'none'}"
        )
    return True, f"{len(expected)} ops registered as our sources define them"


def pytest_verdict(returncode: int, output: str) -> tuple[bool, str]:
    """Exactly one test ran, and passed."""
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    ok = returncode == 0 and re.search(r"\b1 passed\b", summary) is not None
    return ok, summary or f"no output (exit {returncode})"


def serve_help_verdict(returncode: int, output: str) -> tuple[bool, str]:
    ok = returncode == 0 and "usage: vllm serve" in output
    return ok, f"exit {returncode}" + (", usage printed" if ok else "")


def cpu_platform_plugin() -> str:
    """vLLM's CPU platform, as a platform plugin returns it."""
    return "vllm.platforms.cpu.CpuPlatform"


def write_platform_plugin(folder: Path) -> None:
    """A distribution in `folder` whose entry point makes vLLM take its CPU platform
    (cpu_platform_plugin) when `folder` is on the import path."""
    dist = folder / PLUGIN_DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-exl3-image-smoke\nVersion: 0\n"
    )
    (dist / "entry_points.txt").write_text(
        # __spec__.name: this module's importable name, also when run with -m.
        f"[{PLATFORM_PLUGINS}]\ncpu = {__spec__.name}:cpu_platform_plugin\n"
    )


def _timed(name: str, fn: Callable[[], tuple[bool, str]]) -> Check:
    t0 = time.monotonic()
    try:
        ok, detail = fn()
    except Exception as e:  # a check that raises has failed, naming why
        ok, detail = False, f"{type(e).__name__}: {e}"
    return Check(name, ok, detail, round(time.monotonic() - t0, 1))


def _run(
    cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[int, str]:
    r = subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    print(r.stdout[-OUTPUT_TAIL:], flush=True)
    return r.returncode, r.stdout


def check_import() -> tuple[bool, str]:
    import vllm

    # vllm.__version__ is the release's (its _version.py); the build's local label is
    # in the distribution's metadata.
    version = importlib.metadata.version("vllm")
    ok = version.startswith(f"{VLLM_VERSION}+{BUILD_LABEL_PREFIX}.")
    return ok, f"vllm {version} from {Path(vllm.__file__).parent}"


def check_registration() -> tuple[bool, str]:
    import torch
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if "exl3" not in QUANTIZATION_METHODS:
        return False, "exl3 is not among vLLM's quantization methods"
    failed = {}
    for op, (module, function) in OP_LOADERS.items():
        ok, why_not = getattr(importlib.import_module(module), function)()
        if not ok:
            failed[op] = why_not
    if failed:
        return False, f"op loaders failed: {failed}"
    sources = [p for pattern in SOURCE_GLOBS for p in STABLE_SOURCES.glob(pattern)]
    expected = {
        name: str(torch._C.parse_schema(f"_C::{schema}"))
        for name, schema in op_schemas(sources).items()
    }
    registered = {
        name: str(getattr(torch.ops._C, name).default._schema)
        for name in expected
        if hasattr(torch.ops._C, name)
    }
    ok, detail = schema_verdict(expected, registered)
    return ok, f"exl3 method listed; {', '.join(OP_LOADERS)} load; {detail}"


def _extension() -> str | None:
    """Where the image's vllm/_exl3_C.abi3.so is, or None."""
    spec = importlib.util.find_spec(f"vllm.{EXTENSION.split('.')[0]}")
    return spec.origin if spec is not None else None


def check_device_code(cuobjdump: Path, sm: str) -> tuple[bool, str]:
    lib = _extension()
    if not lib:
        return False, f"vllm/{EXTENSION} is not in the image"
    rc, out = _run([str(cuobjdump), "--list-elf", lib])
    if rc != 0:
        return False, f"cuobjdump exit {rc}"
    ok, detail = device_code_verdict(out, sm)
    return ok, f"{lib}: {detail}"


def check_refusals() -> tuple[bool, str]:
    lib = _extension()
    if not lib:
        return False, f"vllm/{EXTENSION} is not in the image"
    rc, out = _run(
        [sys.executable, "-m", "vllm_exl3.testing.error_path", lib], cwd=ROOT
    )
    oks = [line for line in out.splitlines() if line.startswith("ok ")]
    if rc != 0:
        return False, f"exit {rc} after {len(oks)} check(s) passed"
    ops = sum("(CPU tensors)" in line for line in oks)
    rules = next((line.split(": ", 1)[1] for line in oks if " rules " in line), "")
    return True, (
        f"{ops} ops raise their named errors on CPU tensors and on fake CUDA tensors"
        + (f"; exl3_linear: {rules}" if rules else "")
    )


def check_fixture() -> tuple[bool, str]:
    rc, out = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", FIXTURE_TEST],
        cwd=ROOT,
    )
    return pytest_verdict(rc, out)


def _vllm_cli() -> str:
    return str(Path(sys.executable).parent / "vllm")


def check_serve_help() -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as plugin:
        write_platform_plugin(Path(plugin))
        path = os.pathsep.join(filter(None, [plugin, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        ok, detail = serve_help_verdict(
            *_run([_vllm_cli(), "serve", "--help"], env=env)
        )
    return ok, f"{detail} (vLLM's CPU platform, by a platform plugin)"


def run_checks(arch: str, cuobjdump: Path) -> list[Check]:
    sm = expected_sm(arch)
    checks = [
        ("import", check_import),
        ("registration", check_registration),
        ("device-code", lambda: check_device_code(cuobjdump, sm)),
        ("refusals", check_refusals),
        ("fixture-logits", check_fixture),
        ("serve-help", check_serve_help),
    ]
    results = []
    for name, fn in checks:
        print(f"smoke: {name} ...", flush=True)
        results.append(_timed(name, fn))
        r = results[-1]
        print(
            f"smoke: {name}: {'PASS' if r.ok else 'FAIL'} ({r.seconds} s) {r.detail}",
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", required=True, help="the image's CUDA architecture")
    ap.add_argument("--cuobjdump", type=Path, required=True)
    ap.add_argument("--json", type=Path, help="write the verdicts here")
    args = ap.parse_args(argv)
    checks = run_checks(args.arch, args.cuobjdump)
    result = {
        "arch": args.arch,
        "python": sys.version.split()[0],
        "checks": [asdict(c) for c in checks],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        "smoke: " + ", ".join(f"{c.name} {'ok' if c.ok else 'FAILED'}" for c in checks)
    )
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
