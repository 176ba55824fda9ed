# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fixture files are the ones tests/fixtures/README.md records: each digest listed
there matches its file, so a corrupted or replaced fixture fails here by name instead of
skewing the tests that read it."""

from __future__ import annotations

import hashlib
import re

import pytest
from vllm_exl3.testing.fixtures import FIXTURES

# README lines "    <sha256>  <path under tests/fixtures>".
DIGEST_LINE = re.compile(r"^\s+([0-9a-f]{64})  (\S+)$", re.M)
LISTED = DIGEST_LINE.findall((FIXTURES / "README.md").read_text(encoding="utf-8"))


def test_the_readme_lists_the_model_files():
    paths = {path for _, path in LISTED}
    assert len(LISTED) >= 10 and any(p.endswith("model.safetensors") for p in paths)


@pytest.mark.parametrize(("digest", "path"), LISTED, ids=[p for _, p in LISTED])
def test_fixture_file_matches_its_recorded_digest(digest, path):
    data = (FIXTURES / path).read_bytes()
    assert hashlib.sha256(data).hexdigest() == digest, f"tests/fixtures/{path}"
