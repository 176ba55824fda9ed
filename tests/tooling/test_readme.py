# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The user-facing documents: the README stays a short user's page, names only files
that exist, and documents exactly the settings vLLM's envs.py declares; no document
names a session or a device call."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_LIMIT = 5000  # characters: a page a user reads before installing
DOCS = [
    README,
    ROOT / "scripts" / "README.md",
    ROOT / "scripts" / "bench" / "README.md",
    ROOT / "scripts" / "e2e" / "README.md",
    ROOT / "overlay" / "docs" / "features" / "quantization" / "exl3.md",
    ROOT / "overlay" / "docs" / "design" / "exl3_format.md",
]
# A repository path in backticks: starts at a top-level folder of the tree.
PATH_RE = re.compile(r"`((?:ci|csrc|docker|overlay|patches|scripts|tests)/[^`\s*<>]+)`")


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8"))
    assert n <= README_LIMIT, f"README.md has {n} characters (limit {README_LIMIT})"


# The overlay's pages live in the vLLM tree, and the paths they name are that tree's.
REPO_DOCS = [d for d in DOCS if "overlay" not in d.parts]


@pytest.mark.parametrize("doc", REPO_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_name_existing_files_only(doc):
    text = doc.read_text(encoding="utf-8")
    missing = [
        p for p in PATH_RE.findall(text) if not (ROOT / p.rstrip("/.,")).exists()
    ]
    assert not missing, f"{doc.name} names files that are not in the tree: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_name_no_session_or_call(doc):
    text = doc.read_text(encoding="utf-8")
    found = re.findall(r"(?i)\bsession\w*|\bcall ?\d+|\bcalls \d", text)
    assert not found, f"{doc.name}: {found}"


def test_readme_settings_are_the_declared_ones():
    """The settings table lists every VLLM_EXL3_* variable the envs patch declares,
    and no other."""
    table = set(
        re.findall(
            r"^\| `(VLLM_EXL3_\w+)` \|", README.read_text(encoding="utf-8"), re.M
        )
    )
    patch = next((ROOT / "patches").glob("*envs*.patch")).read_text(encoding="utf-8")
    declared = set(re.findall(r'^\+\s+"(VLLM_EXL3_\w+)":', patch, re.M))
    assert declared, "no VLLM_EXL3_* declaration found in the envs patch"
    assert table == declared, {
        "undocumented": sorted(declared - table),
        "not declared": sorted(table - declared),
    }
