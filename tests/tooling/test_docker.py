# SPDX-License-Identifier: Apache-2.0
"""docker/: the image recipe stays in step with the tool it runs. No Docker engine is needed: the
Dockerfile's build step is checked against `vllm-exl3 build`'s own parser, its architectures
against the ones the series supports, and its build context against what the build reads."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from minitree import ROOT
from vllm_exl3 import pins
from vllm_exl3.build import DEFAULT_ARCHS
from vllm_exl3.cli import build_parser
from vllm_exl3.kernels_build import normalize_arch

DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
IGNORE = DOCKER / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def arg_defaults() -> dict[str, str]:
    return {m.group(1): m.group(2) for kind, rest in instructions() if kind == "ARG"
            for m in [re.fullmatch(r"(\w+)=(\S+)", rest)] if m}


def build_command() -> list[str]:
    (run,) = [rest for kind, rest in instructions()
              if kind == "RUN" and rest.startswith("scripts/vllm-exl3 build")]
    return shlex.split(run)[1:]


def test_build_step_parses_with_the_tools_own_parser():
    argv = [a.replace("${CUDA_ARCHS}", DEFAULT_ARCHS.split(";")[0]) for a in build_command()]
    assert argv[0] == "build"
    args = build_parser().parse_args(argv)  # exits (SystemExit) on an option `build` lacks
    assert args.dist_dir == Path("/dist")
    # The serving stage installs what this step wrote.
    (install,) = [r for k, r in instructions() if k == "RUN" and "pip install" in r]
    assert f"/tmp/dist/vllm-{pins.VLLM_VERSION}+exl3" in install
    assert ["COPY", "--from=build /dist/ /tmp/dist/"] in [list(i) for i in instructions()]


def test_documented_architectures_are_the_supported_ones():
    supported = {normalize_arch(a) for a in DEFAULT_ARCHS.split(";")}
    documented = set(re.findall(r"CUDA_ARCHS=([0-9.]+)", (DOCKER / "README.md").read_text()))
    documented |= set(re.findall(r"CUDA_ARCHS=([0-9.]+)", DOCKERFILE.read_text()))
    assert {normalize_arch(a) for a in documented} == supported
    assert normalize_arch(arg_defaults()["CUDA_ARCHS"]) in supported


def test_base_images_are_cuda_13_with_a_supported_python():
    args = arg_defaults()
    assert args["CUDA_IMAGE_VERSION"].split(".")[0] == "13", "torch 2.11.0 / vLLM 0.26.0 use CUDA 13"
    # Ubuntu 24.04's python3 is 3.12; ci/setup-env.sh takes 3.10-3.13.
    assert args["UBUNTU"] == "ubuntu24.04"
    froms = [rest for kind, rest in instructions() if kind == "FROM"]
    assert froms[0] == "nvidia/cuda:${CUDA_IMAGE_VERSION}-devel-${UBUNTU} AS build"
    assert froms[1].startswith("nvidia/cuda:${CUDA_IMAGE_VERSION}-")


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex over slash-separated paths (`**/` any directories)."""
    out, i, p = "", 0, pattern.strip().rstrip("/")
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(p[i], re.escape(p[i]))
            i += 1
    return re.compile(out + r"\Z")


def _sent(rel: str, rules: list[tuple[bool, str]]) -> bool:
    """Whether the build context holds `rel`: the last rule matching it or a directory above it
    decides, as in Docker."""
    parts = rel.split("/")
    keep = True
    for negated, pattern in rules:
        rx = _pattern(pattern)
        if any(rx.match("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            keep = negated
    return keep


def test_build_context_keeps_what_the_build_reads_and_drops_the_records():
    rules = [(line.startswith("!"), line.lstrip("!"))
             for line in IGNORE.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    tracked = [p.relative_to(ROOT).as_posix() for d in ("patches", "overlay", "csrc", "scripts", "ci")
               for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    needed = [t for t in tracked if not t.startswith(("scripts/bench/results/",
                                                       "scripts/e2e/results/"))]
    assert needed and all(_sent(t, rules) for t in needed), \
        [t for t in needed if not _sent(t, rules)][:5]
    for rel in ("scripts/vllm-exl3", "ci/setup-env.sh", "scripts/vllm_exl3/pins.py",
                "README.md", "NOTICE"):
        assert _sent(rel, rules), rel
    for rel in ("tests/fixtures/qwen3-tiny/bf16/model.safetensors", "build/x.o", "dist/a.whl",
                ".git/HEAD", "scripts/bench/results/README.md",
                "scripts/vllm_exl3/__pycache__/cli.cpython-311.pyc"):
        assert not _sent(rel, rules), rel


@pytest.mark.parametrize("machine", sorted(pins.WHEELS))
def test_every_machine_the_images_target_has_a_pinned_wheel(machine):
    name, sha = pins.WHEELS[machine]
    assert name.endswith(f"_{machine}.whl") and re.fullmatch(r"[0-9a-f]{64}", sha)
