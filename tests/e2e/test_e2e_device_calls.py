# SPDX-License-Identifier: Apache-2.0
"""The device-call plan (scripts/e2e/device_calls.py): sizes per call, and the staging commands
run for real against a miniature bundle made by `vllm-exl3 bundle`'s own code: parts copied into
the host directory call by call, checked, installed by install.sh, the e2e script started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "e2e"))
sys.path.insert(0, str(REPO / "scripts"))

import device_calls as dc  # noqa: E402
from vllm_exl3.bundle import make_bundle  # noqa: E402
from vllm_exl3.wheelfile import WheelName, write  # noqa: E402

PYVER = f"{sys.version_info[0]}.{sys.version_info[1]}"
PART = 6000  # bytes: the miniature payload needs several parts


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_tree_bytes_counts_tracked_and_untracked_but_not_ignored(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("/big/\n")
    (tmp_path / "tracked").write_bytes(b"x" * 100)
    _git(tmp_path, "add", ".gitignore", "tracked")
    (tmp_path / "untracked").write_bytes(b"y" * 30)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "blob").write_bytes(b"z" * 5000)
    assert dc.tree_bytes(tmp_path) == 100 + 30 + len("/big/\n")


def test_part_budget(monkeypatch):
    tree = 20 * 2**20
    # Every part leaves room for the x2 sequence's extra carry (ExLlamaV3's wheels), which rides
    # on the last staging call: with a 62 MiB last call the plan was refused at layout time.
    monkeypatch.setattr(dc, "x2_extra_bytes", lambda: 8 * 2**20)
    assert dc.part_budget(tree, 2**20) == (dc.CALL_LIMIT - tree - 2**20 - dc.INSTALLER_ALLOWANCE
                                           - 8 * 2**20)
    with pytest.raises(SystemExit, match="leaves no room"):
        dc.part_budget(dc.CALL_LIMIT - 2**19, 0)


def _mini_wheel(tmp_path: Path) -> Path:
    """A stand-in for the quick build: what bundle's trimming requires, plus a module that says
    where it was imported from."""
    tree = tmp_path / "wheel-tree"
    name = WheelName.parse("vllm-0.26.0+exl3.test-cp38-abi3-manylinux_2_28_x86_64.whl")
    files = {
        "vllm/__init__.py": "__version__ = '0.26.0+exl3.test'\n",
        "vllm/_C_stable_libtorch.abi3.so": os.urandom(20000),  # incompressible: several parts
        "vllm/_exl3_C.abi3.so": b"exl3",
        "vllm/third_party/__init__.py": "",
        "vllm/third_party/pynvml.py": "",
        "vllm/vllm_flash_attn/__init__.py": "",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
        f"{name.dist_info}/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: "
                                      "0.26.0+exl3.test\n",
        f"{name.dist_info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
                                   "Tag: cp38-abi3-manylinux_2_28_x86_64\n",
    }
    for rel, data in files.items():
        p = tree / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
    out = tmp_path / name.filename
    write(tree, name, out)
    return out


@pytest.fixture
def staged(tmp_path, monkeypatch):
    """A miniature bundle laid out into calls inside a fake checkout at tmp_path/repo."""
    repo = tmp_path / "repo"
    bundle = tmp_path / "bundle"
    make_bundle(_mini_wheel(tmp_path), bundle, PART, PYVER, with_moe=False, deps=[])
    monkeypatch.setattr(dc, "XFER", repo / ".e2e" / "xfer")
    monkeypatch.setattr(dc, "tree_bytes", lambda root=None: 20 * 2**20)
    monkeypatch.setattr(dc, "HOST_DIR", str(tmp_path / "host"))
    return repo, bundle, dc.layout(bundle, margin=2**20)


def test_layout_one_part_per_call(staged):
    repo, bundle, plan = staged
    parts = sorted(p.name for p in bundle.glob(dc.PART_STEM + "*"))
    assert len(parts) >= 3
    stage_calls = [c for c in plan["calls"] if c["carry"]]
    assert [c["carry"] for c in stage_calls] == [[f".e2e/xfer/c{i}"]
                                                 for i in range(1, len(parts) + 1)]
    assert sorted(p.name for p in (repo / ".e2e/xfer/c1").iterdir()) == sorted(
        [parts[0], "install.sh"])
    for c in plan["calls"]:
        assert len(c["command"]) <= dc.COMMAND_LIMIT
        assert c["bytes"] <= dc.CALL_LIMIT
        r = subprocess.run(["bash", "-n", "-c", c["command"]], capture_output=True, text=True)
        assert r.returncode == 0, (c["call"], r.stderr)
    assert "throughput.py --write-only" in stage_calls[0]["command"]
    assert "install.sh" in stage_calls[-1]["command"]
    assert "run_fixture_e2e.py" in stage_calls[-1]["command"]
    assert "throughput.py --budget-s" in plan["calls"][-1]["command"]
    # x2: the same staging, the wheels ride with the last part, then the three session phases.
    x2 = plan["x2_calls"]
    assert [c["command"] for c in x2[:len(parts) - 1]] == [
        c["command"] for c in stage_calls[:-1]]
    assert x2[len(parts) - 1]["carry"] == [f".e2e/xfer/c{len(parts)}", ".whl"]
    assert "install.sh" in x2[len(parts) - 1]["command"]
    assert [c["command"].rsplit(" ", 1)[-1] for c in x2[len(parts) - 1:]] == [
        "tp1", "tp2", "final"]
    for c in x2:
        assert len(c["command"]) <= dc.COMMAND_LIMIT
        r = subprocess.run(["bash", "-n", "-c", c["command"]], capture_output=True, text=True)
        assert r.returncode == 0, (c["call"], r.stderr)


def test_layout_refuses_a_damaged_part_and_an_oversized_call(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    make_bundle(_mini_wheel(tmp_path), bundle, PART, PYVER, with_moe=False, deps=[])
    monkeypatch.setattr(dc, "XFER", tmp_path / "xfer")
    monkeypatch.setattr(dc, "tree_bytes", lambda root=None: dc.CALL_LIMIT - 100)
    with pytest.raises(SystemExit, match="exceeds"):
        dc.layout(bundle, margin=0)
    part = sorted(bundle.glob(dc.PART_STEM + "*"))[1]
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    with pytest.raises(SystemExit, match="sha256 differs"):
        dc.layout(bundle, margin=0)


def test_the_calls_stage_install_and_start_the_e2e(staged, tmp_path):
    """Run every staging call's command in order, as the GPU host would (python3 = this Python,
    the e2e script a stand-in that proves the installed package and the environment)."""
    repo, bundle, plan = staged
    (repo / "scripts" / "e2e").mkdir(parents=True)
    (repo / "scripts" / "e2e" / "run_fixture_e2e.py").write_text(
        "import os, sys, vllm\n"
        "print('E2E', vllm.__version__, vllm.__file__, os.environ['VLLM_USE_FLASHINFER_SAMPLER'],"
        " ' '.join(sys.argv[1:]))\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(out)}
    env.pop("PYTHONPATH", None)
    stage_calls = [c for c in plan["calls"] if c["carry"]]
    for c in stage_calls:
        r = subprocess.run(["bash", "-c", c["command"]], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, (c["call"], r.stdout, r.stderr)
        assert ": OK" in r.stdout  # sha256sum -c of the part that came with this call
    host = Path(dc.HOST_DIR)
    assert "E2E 0.26.0+exl3.test" in r.stdout
    assert f"{host}/site/vllm/__init__.py" in r.stdout
    assert " 0 --budget-s" in r.stdout  # flashinfer sampler off, the budget passed on
    assert (host / "synth.log").exists()  # the background writer was started (and failed here)
