# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`fetch`: the pinned vLLM source distribution, downloaded once into the cache,
sha256-checked and unpacked. Also the cache access `build` uses for the pinned release
wheel, the package-index client the downloads go through, and the progress lines of
long steps (downloads, unpacking, zipping)."""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import os
import re
import shutil
import ssl
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import ToolError
from .repo import (
    SDIST_NAME,
    SDIST_SHA256,
    SDISTS,
    VLLM_VERSION,
    default_cache_dir,
    sdist_name,
)

# Written into an unpacked tree last; a tree without it is an interrupted unpack and is
# redone.
_UNPACKED_MARKER = ".vllm-exl3-unpacked"
_SAFE_EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def wheels_dir(cache: Path) -> Path:
    """Shared with ci/setup-env.sh (same default, same override), so the ~300 MB release
    wheel is downloaded once for both."""
    env = os.environ.get("VLLM_EXL3_WHEELS")
    return Path(env).expanduser() if env else cache / "wheels"


def ensure_pinned(
    filename: str, sha256: str, dest_dir: Path, offline: bool, project: str = "vllm"
) -> Path:
    """The pinned file (of the index's `project`) from the cache, downloading it when
    absent. A cached copy whose hash differs is discarded and fetched again."""
    path = dest_dir / filename
    if path.is_file():
        if sha256_file(path) == sha256:
            return path
        print(
            f"fetch: cached {path} does not match its pinned sha256; fetching it again"
        )
        if offline:
            raise ToolError(
                f"{path} is corrupt (sha256 mismatch) and --offline forbids fetching "
                "it again"
            )
    cold = (
        f"the cache has no copy of {filename} ({dest_dir}). Connect to the package "
        "index, or "
        f"place the file there by hand (sha256 {sha256})"
    )
    if offline:
        raise ToolError(f"offline (--offline) and {cold}")
    try:
        link = find_file(project, filename)
        print(f"fetch: {filename} from {link.index}")
        download(link, path, sha256)
    except IndexUnreachable as e:
        raise ToolError(
            f"offline: the package index is unreachable ({e}), and {cold}"
        ) from e
    return path


def _unpack(archive: Path, dest: Path, sha256: str) -> None:
    tmp = dest.with_name(dest.name + ".unpacking")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        prog = Progress(f"unpacking {archive.name}", len(members), unit="files")
        for m in members:
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise ToolError(
                    f"{archive}: refusing member {m.name!r} (outside the tree)"
                )
            # Where available, the "data" filter also rejects links out of the tree and
            # devices.
            tar.extract(m, tmp, **_SAFE_EXTRACT)
            prog.advance(1)
        prog.finish()
    (top,) = [p for p in tmp.iterdir()]  # an sdist holds exactly one top directory
    shutil.rmtree(dest, ignore_errors=True)
    top.rename(dest)
    tmp.rmdir()
    (dest / _UNPACKED_MARKER).write_text(sha256 + "\n")


def ensure_sdist_tree(
    cache: Path, offline: bool = False, version: str = VLLM_VERSION
) -> Path:
    """The unpacked pristine sdist of a pinned vLLM `version` (SDISTS; default the
    series' own). Shared: never modify it; copy it first."""
    if version not in SDISTS:
        raise ToolError(
            f"vLLM {version} has no pinned sdist (pinned: {', '.join(SDISTS)}); add "
            "its sha256 to SDISTS in scripts/vllm_exl3/repo.py"
        )
    sha256 = SDISTS[version]
    tree = cache / "src" / f"vllm-{version}"
    marker = tree / _UNPACKED_MARKER
    if marker.is_file() and marker.read_text().strip() == sha256:
        return tree
    archive = ensure_pinned(sdist_name(version), sha256, cache / "sdist", offline)
    _unpack(archive, tree, sha256)
    return tree


def pristine_files(tree: Path) -> list[str]:
    """Files of an unpacked sdist as shipped (our unpack marker excluded)."""
    return sorted(
        p.relative_to(tree).as_posix()
        for p in tree.rglob("*")
        if p.is_file() and p.name != _UNPACKED_MARKER
    )


def copy_sdist_tree(src: Path, dest: Path) -> None:
    """A working copy of the pristine tree without our unpack marker."""
    shutil.copytree(
        src, dest, symlinks=True, ignore=shutil.ignore_patterns(_UNPACKED_MARKER)
    )


def run(args: argparse.Namespace) -> int:
    tree = ensure_sdist_tree(args.cache_dir, offline=args.offline, version=args.version)
    print(tree)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fetch",
        help=f"download, verify and unpack the vLLM {VLLM_VERSION} sdist",
        description=(
            f"Download {SDIST_NAME} from pip's configured package index into the "
            "cache, "
            f"verify its pinned sha256 ({SDIST_SHA256[:16]}...) and unpack it. "
            "Prints the "
            "unpacked tree's path. With a warm cache no network is used."
        ),
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="cache directory (default: $VLLM_EXL3_CACHE or ~/.cache/vllm-exl3)",
    )
    p.add_argument("--offline", action="store_true", help="never touch the network")
    p.add_argument(
        "--version",
        default=VLLM_VERSION,
        choices=sorted(SDISTS),
        help=f"which pinned vLLM release (default {VLLM_VERSION}, the series' own; "
        "the upstream series is ported to the newer one)",
    )
    p.set_defaults(func=run)


# Client for pip's configured package index (the "simple" repository API).
#
# The index is whatever pip would use: PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, pip's
# configuration files, else pip's own default (`pip._internal.models.index.PyPI`), so no
# hostname is written here. Project pages are asked for as PEP 691 JSON; an index that
# answers with the PEP 503 HTML page (e.g. a `file://` mirror) is read too. Downloads go
# to a `.part` file and are renamed only after their sha256 matches the pin.

_ACCEPT = (
    "application/vnd.pypi.simple.v1+json, "
    "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
)
# Seconds to wait for an index or file server before calling it unreachable.
_TIMEOUT_S = 60
_CHUNK = 1 << 20


class IndexUnreachable(ToolError):
    """No configured index answered (offline, DNS failure, refused connection...)."""


@dataclass(frozen=True)
class FileLink:
    url: str
    sha256: str | None
    index: str


def _pip_setting(name: str) -> str | None:
    """A pip option as `pip download` would see it: environment, then the download
    section, then the global section of pip's configuration files."""
    env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
    if env is not None:
        return env
    try:
        from pip._internal.configuration import Configuration

        conf = Configuration(isolated=False)
        conf.load()
        values = dict(conf.items())
    except Exception:  # pip missing or its internals changed: fall back to defaults
        return None
    for section in (":env:", "download", "global"):
        if f"{section}.{name}" in values:
            return values[f"{section}.{name}"]
    return None


def configured_indexes() -> list[str]:
    """The index URL pip would use first, then its extra index URLs."""
    primary = _pip_setting("index-url")
    if primary is None:
        try:
            from pip._internal.models.index import PyPI

            primary = PyPI.simple_url
        except ImportError as e:
            raise ToolError(
                "no package index configured: set PIP_INDEX_URL (pip is not importable "
                "here, so "
                f"its default index is unknown: {e})"
            ) from e
    extra = (_pip_setting("extra-index-url") or "").split()
    return [primary, *extra]


def _ssl_context() -> ssl.SSLContext:
    cert = _pip_setting("cert")
    return (
        ssl.create_default_context(cafile=cert)
        if cert
        else ssl.create_default_context()
    )


def _open(url: str, accept: str | None = None):
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    return urllib.request.urlopen(req, timeout=_TIMEOUT_S, context=_ssl_context())


class _AnchorParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (text, href)
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def _project_files(index: str, project: str) -> list[tuple[str, str, str | None]]:
    """(filename, absolute url, sha256 or None) for every file on the project's page."""
    page = index.rstrip("/") + f"/{project}/"
    if page.startswith("file:"):
        page += "index.html"
    with _open(page, _ACCEPT) as resp:
        ctype = resp.headers.get("Content-Type", "")
        body = resp.read()
        base = resp.geturl()
    if "json" in ctype:
        data = json.loads(body)
        return [
            (
                f["filename"],
                urllib.parse.urljoin(base, f["url"]),
                f.get("hashes", {}).get("sha256"),
            )
            for f in data.get("files", [])
        ]
    parser = _AnchorParser()
    parser.feed(body.decode("utf-8", "replace"))
    out = []
    for text, href in parser.links:
        url, _, frag = urllib.parse.urljoin(base, href).partition("#")
        m = re.fullmatch(r"sha256=([0-9a-f]{64})", frag)
        out.append((text or url.rsplit("/", 1)[-1], url, m.group(1) if m else None))
    return out


def find_file(project: str, filename: str) -> FileLink:
    """Locate `filename` on the configured indexes (primary first)."""
    errors: list[str] = []
    reached: list[str] = []
    for index in configured_indexes():
        try:
            files = _project_files(index, project)
        except urllib.error.HTTPError as e:
            if (
                e.code == 404
            ):  # reachable, project not there (typical for a local extra index)
                reached.append(index)
                continue
            errors.append(f"{index}: HTTP {e.code} {e.reason}")
            continue
        except (urllib.error.URLError, OSError, ValueError) as e:
            local = urllib.parse.urlparse(index).scheme == "file"
            if isinstance(e, urllib.error.URLError) and local:
                reached.append(index)  # a local mirror without this project
                continue
            errors.append(f"{index}: {getattr(e, 'reason', e)}")
            continue
        reached.append(index)
        for name, url, sha in files:
            if name == filename:
                return FileLink(url, sha, index)
    if errors and not any(urllib.parse.urlparse(i).scheme != "file" for i in reached):
        raise IndexUnreachable("; ".join(errors))
    raise ToolError(
        f"{filename} is not listed by the configured package index(es): "
        f"{', '.join(reached)}"
    )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def download(link: FileLink, dest: Path, sha256: str) -> None:
    """Download to `dest` (via `dest.part`), refusing content whose sha256 differs from
    the pin."""
    if link.sha256 and link.sha256 != sha256:
        raise ToolError(
            f"the index lists {dest.name} with sha256 {link.sha256}, but this "
            "repository pins "
            f"{sha256}; refusing (wrong index or a re-uploaded file)"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    try:
        with _open(link.url) as resp, open(part, "wb") as out:
            size = int(resp.headers.get("Content-Length") or 0)
            prog = Progress(f"downloading {dest.name}", size)
            while chunk := resp.read(_CHUNK):
                out.write(chunk)
                h.update(chunk)
                prog.advance(len(chunk))
            prog.finish()
    except (urllib.error.URLError, OSError) as e:
        part.unlink(missing_ok=True)
        raise IndexUnreachable(
            f"downloading {link.url}: {getattr(e, 'reason', e)}"
        ) from e
    if h.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise ToolError(
            f"{dest.name} from {link.url} has sha256 {h.hexdigest()}, expected "
            f"{sha256}; "
            "the download was discarded"
        )
    part.replace(dest)


# Progress lines for long steps (downloads, unpacking, zipping) on stderr. On a terminal
# one line is redrawn; otherwise (CI logs) a line is printed every PROGRESS_LOG_STEP of
# the work.

# Fraction of the work between two printed lines when stderr is not a terminal: 10
# lines per step keeps CI logs short but shows a stuck step.
PROGRESS_LOG_STEP = 0.1
# Redraw at most this often on a terminal (seconds).
_REDRAW_S = 0.2


class Progress:
    def __init__(
        self, label: str, total: int, unit: str = "MB", scale: float = 1e6
    ) -> None:
        self.label, self.total, self.unit, self.scale = (
            label,
            max(total, 1),
            unit,
            scale,
        )
        self.done = 0
        self._tty = sys.stderr.isatty()
        self._next_log = PROGRESS_LOG_STEP
        self._last_draw = 0.0
        self._t0 = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        frac = self.done / self.total
        if self._tty:
            now = time.monotonic()
            if now - self._last_draw >= _REDRAW_S or self.done >= self.total:
                self._last_draw = now
                sys.stderr.write(f"\r{self._line()}")
                sys.stderr.flush()
        elif frac >= self._next_log:
            while self._next_log <= frac:
                self._next_log += PROGRESS_LOG_STEP
            print(self._line(), file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self._tty:
            sys.stderr.write(
                f"\r{self._line()}  ({time.monotonic() - self._t0:.0f}s)\n"
            )
            sys.stderr.flush()

    def _line(self) -> str:
        pct = 100.0 * min(self.done / self.total, 1.0)
        if self.unit == "MB":
            amount = (
                f"{self.done / self.scale:.1f}/{self.total / self.scale:.1f} "
                f"{self.unit}"
            )
        else:
            amount = f"{self.done}/{self.total} {self.unit}"
        return f"  {self.label}: {amount} ({pct:3.0f}%)"
