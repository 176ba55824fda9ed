# SPDX-License-Identifier: Apache-2.0
"""`fetch` without the network: a cold cache offline, an unreachable index, a corrupt cached
file, and a local (file://) index serving a file whose hash is not the pinned one."""

from __future__ import annotations

import hashlib
from pathlib import Path

from minitree import run_tool
from vllm_exl3 import pins

# An index nobody listens on (port 9, "discard", is closed on ordinary machines).
UNREACHABLE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": ""}


def test_offline_cold_cache_says_so(tmp_path):
    r = run_tool("fetch", "--offline", "--cache-dir", tmp_path / "cache")
    assert r.returncode == 1
    assert "offline (--offline)" in r.stderr
    assert f"the cache has no copy of {pins.SDIST_NAME}" in r.stderr
    assert pins.SDIST_SHA256 in r.stderr
    assert "Traceback" not in r.stderr


def test_unreachable_index_cold_cache_says_so(tmp_path):
    r = run_tool("fetch", "--cache-dir", tmp_path / "cache", env=UNREACHABLE)
    assert r.returncode == 1
    assert "offline: the package index is unreachable" in r.stderr
    assert "127.0.0.1:9" in r.stderr
    assert f"the cache has no copy of {pins.SDIST_NAME}" in r.stderr
    assert not list((tmp_path / "cache").rglob("*.part"))


def test_corrupt_cached_sdist_is_not_used(tmp_path):
    sdist = tmp_path / "cache/sdist" / pins.SDIST_NAME
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(b"not the release")
    r = run_tool("fetch", "--offline", "--cache-dir", tmp_path / "cache")
    assert r.returncode == 1 and "corrupt (sha256 mismatch)" in r.stderr


def _local_index(root: Path, payload: bytes, with_hash: bool) -> str:
    files = root / "files"
    files.mkdir(parents=True)
    (files / pins.SDIST_NAME).write_bytes(payload)
    frag = f"#sha256={hashlib.sha256(payload).hexdigest()}" if with_hash else ""
    page = root / "simple/vllm/index.html"
    page.parent.mkdir(parents=True)
    page.write_text(f'<html><body><a href="../../files/{pins.SDIST_NAME}{frag}">'
                    f"{pins.SDIST_NAME}</a></body></html>")
    return (root / "simple").as_uri()


def test_index_hash_differing_from_pin_is_refused(tmp_path):
    url = _local_index(tmp_path / "index", b"an impostor", with_hash=True)
    r = run_tool("fetch", "--cache-dir", tmp_path / "cache",
                 env={"PIP_INDEX_URL": url, "PIP_EXTRA_INDEX_URL": ""})
    assert r.returncode == 1
    assert "but this repository pins" in r.stderr


def test_download_differing_from_pin_is_discarded(tmp_path):
    url = _local_index(tmp_path / "index", b"an impostor without a published hash",
                       with_hash=False)
    r = run_tool("fetch", "--cache-dir", tmp_path / "cache",
                 env={"PIP_INDEX_URL": url, "PIP_EXTRA_INDEX_URL": ""})
    assert r.returncode == 1
    assert f"expected {pins.SDIST_SHA256}; the download was discarded" in r.stderr
    assert not (tmp_path / "cache/sdist" / pins.SDIST_NAME).exists()
    assert not list((tmp_path / "cache").rglob("*.part"))
