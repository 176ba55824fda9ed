# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`series`: the upstream pull requests, written from the same sources as the 0.26
product (patches/, overlay/, csrc/) onto a newer vLLM release.

patches/<version>/series.toml (the concern map) names the concerns in merge order, and
for each the series' patches and the overlay/csrc files it carries;
patches/<version>/NN-<name>/ holds what porting needed: `patches/` (a ported copy of a
series patch that no longer applies, same file name) and `adapt/` (the adaptations of
the concern's sources to the new release, as commits), and PR.md, the pull request's
description.

Everything is built in a dev tree, a git checkout of the pristine release where each
concern is

    <its patches, one commit each>   "series: NN-<name> sources"   <its adapt commits>
    "series: NN-<name> end"

(the two marker commits delimit the concern, so the history can be rebased freely).
`--dev DIR` makes one to edit; `--export DIR` writes its adapt commits and ported
patches back into patches/<version>/; `--out DIR` writes the pull requests, where a
concern's sources and adaptations are one commit (`subject`, `body`). `--check` applies
the written sets in order onto a fresh copy of the pristine release with `git apply`;
`--lint` and `--test` (upstream_checks.py) run vLLM's pre-commit hooks on the files each
set touches and its tests in the second pinned environment.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from . import ToolError
from .fetch import copy_sdist_tree, ensure_sdist_tree
from .patches import EXPORT_FLAGS, _git
from .repo import ROOT, UPSTREAM_VERSION, Series, SourceFile, default_cache_dir

MAP_NAME = "series.toml"
DESCRIPTION = "PR.md"
PORTED_DIR = "patches"
ADAPT_DIR = "adapt"
# The pristine release's commit in a dev tree.
BASE_TAG = "vllm-exl3-upstream-base"
_MARKER = "series: "


def _marker(label: str, what: str) -> str:
    return f"{_MARKER}{label} {what}"


@dataclass(frozen=True)
class Concern:
    index: int
    name: str
    patches: tuple[str, ...]  # ids of the series' patches ("0007")
    sources: tuple[str, ...]  # glob patterns on overlay/ and csrc/ paths
    subject: str | None
    body: str

    @property
    def label(self) -> str:
        return f"{self.index:02d}-{self.name}"


@dataclass
class UpstreamSeries:
    """The concern map of one release and the folder it lives in."""

    root: Path  # the repository (patches/, overlay/, csrc/)
    folder: Path  # patches/<version>
    base: str
    author: str
    date: str
    relocate: dict[str, str]
    concerns: tuple[Concern, ...]
    left_out: dict[str, str]  # overlay/csrc path -> why no pull request carries it
    superseded: dict[str, str]  # series patch id -> why no pull request carries it
    sources: dict[str, list[SourceFile]] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path = ROOT, version: str = UPSTREAM_VERSION) -> UpstreamSeries:
        folder = root / "patches" / version
        path = folder / MAP_NAME
        if not path.is_file():
            raise ToolError(f"no concern map for vLLM {version}: {path} is missing")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ToolError(f"{path}: {e}") from e
        concerns = []
        for i, c in enumerate(data.get("concern", []), 1):
            if not c.get("name") or not (c.get("patches") or c.get("sources")):
                raise ToolError(f"{path}: concern {i} needs a name and patches/sources")
            if c.get("sources") and not c.get("subject"):
                raise ToolError(f"{path}: concern {c['name']} has sources, no subject")
            concerns.append(
                Concern(
                    i,
                    c["name"],
                    tuple(c.get("patches", ())),
                    tuple(c.get("sources", ())),
                    c.get("subject"),
                    c.get("body", "").strip(),
                )
            )
        if data.get("base") != version:
            raise ToolError(f"{path}: base is {data.get('base')!r}, not {version}")
        us = cls(
            root.resolve(),
            folder,
            version,
            data["author"],
            data["date"],
            dict(data.get("relocate", {})),
            tuple(concerns),
            dict(data.get("left_out", {})),
            dict(data.get("superseded", {})),
        )
        us._check_patches()
        us.sources = us._assign(Series.load(root))
        return us

    def _check_patches(self) -> None:
        """Every patch of the series in exactly one concern, or superseded."""
        ids = sorted(p.name[:4] for p in (self.root / "patches").glob("*.patch"))
        carried = [pid for c in self.concerns for pid in c.patches]
        problems = [
            f"patch {pid}: "
            + (
                "neither in a concern nor [superseded]"
                if n == 0
                else f"in {n} places (concerns and [superseded])"
            )
            for pid in ids
            for n in [carried.count(pid) + (pid in self.superseded)]
            if n != 1
        ]
        problems += [
            f"{pid} (concern or [superseded]) is not a patch of the series"
            for pid in {*carried, *self.superseded}
            if pid not in ids
        ]
        if problems:
            raise ToolError(
                f"{self.folder / MAP_NAME} does not account for patches/:\n  "
                + "\n  ".join(problems)
            )

    def _assign(self, series: Series) -> dict[str, list[SourceFile]]:
        """Each overlay/csrc file (the generator's build-time units excepted: CMake runs
        the generator) to the one concern whose patterns match it, unless [left_out]
        names it."""
        out: dict[str, list[SourceFile]] = {c.label: [] for c in self.concerns}
        problems = []
        files = [f for f in (*series.overlay, *series.csrc) if f.generated is None]
        known = {f.origin for f in files}
        for origin in self.left_out:
            if origin not in known:
                problems.append(f"[left_out] names {origin}, which does not exist")
        for f in files:
            claims = [
                c
                for c in self.concerns
                if any(fnmatch.fnmatchcase(f.origin, p) for p in c.sources)
            ]
            if f.origin in self.left_out:  # an exception to a concern's pattern
                continue
            if len(claims) != 1:
                problems.append(
                    f"{f.origin}: "
                    + (
                        "no concern carries it and [left_out] does not name it"
                        if not claims
                        else "claimed by " + ", ".join(c.name for c in claims)
                    )
                )
                continue
            out[claims[0].label].append(f)
        for c in self.concerns:
            for p in c.sources:
                if not any(fnmatch.fnmatchcase(f.origin, p) for f in files):
                    problems.append(
                        f"concern {c.name}: source pattern {p} matches nothing"
                    )
        if problems:
            raise ToolError(
                f"{self.folder / MAP_NAME} does not account for the sources:\n  "
                + "\n  ".join(problems)
            )
        return out

    def dest(self, f: SourceFile) -> str:
        """Where a source goes in the new release's tree."""
        for old, new in self.relocate.items():
            if f.dest.startswith(old):
                return new + f.dest[len(old) :]
        return f.dest

    def member_patch(self, c: Concern, pid: str) -> Path:
        """The ported copy of a series patch, or the series' own."""
        found = sorted((self.root / "patches").glob(f"{pid}-*.patch"))
        if len(found) != 1:
            raise ToolError(f"concern {c.name}: patches/{pid}-*.patch names {found}")
        ported = self.folder / c.label / PORTED_DIR / found[0].name
        return ported if ported.is_file() else found[0]

    def adapt_patches(self, c: Concern) -> list[Path]:
        return sorted((self.folder / c.label / ADAPT_DIR).glob("*.patch"))


# Dev trees.


def _commit_env(identity: str, date: str) -> dict[str, str]:
    """Author and committer `Name <email>` at `date` (RFC 2822)."""
    name, _, email = identity.partition(" <")
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email.rstrip(">"),
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email.rstrip(">"),
        "GIT_COMMITTER_DATE": date,
    }


def _am(tree: Path, patch: Path, what: str) -> None:
    r = _git(tree, "am", "-q", "--whitespace=nowarn", str(patch), check=False)
    if r.returncode:
        shown = patch.relative_to(ROOT) if patch.is_relative_to(ROOT) else patch
        raise ToolError(
            f"{what}: {shown} does not apply in {tree}, left with `git am` in "
            "progress:\n"
            f"{r.stdout}{r.stderr}\nResolve it there (edit, `git add`, `git am "
            "--continue`), finish the tree by hand or rebuild it after "
            "`--export`, and export."
        )


def build_dev_tree(us: UpstreamSeries, dest: Path, base: Path) -> None:
    """The pristine release at `base` copied to `dest`, committed, then every concern
    as its patches, a sources commit, its adaptations and an end marker."""
    if dest.exists() and any(dest.iterdir()):
        raise ToolError(f"{dest} exists and is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    dest.rmdir()
    copy_sdist_tree(base, dest)
    _git(dest, "init", "-q")
    _git(dest, "add", "-f", "-A", ".")
    env = _commit_env(us.author, us.date)
    _git(dest, "commit", "-q", "--no-verify", "-m", f"vllm {us.base} pristine", env=env)
    _git(dest, "tag", BASE_TAG)
    for c in us.concerns:
        for pid in c.patches:
            _am(dest, us.member_patch(c, pid), f"concern {c.label}, patch {pid}")
        for f in us.sources[c.label]:
            target = dest / us.dest(f)
            if target.exists():
                raise ToolError(
                    f"concern {c.label}: {f.origin} would replace vLLM's own "
                    f"{us.dest(f)}"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read_bytes())
            target.chmod(0o644 | f.exec_bits)
            _git(dest, "add", "-f", us.dest(f))
        for what, patches in (("sources", ()), ("end", us.adapt_patches(c))):
            for p in patches:
                _am(dest, p, f"concern {c.label}, adaptation")
            _git(
                dest,
                "commit",
                "-q",
                "--no-verify",
                "--allow-empty",
                "-m",
                _marker(c.label, what),
                env=env,
            )


@dataclass
class ConcernCommits:
    concern: Concern
    members: list[str]  # commit ids, one per patch
    sources: str  # the sources marker commit
    adapt: list[str]
    end: str


def read_dev_tree(us: UpstreamSeries, dev: Path) -> list[ConcernCommits]:
    """The dev tree's history split by concern (markers), checked against the map."""
    if _git(dev, "rev-parse", "-q", "--verify", BASE_TAG, check=False).returncode:
        raise ToolError(
            f"{dev} is not a dev tree of `series --dev` (no {BASE_TAG} tag)"
        )
    if (dev / ".git" / "rebase-apply").exists():
        raise ToolError(f"{dev}: a git am is in progress; finish it first")
    if _git(dev, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise ToolError(f"{dev} has uncommitted changes; commit them first")
    log = _git(dev, "log", "--reverse", "--format=%H %s", f"{BASE_TAG}..HEAD").stdout
    commits = [line.split(" ", 1) for line in log.splitlines()]
    out: list[ConcernCommits] = []
    i = 0
    for c in us.concerns:
        members = []
        while i < len(commits) and commits[i][1] != _marker(c.label, "sources"):
            if commits[i][1].startswith(_MARKER):
                raise ToolError(f"{dev}: {commits[i][1]!r} where {c.label} begins")
            members.append(commits[i][0])
            i += 1
        if i == len(commits):
            raise ToolError(f"{dev}: no {_marker(c.label, 'sources')!r} commit")
        if len(members) != len(c.patches):
            raise ToolError(
                f"{dev}: concern {c.label} has {len(members)} commit(s) before its "
                f"sources, the map names {len(c.patches)} patch(es); a new change "
                "belongs in an adapt commit (after the sources marker)"
            )
        sources = commits[i][0]
        i += 1
        adapt = []
        while i < len(commits) and commits[i][1] != _marker(c.label, "end"):
            if commits[i][1].startswith(_MARKER):
                raise ToolError(f"{dev}: {commits[i][1]!r} inside {c.label}")
            adapt.append(commits[i][0])
            i += 1
        if i == len(commits):
            raise ToolError(f"{dev}: no {_marker(c.label, 'end')!r} commit")
        out.append(ConcernCommits(c, members, sources, adapt, commits[i][0]))
        i += 1
    if i != len(commits):
        raise ToolError(f"{dev}: commits after the last concern: {commits[i][1]!r}")
    return out


def _format_patch(dev: Path, rev_range: str, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.patch"))
    _git(dev, "format-patch", *EXPORT_FLAGS, "-q", "-o", str(dest), rev_range)
    return sorted(set(dest.glob("*.patch")) - before)


def _series_patch_reproduces(dev: Path, original: Path, commit: str) -> bool:
    """Whether the series' own patch, applied to the commit's parent, gives exactly
    the commit's tree (then no ported copy is needed)."""
    with tempfile.TemporaryDirectory(prefix="vllm-exl3-index-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        _git(dev, "read-tree", f"{commit}^", env=env)
        r = _git(dev, "apply", "--cached", str(original), check=False, env=env)
        if r.returncode:
            return False
        tree = _git(dev, "write-tree", env=env).stdout.strip()
    return tree == _git(dev, "rev-parse", f"{commit}^{{tree}}").stdout.strip()


def export_dev_tree(us: UpstreamSeries, dev: Path) -> list[str]:
    """Rewrite patches/<version>/NN-<name>/{patches,adapt}/ from the dev tree; returns
    one line per file written or removed."""
    report = []
    for cc in read_dev_tree(us, dev):
        folder = us.folder / cc.concern.label
        adapt_dir = folder / ADAPT_DIR
        for old in adapt_dir.glob("*.patch"):
            old.unlink()
        for c in cc.adapt:
            (written,) = _format_patch(dev, f"{c}^..{c}", adapt_dir)
            n = len(list(adapt_dir.glob("*.patch")))
            named = written.with_name(f"{n:04d}{written.name[4:]}")
            written.rename(named)
            report.append(f"{named.relative_to(us.root)}")
        ported_dir = folder / PORTED_DIR
        for pid, commit in zip(cc.concern.patches, cc.members):
            (original,) = sorted((us.root / "patches").glob(f"{pid}-*.patch"))
            ported = ported_dir / original.name
            if _series_patch_reproduces(dev, original, commit):
                if ported.exists():
                    ported.unlink()
                    report.append(f"removed {ported.relative_to(us.root)}")
                continue
            with tempfile.TemporaryDirectory(prefix="vllm-exl3-port-") as tmp:
                (written,) = _format_patch(dev, f"{commit}^..{commit}", Path(tmp))
                ported_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(written, ported)
            report.append(f"{ported.relative_to(us.root)} (ported)")
        for d in (adapt_dir, ported_dir):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    return report


# The pull requests.


def write_series(us: UpstreamSeries, dev: Path, out: Path) -> list[tuple[str, list]]:
    """One folder per concern in `out`: its commits as `git format-patch` files (the
    sources and their adaptations squashed into one commit; a concern without sources
    keeps its adaptation commits) and its PR.md."""
    if out.exists() and any(out.iterdir()):
        raise ToolError(f"{out} exists and is not empty")
    parsed = read_dev_tree(us, dev)
    head = _git(dev, "rev-parse", BASE_TAG).stdout.strip()
    written = []
    for cc in parsed:
        start = head
        for c in cc.members:
            head = _recommit(dev, c, head)
        if not cc.concern.sources:
            # Nothing to squash into: a concern of patches only keeps its adaptations
            # (new tests, say) as the commits they are.
            for c in cc.adapt:
                head = _recommit(dev, c, head)
        else:
            message = cc.concern.subject + (
                "\n\n" + cc.concern.body if cc.concern.body else ""
            )
            tree = _git(dev, "rev-parse", f"{cc.end}^{{tree}}").stdout.strip()
            head = _git(
                dev,
                "commit-tree",
                tree,
                "-p",
                head,
                "-m",
                message,
                env=_commit_env(us.author, us.date),
            ).stdout.strip()
        folder = out / cc.concern.label
        files = _format_patch(dev, f"{start}..{head}", folder)
        description = us.folder / cc.concern.label / DESCRIPTION
        if not description.is_file():
            raise ToolError(f"concern {cc.concern.label}: {description} is missing")
        shutil.copyfile(description, folder / DESCRIPTION)
        written.append((cc.concern.label, files))
    _git(dev, "update-ref", "refs/heads/upstream-series", head)
    _write_index(us, out, written)
    return written


def _recommit(dev: Path, commit: str, parent: str) -> str:
    """`commit` again on `parent`, same tree, message, author and date."""
    fmt = "%an%x00%ae%x00%ad%x00%B"
    name, email, date, message = _git(
        dev, "show", "-s", f"--format={fmt}", "--date=raw", commit
    ).stdout.split("\0", 3)
    env = {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": date,
    }
    tree = _git(dev, "rev-parse", f"{commit}^{{tree}}").stdout.strip()
    return _git(
        dev, "commit-tree", tree, "-p", parent, "-m", message.rstrip("\n"), env=env
    ).stdout.strip()


def _write_index(us: UpstreamSeries, out: Path, written: list) -> None:
    lines = [
        f"# EXL3 for vLLM {us.base}: the pull requests in merge order",
        "",
        f"Written by `scripts/vllm-exl3 series --base {us.base}` from the vllm-exl3 "
        "repository (patches/, overlay/, csrc/ and "
        f"patches/{us.base}/). Each folder is one pull request: `git format-patch` "
        "files and its description (PR.md). On a checkout of vLLM "
        f"v{us.base}, apply them in order with `git am --signoff` (vLLM asks for a "
        "DCO sign-off on every commit).",
        "",
        "| pull request | commits |",
        "|---|---|",
    ]
    for label, files in written:
        lines.append(f"| {label} | {', '.join(p.name for p in files)} |")
    (out / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def pull_request_folders(out: Path) -> list[Path]:
    folders = sorted(p for p in out.iterdir() if p.is_dir() and p.name[:2].isdigit())
    if not folders:
        raise ToolError(f"{out} holds no NN-<name> folders of `series --out`")
    return folders


def apply_in_order(out: Path, tree: Path) -> list[tuple[str, list[str], str]]:
    """Each folder's patches `git apply --check`ed, then applied, in order, onto
    `tree` (not a git repository); (folder, patch names, error) per folder, stopping
    at the first that does not apply."""
    env = {"GIT_CEILING_DIRECTORIES": str(tree.parent)}
    results = []
    for folder in pull_request_folders(out):
        names, error = [], ""
        for p in sorted(folder.glob("*.patch")):
            for args in (["apply", "--check"], ["apply"]):
                r = subprocess.run(
                    ["git", *args, str(p)],
                    cwd=tree,
                    env={**os.environ, **env},
                    capture_output=True,
                    text=True,
                )
                if r.returncode:
                    error = f"{p.name}: {r.stderr.strip()}"
                    break
            if error:
                break
            names.append(p.name)
        results.append((folder.name, names, error))
        if error:
            break
    return results


# The subcommand.


def run(args: argparse.Namespace) -> int:
    us = UpstreamSeries.load(args.series, args.base)
    if args.export:
        for line in export_dev_tree(us, args.export):
            print(line)
        print(f"exported {args.export} into {us.folder}")
        return 0
    base = ensure_sdist_tree(args.cache_dir, offline=args.offline, version=us.base)
    if args.dev:
        build_dev_tree(us, args.dev, base)
        print(
            f"{args.dev}: vLLM {us.base} with {len(us.concerns)} concern(s) as commits"
        )
        print(f"edit, commit, then: scripts/vllm-exl3 series --export {args.dev}")
        return 0
    if args.out is None:
        raise ToolError("nothing to do: give --out DIR, --dev DIR or --export DIR")
    with tempfile.TemporaryDirectory(prefix="vllm-exl3-series-") as tmp:
        dev = Path(tmp) / "dev"
        build_dev_tree(us, dev, base)
        written = write_series(us, dev, args.out)
    for label, files in written:
        print(f"{args.out / label}: {len(files)} patch(es)")
    status = 0
    if args.check or args.lint or args.test:
        status = check(us, args, base)
    return status


def check(us: UpstreamSeries, args: argparse.Namespace, base: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="vllm-exl3-series-check-") as tmp:
        tree = Path(tmp) / f"vllm-{us.base}"
        copy_sdist_tree(base, tree)
        results = apply_in_order(args.out, tree)
        failed = False
        for label, names, error in results:
            state = f"FAILS at {error}" if error else "applies"
            print(f"check: {label}: {len(names)} patch(es) {state}")
            failed |= bool(error)
        if failed:
            return 1
        if args.lint or args.test:
            from .upstream_checks import run_checks

            return run_checks(us, args, base)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "series",
        help=f"write the upstream pull requests for vLLM {UPSTREAM_VERSION}",
        description=(
            "Write the upstream series: one folder of `git format-patch` files and a "
            "PR.md per concern, in merge order, from patches/, overlay/, csrc/ and "
            "patches/<base>/ (series.toml, the concern map). See patches/README.md."
        ),
    )
    p.add_argument(
        "--base",
        default=UPSTREAM_VERSION,
        help=f"the vLLM release the series is ported to (default {UPSTREAM_VERSION})",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--out", type=Path, help="write the pull requests here (empty)")
    what.add_argument(
        "--dev", type=Path, help="make a dev tree here to port in (absent or empty)"
    )
    what.add_argument(
        "--export",
        type=Path,
        metavar="DEV",
        help="write a dev tree's adaptations and ported patches into patches/<base>/",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="with --out: apply the sets in order onto a fresh copy of the release "
        "(git apply --check, then git apply)",
    )
    p.add_argument(
        "--lint",
        action="store_true",
        help="with --out: also run the release's pre-commit hooks on each set's files "
        "(tools from ci/setup-env-upstream.sh's environment)",
    )
    p.add_argument(
        "--test",
        action="store_true",
        help="with --out: also run each set's tests in that environment",
    )
    p.add_argument(
        "--series", type=Path, default=ROOT, help="repository root holding patches/"
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="cache directory (default: $VLLM_EXL3_CACHE or ~/.cache/vllm-exl3)",
    )
    p.add_argument("--offline", action="store_true", help="never touch the network")
    p.set_defaults(func=run)
