# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The environments the project runs in: ci/setup-env.sh (cache location, hash-keyed
venv path, pinned CUDA libraries), the docker/ image recipe kept in step with the tool
it runs, the setup of vLLM's own test harness on the EXL3 test files, and the steps of
the GPU CI entry (ci/gpu.sh).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from minitree import ROOT, run_tool
from vllm_exl3.build import DEFAULT_ARCHS
from vllm_exl3.cli import build_parser
from vllm_exl3.kernels_build import normalize_arch
from vllm_exl3.repo import VLLM_VERSION, WHEELS

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
    return {
        m.group(1): m.group(2)
        for kind, rest in instructions()
        if kind == "ARG"
        for m in [re.fullmatch(r"(\w+)=(\S+)", rest)]
        if m
    }


def build_command() -> list[str]:
    (run,) = [
        rest
        for kind, rest in instructions()
        if kind == "RUN" and rest.startswith("scripts/vllm-exl3 build")
    ]
    return shlex.split(run)[1:]


def test_build_step_parses_with_the_tools_own_parser():
    argv = [
        a.replace("${CUDA_ARCHS}", DEFAULT_ARCHS.split(";")[0]) for a in build_command()
    ]
    assert argv[0] == "build"
    args = build_parser().parse_args(
        argv
    )  # exits (SystemExit) on an option `build` lacks
    assert args.dist_dir == Path("/dist")
    # The serving stage installs what this step wrote.
    (install,) = [r for k, r in instructions() if k == "RUN" and "pip install" in r]
    assert f"/tmp/dist/vllm-{VLLM_VERSION}+exl3" in install
    assert ["COPY", "--from=build /dist/ /tmp/dist/"] in [
        list(i) for i in instructions()
    ]


def test_documented_architectures_are_the_supported_ones():
    supported = {normalize_arch(a) for a in DEFAULT_ARCHS.split(";")}
    documented = set(re.findall(r"CUDA_ARCHS=([0-9.]+)", DOCKERFILE.read_text()))
    assert {normalize_arch(a) for a in documented} == supported
    assert normalize_arch(arg_defaults()["CUDA_ARCHS"]) in supported


def test_base_images_are_cuda_13_with_a_supported_python():
    args = arg_defaults()
    assert args["CUDA_IMAGE_VERSION"].split(".")[0] == "13", (
        "torch 2.11.0 / vLLM 0.26.0 use CUDA 13"
    )
    # Ubuntu 24.04's python3 is 3.12; ci/setup-env.sh takes 3.10-3.13.
    assert args["UBUNTU"] == "ubuntu24.04"
    froms = [rest for kind, rest in instructions() if kind == "FROM"]
    assert froms[0] == "nvidia/cuda:${CUDA_IMAGE_VERSION}-devel-${UBUNTU} AS build"
    assert froms[1].startswith("nvidia/cuda:${CUDA_IMAGE_VERSION}-")


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex over slash-separated paths (`**/` any
    directories)."""
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
    """Whether the build context holds `rel`: the last rule matching it or a directory
    above it decides, as in Docker."""
    parts = rel.split("/")
    keep = True
    for negated, pattern in rules:
        rx = _pattern(pattern)
        if any(rx.match("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            keep = negated
    return keep


def test_build_context_keeps_what_the_build_reads_and_drops_the_records():
    rules = [
        (line.startswith("!"), line.lstrip("!"))
        for line in IGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    tracked = [
        p.relative_to(ROOT).as_posix()
        for d in ("patches", "overlay", "csrc", "scripts", "ci")
        for p in (ROOT / d).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    needed = [
        t
        for t in tracked
        if not t.startswith(("scripts/bench/results/", "scripts/e2e/results/"))
    ]
    assert needed and all(_sent(t, rules) for t in needed), [
        t for t in needed if not _sent(t, rules)
    ][:5]
    for rel in (
        "scripts/vllm-exl3",
        "ci/setup-env.sh",
        "scripts/vllm_exl3/repo.py",
        "README.md",
        "NOTICE",
    ):
        assert _sent(rel, rules), rel
    for rel in (
        "tests/fixtures/qwen3-tiny/bf16/model.safetensors",
        "build/x.o",
        "dist/a.whl",
        ".git/HEAD",
        "scripts/bench/results/README.md",
        "scripts/vllm_exl3/__pycache__/cli.cpython-311.pyc",
    ):
        assert not _sent(rel, rules), rel


@pytest.mark.parametrize("machine", sorted(WHEELS))
def test_every_machine_the_images_target_has_a_pinned_wheel(machine):
    name, sha = WHEELS[machine]
    assert name.endswith(f"_{machine}.whl") and re.fullmatch(r"[0-9a-f]{64}", sha)


# ci/setup-env.sh as a newcomer meets it: one variable moves the whole cache, the
# environment's path is keyed by the script's hash (checkouts at different commits keep
# their own), the tool finds the same path, and the CUDA libraries are pinned where
# torch 2.11.0 pins them.

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "setup-env.sh"
from vllm_exl3 import repo  # noqa: E402

# torch 2.11.0 names the cuda-toolkit metapackage at this version; the script spells out
# the versions that metapackage's extras pin (read from cuda_toolkit-13.0.2's METADATA).
CUDA_TOOLKIT = "13.0.2"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_EXL3_VENV", "VLLM_EXL3_WHEELS", "VLLM_EXL3_CACHE")
    }
    env.update(VLLM_EXL3_CACHE=str(tmp_path / "cache"), **extra)
    return env


def _setup(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cache_variable_moves_the_environment_and_the_tool_agrees(
    tmp_path, monkeypatch
):
    stamp = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:16]
    r = _setup(tmp_path, "--path")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "cache" / f"venv-{stamp}")
    monkeypatch.delenv("VLLM_EXL3_VENV", raising=False)
    monkeypatch.setenv("VLLM_EXL3_CACHE", str(tmp_path / "cache"))
    assert repo.default_venv() == Path(r.stdout.strip())
    assert repo.default_venv(tmp_path / "other") == tmp_path / "other" / f"venv-{stamp}"


def test_clean_keeps_the_current_environment_only(tmp_path):
    current = Path(_setup(tmp_path, "--path").stdout.strip())
    other = current.with_name("venv-0123456789abcdef")
    legacy = current.with_name("venv")
    for d in (current, other, legacy):
        (d / "bin").mkdir(parents=True)
    r = _setup(tmp_path, "--clean")
    assert r.returncode == 0, r.stderr
    assert current.is_dir() and not other.exists() and not legacy.exists()


def test_a_complete_environment_is_reused_without_touching_it(tmp_path):
    venv = Path(_setup(tmp_path, "--path").stdout.strip())
    stamp = venv.name.removeprefix("venv-")
    (venv / "bin").mkdir(parents=True)
    (venv / f".exl3-env-{stamp}").touch()
    r = _setup(tmp_path, VLLM_EXL3_PYTHON=sys.executable)
    assert r.returncode == 0 and "reusing" in r.stdout, r.stdout + r.stderr


def test_unknown_argument_is_refused(tmp_path):
    r = _setup(tmp_path, "--bogus")
    assert r.returncode == 2 and "unknown argument" in r.stderr


def _script_pins() -> dict[str, str]:
    return dict(re.findall(r"\b(nvidia-[a-z0-9-]+)==([0-9.]+)", SCRIPT.read_text()))


def test_cuda_libraries_are_pinned_at_torchs_own_pins():
    """The pins torch 2.11.0's wheel names directly must be the script's."""
    wheels = sorted((repo.default_cache_dir() / "wheels").glob("torch-2.11.0-*.whl"))
    if not wheels:
        pytest.skip("no torch 2.11.0 wheel in the cache (ci/setup-env.sh downloads it)")
    with zipfile.ZipFile(wheels[0]) as z:
        meta = z.read("torch-2.11.0.dist-info/METADATA").decode()
    requires = re.findall(r"^Requires-Dist: (\S+)==([^;\s]+)", meta, re.M)
    direct = {name: version for name, version in requires if name.startswith("nvidia-")}
    assert direct, "torch's METADATA names no nvidia-* pins"
    pins = _script_pins()
    assert {n: pins.get(n) for n in direct} == direct
    assert (
        dict(requires).get(next(n for n, _ in requires if n.startswith("cuda-toolkit")))
        == CUDA_TOOLKIT
    )


def test_no_cuda_library_is_left_unpinned():
    text = SCRIPT.read_text()
    named = set(re.findall(r"\b(nvidia-[a-z0-9-]+)(?:==|\s|$)", text))
    assert named <= set(_script_pins()), sorted(named - set(_script_pins()))


# The set-up of ci/test_vllm_harness.sh (vLLM's own conftest on overlay/tests/): its
# extra requirements agree with the offline bundle's pins, and the overlay's test files
# only add to vLLM's tests tree, never replace one of its files.

HARNESS = ROOT / "ci" / "test_vllm_harness.sh"
REQUIREMENTS = ROOT / "ci" / "requirements-harness.txt"
BUNDLE_REQUIREMENTS = ROOT / "scripts" / "vllm_exl3" / "bundle_requirements.txt"


def requirement_pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        spec = line.split("#")[0].strip()
        if spec:
            name, version = spec.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def test_requirements_are_pinned_as_in_the_bundle():
    harness, bundle = (
        requirement_pins(REQUIREMENTS),
        requirement_pins(BUNDLE_REQUIREMENTS),
    )
    assert harness and "tblib" in harness
    differ = {
        n: (v, bundle[n]) for n, v in harness.items() if n in bundle and bundle[n] != v
    }
    assert not differ, f"ci/requirements-harness.txt vs the bundle's pins: {differ}"


def test_script_parses():
    r = subprocess.run(["bash", "-n", str(HARNESS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_overlay_tests_only_add_to_vllms_tests_tree():
    ours = sorted(
        p.relative_to(ROOT / "overlay").as_posix()
        for p in (ROOT / "overlay" / "tests").rglob("*.py")
    )
    assert "tests/quantization/test_exl3.py" in ours
    r = run_tool("fetch")
    if r.returncode != 0:
        if "unreachable" in r.stderr or "offline" in r.stderr:
            pytest.skip(
                f"pinned sdist not cached and the index is unreachable: {r.stderr}"
            )
        pytest.fail(r.stderr)
    sdist = Path(r.stdout.strip().splitlines()[-1])
    assert (sdist / "tests" / "conftest.py").is_file()
    assert [p for p in ours if (sdist / p).exists()] == []
    # Each test file sits in a directory vLLM's tests tree already has, or in a folder
    # of its own directly inside one (tests/quantization/exl3/).
    assert [
        p
        for p in ours
        if not (sdist / p).parent.is_dir() and not (sdist / p).parent.parent.is_dir()
    ] == []


GPU_CI = ROOT / "ci" / "gpu.sh"


def _gpu_ci_steps() -> list[str]:
    m = re.search(r"^ALL_STEPS=\(([^)]*)\)", GPU_CI.read_text(), re.M)
    assert m, "ci/gpu.sh: no ALL_STEPS=(...) line"
    return m.group(1).split()


def test_gpu_ci_documents_and_runs_every_step():
    steps = _gpu_ci_steps()
    assert {"kernels", "e2e", "moe", "mtp", "sparse", "harness"} <= set(steps)
    r = subprocess.run(["bash", str(GPU_CI), "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    documented = re.findall(r"^  ([a-z0-9]+) {2,}", r.stdout, re.M)
    assert documented == steps, (documented, steps)
    body = GPU_CI.read_text().split("run_step() {", 1)[1]
    branches = set(re.findall(r"^    ([a-z0-9]+)\)", body, re.M))
    assert set(steps) <= branches, set(steps) - branches


def test_gpu_ci_refuses_an_unknown_step_before_looking_for_a_gpu():
    r = subprocess.run(
        ["bash", str(GPU_CI), "kernel"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "unknown step 'kernel'" in r.stderr and "harness" in r.stderr
