# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Wheel archives (PEP 427): unpack one to a tree, and write a tree back as a wheel with
a fresh RECORD, optionally under a new version and with only some of its files."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import stat
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import ToolError
from .fetch import Progress

_CHUNK = 1 << 20
# Fixed timestamp for every member (the earliest a zip can hold), so identical trees
# give identical wheels.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class WheelName:
    name: str
    version: str
    tag: str  # python-abi-platform, e.g. cp38-abi3-manylinux_2_28_x86_64

    @classmethod
    def parse(cls, filename: str) -> WheelName:
        parts = filename.removesuffix(".whl").split("-")
        if not filename.endswith(".whl") or len(parts) not in (5, 6):
            raise ToolError(f"{filename} is not a wheel file name")
        return cls(parts[0], parts[1], "-".join(parts[-3:]))

    @property
    def filename(self) -> str:
        return f"{self.name}-{self.version}-{self.tag}.whl"

    @property
    def dist_info(self) -> str:
        return f"{self.name}-{self.version}.dist-info"


def unpack(
    wheel: Path, dest: Path, keep: Callable[[str], bool] = lambda _p: True
) -> None:
    """Extract the members `keep` accepts, keeping the executable bits recorded in the
    archive."""
    with zipfile.ZipFile(wheel) as zf:
        infos = [i for i in zf.infolist() if keep(i.filename)]
        prog = Progress(f"unpacking {wheel.name}", sum(i.file_size for i in infos))
        for info in infos:
            if info.filename.startswith("/") or ".." in Path(info.filename).parts:
                raise ToolError(
                    f"{wheel}: refusing member {info.filename!r} (outside the tree)"
                )
            target = dest / info.filename
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    prog.advance(len(chunk))
            if (info.external_attr >> 16) & 0o111:
                os.chmod(target, 0o755)
        prog.finish()


def set_version(tree: Path, old: WheelName, version: str) -> WheelName:
    """Rename the dist-info directory and rewrite METADATA's Version for `version`."""
    new = WheelName(old.name, version, old.tag)
    src = tree / old.dist_info
    if not (src / "METADATA").is_file():
        raise ToolError(f"{src} has no METADATA; not an unpacked {old.filename}")
    meta = (src / "METADATA").read_text(encoding="utf-8")
    meta, n = re.subn(r"(?m)^Version: .*$", f"Version: {version}", meta, count=1)
    if n != 1:
        raise ToolError(f"{src}/METADATA has no Version field")
    (src / "METADATA").write_text(meta, encoding="utf-8")
    src.rename(tree / new.dist_info)
    return new


def _record_hash(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    return f"sha256={digest}", path.stat().st_size


def write(
    tree: Path,
    name: WheelName,
    out: Path,
    keep: Callable[[str], bool] = lambda _p: True,
) -> list[str]:
    """Zip `tree` as wheel `name` into `out` (a file path), members filtered by `keep`,
    with a regenerated RECORD; the dist-info directory goes last, RECORD last of all.
    Returns the member paths written."""
    record_path = f"{name.dist_info}/RECORD"
    files = sorted(
        p.relative_to(tree).as_posix()
        for p in tree.rglob("*")
        if p.is_file() and not p.is_symlink()
    )
    files = [f for f in files if f != record_path and keep(f)]
    if not any(f.startswith(name.dist_info + "/") for f in files):
        raise ToolError(
            f"{tree} has no {name.dist_info}/; cannot write {name.filename}"
        )
    files.sort(key=lambda f: (f.startswith(name.dist_info + "/"), f))
    record = io.StringIO()
    rows = csv.writer(record, lineterminator="\n")
    prog = Progress(
        f"writing {out.name}", sum((tree / f).stat().st_size for f in files)
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for f in files:
            path = tree / f
            h, size = _record_hash(path)
            rows.writerow([f, h, size])
            info = zipfile.ZipInfo(f, _ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.file_size = size  # lets zipfile decide on zip64 itself
            mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            with open(path, "rb") as src, zf.open(info, "w") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
            prog.advance(size)
        rows.writerow([record_path, "", ""])
        info = zipfile.ZipInfo(record_path, _ZIP_EPOCH)
        info.external_attr = (stat.S_IFREG | 0o644) << 16
        zf.writestr(info, record.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    prog.finish()
    tmp.replace(out)
    return files + [record_path]
