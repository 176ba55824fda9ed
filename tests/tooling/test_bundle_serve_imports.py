# SPDX-License-Identifier: Apache-2.0
"""The offline bundle's dependency list must carry everything `vllm serve` imports that the GPU
host lacks. The H200 run of 2026-11-30 found `model_hosting_container_standards` missing only
when the server started; this test imports the same entry points here, on top of exactly the
pinned list (installed --no-deps, as install.sh does) and the packages the host's image has
but this test environment may not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "scripts" / "vllm_exl3" / "bundle_requirements.txt"
# In the GPU host's image (device KINDS.md package list) and imported by vLLM's server, but not
# part of this project's CI environment.
HOST_IMAGE_PACKAGES = ("tiktoken", "httpx", "aiohttp", "pillow", "uvloop", "psutil")
ENTRY_POINTS = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.serve")


def _pip_target(target: Path, *args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--target", str(target), *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"pip could not fetch the packages (offline?): {r.stderr.strip()[-300:]}")


@pytest.mark.slow
def test_serve_entry_points_import_with_the_bundle_closure(tmp_path):
    pytest.importorskip("vllm")
    bundle, host = tmp_path / "bundle", tmp_path / "host"
    _pip_target(bundle, "--no-deps", "-r", str(REQUIREMENTS))
    _pip_target(host, "--no-deps", *HOST_IMAGE_PACKAGES)
    # tiktoken's own dependency; in the host image too.
    _pip_target(host, "--no-deps", "requests", "regex", "idna", "certifi", "charset_normalizer",
                "urllib3", "anyio", "h11", "httpcore", "sniffio")
    code = "; ".join(f"import {m}" for m in ENTRY_POINTS) + "; print('SERVE-IMPORTS-OK')"
    env = {**os.environ, "PYTHONPATH": f"{bundle}{os.pathsep}{host}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    missing = [ln for ln in r.stderr.splitlines() if "No module named" in ln]
    assert "SERVE-IMPORTS-OK" in r.stdout, (
        f"vllm serve's entry points do not import with bundle_requirements.txt: "
        f"{missing[-1] if missing else r.stderr[-1500:]}")
