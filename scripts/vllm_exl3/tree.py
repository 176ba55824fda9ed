# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Recognising a vLLM tree to apply onto: an unpacked sdist (or a git checkout made from
one) or an installed wheel (a site-packages directory, or an unpacked wheel)."""

from __future__ import annotations

import email.parser
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from . import pins

Kind = Literal["sdist", "wheel"]

# The local-version label our builds carry (`0.26.0+exl3.<commit>`); such a tree
# already holds a series baked in, so applying onto it is refused.
BUILD_LABEL_PREFIX = "exl3"


def _metadata(path: Path) -> dict[str, str]:
    msg = email.parser.Parser().parsestr(
        path.read_text(encoding="utf-8", errors="replace"), headersonly=True
    )
    return {k: str(v) for k, v in msg.items()}


@dataclass
class TargetTree:
    root: Path
    kind: Kind
    version: str | None
    version_source: str | None
    problems: list[str] = field(default_factory=list)

    @property
    def describe(self) -> str:
        return (
            f"{self.root} ({self.kind} tree, vLLM {self.version or 'unknown version'})"
        )


def identify(root: Path) -> TargetTree:
    """What kind of vLLM tree `root` is and which version; every reason it is not a vLLM
    {pins.VLLM_VERSION} tree goes into `problems` (the caller reports them all)."""
    root = root.resolve()
    problems: list[str] = []
    if not (root / "vllm").is_dir():
        problems.append(f"{root} has no vllm/ package directory")
    version = source = None
    if (root / "PKG-INFO").is_file():
        kind: Kind = "sdist"
        meta = _metadata(root / "PKG-INFO")
        version, source = meta.get("Version"), "PKG-INFO"
        if meta.get("Name", "").lower() != "vllm":
            problems.append(f"PKG-INFO names project {meta.get('Name')!r}, not vllm")
        for needed in ("CMakeLists.txt", "csrc/libtorch_stable"):
            if not (root / needed).exists():
                problems.append(
                    f"sdist tree lacks {needed} (not a vLLM 0.26 source layout)"
                )
    else:
        infos = sorted(root.glob("vllm-*.dist-info"))
        kind = "wheel" if infos or not (root / "CMakeLists.txt").exists() else "sdist"
        if len(infos) > 1:
            problems.append(
                "several vLLM installations' metadata: "
                + ", ".join(p.name for p in infos)
            )
        elif infos and (infos[0] / "METADATA").is_file():
            version = _metadata(infos[0] / "METADATA").get("Version")
            source = f"{infos[0].name}/METADATA"
        elif infos:
            problems.append(f"{infos[0].name} has no METADATA")
        else:
            problems.append(
                "cannot tell the vLLM version: no PKG-INFO (sdist) and no "
                "vllm-*.dist-info "
                "(installed wheel)"
            )
    if version is not None:
        public, _, local = version.partition("+")
        if public != pins.VLLM_VERSION:
            problems.append(
                f"the tree is vLLM {version} ({source}); this series is for vLLM "
                f"{pins.VLLM_VERSION}"
            )
        elif local.startswith(BUILD_LABEL_PREFIX):
            problems.append(
                f"the tree is a vllm-exl3 build ({version}, {source}) that already "
                "contains a "
                f"series; install the official vLLM {pins.VLLM_VERSION} to apply onto"
            )
    return TargetTree(root, kind, version, source, problems)


def in_scope(kind: Kind, dest: str) -> bool:
    """Whether a file at tree path `dest` exists in this kind of tree. An installed
    wheel holds only the Python package: no CMake files, no csrc/, no tests/."""
    return kind == "sdist" or dest.startswith("vllm/")
