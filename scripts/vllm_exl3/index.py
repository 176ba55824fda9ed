# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Client for pip's configured package index (the "simple" repository API).

The index is whatever pip would use: PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, pip's
configuration files, else pip's own default (`pip._internal.models.index.PyPI`), so no
hostname is written here. Project pages are asked for as PEP 691 JSON; an index that
answers with the PEP 503 HTML page (e.g. a `file://` mirror) is read too. Downloads go
to a `.part` file and are renamed only after their sha256 matches the pin.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import ToolError
from .progress import Progress

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
