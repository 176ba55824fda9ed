# SPDX-License-Identifier: Apache-2.0
"""`bundle`: trimming, splitting into parts, install.sh's checks and reassembly, installing with
pip --no-index --target, and importing what it installed. The fast tests use a miniature wheel
and a local dependency; the slow one bundles a real quick build and imports vLLM from it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from minitree import make_wheel, run_tool
from vllm_exl3 import pins
from vllm_exl3.bundle import parse_size

PYVER = f"{sys.version_info[0]}.{sys.version_info[1]}"
PYTAG = f"{sys.version_info[0]}{sys.version_info[1]}"
PART = 4000  # bytes: small enough that the miniature payload needs several parts


def _mini_build(tmp_path: Path) -> Path:
    """What a quick build looks like, in miniature: kept and dropped pieces side by side."""
    return make_wheel(tmp_path / "dist", {
        "vllm/__init__.py": "MINI = True\n",
        "vllm/_C_stable_libtorch.abi3.so": os.urandom(9000),
        "vllm/_exl3_C.abi3.so": b"exl3",
        "vllm/_moe_C_stable_libtorch.abi3.so": b"moe",
        "vllm/third_party/__init__.py": "",
        "vllm/third_party/pynvml.py": "NVML = 1\n",
        "vllm/third_party/deep_gemm/include/deep_gemm.h": "// header\n",
        f"vllm/third_party/deep_gemm/_C.cpython-{PYTAG}-x86_64-linux-gnu.so": b"dg-this",
        "vllm/third_party/deep_gemm/_C.cpython-399-x86_64-linux-gnu.so": b"dg-other",
        "vllm/vllm_flash_attn/__init__.py": "",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2",
        "vllm/vllm-rs": b"rust",
    }, version=f"{pins.VLLM_VERSION}+exl3.mini")


@pytest.fixture
def local_dependency(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A pure-Python dependency wheel served from a local directory (no network): pip reads
    PIP_NO_INDEX / PIP_FIND_LINKS like its configuration files."""
    links = tmp_path / "links"
    make_wheel(links, {"exl3testdep/__init__.py": "DEP = 'ok'\n"}, version="1.0",
               name="exl3testdep", tag="py3-none-any")
    req = tmp_path / "requirements.txt"
    req.write_text("# test\nexl3testdep==1.0  # pinned\n")
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}, req


def _bundle(tmp_path: Path, wheel: Path, *extra, env=None):
    return run_tool("bundle", "--wheel", wheel, "--out", tmp_path / "bundle", "--part-size",
                    str(PART), "--python-version", PYVER, "--cache-dir", tmp_path / "cache",
                    *extra, env=env)


def _install(bundle: Path, target: Path, python: str = sys.executable):
    return subprocess.run(["bash", str(bundle / "install.sh"), str(target)], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": python})


def test_parse_size():
    assert parse_size("60MB") == 60_000_000
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("1.5k") == 1500
    assert parse_size("4000") == 4000
    for bad in ("", "MB", "12 parsecs", "0"):
        with pytest.raises(Exception):
            parse_size(bad)


def test_bundle_install_import(tmp_path, local_dependency):
    env, req = local_dependency
    wheel = _mini_build(tmp_path)
    r = _bundle(tmp_path, wheel, "--requirements", req, env=env)
    assert r.returncode == 0, r.stderr
    bundle = tmp_path / "bundle"
    parts = sorted(bundle.glob("vllm-exl3-bundle.part*"))
    sizes = [p.stat().st_size for p in parts]
    assert len(parts) >= 3 and max(sizes) <= PART
    assert len(parts) == math.ceil(sum(sizes) / PART)  # every part but the last is full
    assert sorted(p.name for p in bundle.iterdir()) == sorted(
        ["install.sh", *(p.name for p in parts)])

    target = tmp_path / "site"
    inst = _install(bundle, target)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    assert "export VLLM_USE_FLASHINFER_SAMPLER=0" in inst.stdout
    assert f'export PYTHONPATH="{target}' in (target / "vllm-exl3-env.sh").read_text()
    vllm = target / "vllm"
    for kept in ("_C_stable_libtorch.abi3.so", "_exl3_C.abi3.so", "third_party/pynvml.py",
                 f"third_party/deep_gemm/_C.cpython-{PYTAG}-x86_64-linux-gnu.so",
                 "vllm_flash_attn/_vllm_fa3_C.abi3.so"):
        assert (vllm / kept).is_file(), kept
    for dropped in ("_moe_C_stable_libtorch.abi3.so", "vllm-rs", "third_party/deep_gemm/include",
                    "third_party/deep_gemm/_C.cpython-399-x86_64-linux-gnu.so",
                    "vllm_flash_attn/_vllm_fa2_C.abi3.so"):
        assert not (vllm / dropped).exists(), dropped
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm, exl3testdep; print(vllm.__file__, vllm.MINI, "
         "exl3testdep.DEP)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(target)},
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [str(vllm / "__init__.py"), "True", "ok"]


def test_with_moe_keeps_the_moe_extension(tmp_path):
    r = _bundle(tmp_path, _mini_build(tmp_path), "--without-deps", "--with-moe")
    assert r.returncode == 0, r.stderr
    target = tmp_path / "site"
    assert _install(tmp_path / "bundle", target).returncode == 0
    assert (target / "vllm/_moe_C_stable_libtorch.abi3.so").is_file()


def test_install_refuses_missing_and_damaged_parts(tmp_path):
    assert _bundle(tmp_path, _mini_build(tmp_path), "--without-deps").returncode == 0
    bundle = tmp_path / "bundle"
    (bundle / "vllm-exl3-bundle.part01").unlink()
    damaged = bundle / "vllm-exl3-bundle.part02"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    target = tmp_path / "site"
    r = _install(bundle, target)
    assert r.returncode == 1
    assert "2 of" in r.stderr
    assert "vllm-exl3-bundle.part01: missing" in r.stderr
    assert "vllm-exl3-bundle.part02: sha256 differs" in r.stderr
    assert not target.exists()


def test_install_refuses_another_python(tmp_path):
    assert run_tool("bundle", "--wheel", _mini_build(tmp_path), "--out", tmp_path / "bundle",
                    "--python-version", "3.99", "--without-deps").returncode == 0
    r = _install(tmp_path / "bundle", tmp_path / "site")
    assert r.returncode == 1 and "for Python 3.99" in r.stderr


def test_bundle_refuses_a_wheel_without_serving_pieces(tmp_path):
    wheel = make_wheel(tmp_path / "w", {"vllm/__init__.py": ""},
                       version=f"{pins.VLLM_VERSION}+exl3.x")
    r = _bundle(tmp_path, wheel, "--without-deps")
    assert r.returncode == 1
    assert "lacks vllm/_C_stable_libtorch.abi3.so" in r.stderr


@pytest.mark.slow
def test_real_quick_build_bundle_installs_and_imports(tmp_path):
    """Quick build (no kernels) of the real release wheel -> bundle for this Python -> install.sh
    into an empty directory -> `import vllm` from there (with the venv's torch) finds our
    quantization method."""
    build = run_tool("build", "--no-kernels", "--dist-dir", tmp_path / "dist", "--work-dir",
                     tmp_path / "work")
    if build.returncode != 0 and ("unreachable" in build.stderr or "offline" in build.stderr):
        pytest.skip(f"release wheel not cached and the index is unreachable: {build.stderr}")
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    bundle = run_tool("bundle", "--wheel", wheel, "--out", tmp_path / "bundle",
                      "--python-version", PYVER)
    if bundle.returncode != 0 and "pip download failed" in bundle.stderr:
        pytest.skip(f"dependency wheels not downloadable here: {bundle.stderr[-500:]}")
    assert bundle.returncode == 0, bundle.stderr
    parts = sorted((tmp_path / "bundle").glob("vllm-exl3-bundle.part*"))
    assert parts and max(p.stat().st_size for p in parts) <= 60_000_000
    with zipfile.ZipFile(wheel) as zf:
        assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in zf.namelist()
    target = tmp_path / "site"
    inst = _install(tmp_path / "bundle", target)
    assert inst.returncode == 0, inst.stdout[-2000:] + inst.stderr[-2000:]
    assert not (target / "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so").exists()
    probe = subprocess.run(
        [sys.executable, "-c",
         "import vllm, pydantic\n"
         "from vllm.model_executor.layers.quantization import get_quantization_config\n"
         "import vllm.envs as envs\n"
         "print(vllm.__file__, pydantic.__file__, get_quantization_config('exl3').__name__, "
         "envs.VLLM_EXL3_FORCE_REFERENCE)"],
        capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(target), "VLLM_USE_FLASHINFER_SAMPLER": "0"},
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    vllm_file, pydantic_file, config, force = probe.stdout.split()[-4:]
    assert vllm_file == str(target / "vllm/__init__.py")
    assert pydantic_file.startswith(str(target))  # dependencies come from the bundle
    assert (config, force) == ("Exl3Config", "False")
