# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`image`: a serving image for one GPU family as an OCI image layout, built without a
container engine (no daemon, no registry; Debian's mirror and the package index only).

Three layers, each a `umoci repack` of one root file system:

1. Debian (`mmdebstrap`, minbase) with Python, its headers and a C compiler (Triton
   compiles its launchers at run time). A foreign machine's root is made by mmdebstrap
   through qemu-user-static's binfmt_misc entry.
2. A venv at /opt/vllm with everything vLLM 0.26.0 depends on (torch 2.11.0 and the
   CUDA 13 wheels it pulls among them), resolved by pip inside the root from the release
   wheel's own metadata and installed from the lock that resolution wrote
   (/opt/vllm/requirements-lock.txt, with hashes).
3. Our wheel: the release wheel of the image's machine + the series + our kernels for
   the image's GPU, compiled on this machine against the root's torch (for another
   machine with Debian's cross g++: the device code does not depend on the host, see
   kernels_build.target_toolchain).

Then the image's configuration (`vllm serve` as entrypoint), the digest and sizes in a
JSON record beside the layout, optionally an `oci-archive` tar, and the smoke test
(image_smoke.py) inside a fresh unpacking of the image. Commands inside the root run
through `chroot` in a private mount namespace (`unshare`), so /proc, /dev and the
build's scratch folders are never mounted outside one command's lifetime.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import ssl
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from . import ToolError
from .build import quick_build
from .fetch import ensure_pinned, wheels_dir
from .kernels_build import (
    ARCH_FEATURES,
    BuildError,
    build_extension,
    dotted,
    find_nvcc,
    host_compiler,
    normalize_arch,
    target_toolchain,
)
from .repo import (
    BUILD_LABEL_PREFIX,
    ROOT,
    VLLM_VERSION,
    WHEELS,
    Series,
    default_cache_dir,
    git_label,
    host_machine,
)


@dataclass(frozen=True)
class ImageTarget:
    """One serving image: the GPU architecture its kernels are built for and the
    machine it runs on."""

    arch: str  # CUDA architecture, dotted ("12.1")
    machine: str  # the release wheels' name for the machine (repo.WHEELS)
    debian_arch: str  # Debian's and OCI's name for it
    gpus: str  # what it is for, in words

    @property
    def sm(self) -> str:
        """The device code the kernels carry: '121', or '90a' on Hopper."""
        a = normalize_arch(self.arch)
        return ARCH_FEATURES.get(a, a)

    @property
    def name(self) -> str:
        return f"vllm-exl3-sm{normalize_arch(self.arch)}"


# The images: one GPU family each, on the machine it comes in.
IMAGE_TARGETS = {
    t.arch: t
    for t in (
        ImageTarget("12.0", "x86_64", "amd64", "RTX PRO 6000 Blackwell"),
        ImageTarget("12.1", "aarch64", "arm64", "DGX Spark GB10"),
        ImageTarget("9.0", "x86_64", "amd64", "Hopper (H100, H200)"),
    )
}

# Debian 12: python3 is 3.11 (torch 2.11.0 and vLLM 0.26.0 publish wheels for
# 3.10-3.13) and glibc 2.36, above the manylinux_2_28 of the release wheels.
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
SECURITY_MIRROR = "http://deb.debian.org/debian-security"
# python3-venv: the venv; python3-dev, gcc, libc6-dev: Triton compiles a C launcher per
# kernel at run time against Python.h, and the cross-build of our kernels reads Python.h
# from the root; ca-certificates: model downloads from the Hugging Face Hub.
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python3-dev",
    "gcc",
    "libc6-dev",
    "ca-certificates",
)
REPOSITORY = "vllm-exl3"
VENV = "/opt/vllm"
PYTHON = f"{VENV}/bin/python"
# The venv's pip, pinned so two builds resolve alike (Debian's bundled pip is 23.0).
PIP = "pip==26.3"
LOCK = f"{VENV}/requirements-lock.txt"
# Where a build command inside the root finds its scratch files, the wheelhouse (the
# locked wheels, kept per machine in the cache: pip's own cache keeps nothing from an
# index that sends no caching headers, and a second build should not download 4 GB
# again), the release wheel and our wheel: folders here bind-mounted for one command,
# so nothing written there stays in a layer.
SCRATCH = "/run/vllm-exl3-build"
WHEELHOUSE = "/run/vllm-exl3-wheelhouse"
RELEASE_WHEELS = "/run/vllm-exl3-release-wheels"
DIST = "/run/vllm-exl3-dist"
# What the smoke test adds to its own unpacking of the image (never to the image):
# pytest for the fixture test, cuobjdump for listing the kernels' device code (the
# versions of the pinned test environment, ci/setup-env.sh).
SMOKE = "/run/vllm-exl3-smoke"
SMOKE_PACKAGES = ("pytest==9.2.0", "nvidia-cuda-cuobjdump==13.2.51")
# The repository files the smoke test reads: the tool (the smoke script itself), the
# overlay (its tests and the codec the tests' fixtures load), the op registrations in
# csrc/, and the fixture checkpoint.
SMOKE_TREE = ("scripts/vllm_exl3", "overlay", "csrc", "tests/fixtures/qwen3-tiny")
PATH_IN_ROOT = (
    f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)
PORT = 8000
# Where the kernel registers its interpreters for other machines' programs.
BINFMT_MISC = Path("/proc/sys/fs/binfmt_misc")


def resolve_target(arch: str) -> ImageTarget:
    """'12.1', '121', 'sm_121' -> its image; any other architecture is refused, naming
    the ones there are."""
    try:
        dotted_arch = dotted(normalize_arch(arch))
    except BuildError as e:
        raise ToolError(str(e)) from e
    if dotted_arch not in IMAGE_TARGETS:
        raise ToolError(
            f"no image for CUDA architecture {arch}: images are built for "
            + ", ".join(f"{a} ({t.gpus})" for a, t in IMAGE_TARGETS.items())
        )
    return IMAGE_TARGETS[dotted_arch]


def image_tag(target: ImageTarget, label: str) -> str:
    """The image's name and tag in the layout's index (its ref.name annotation): the
    wheel's version, then the GPU. A name, not a bare tag, so that podman and skopeo
    name the image they load from the archive by it."""
    version = f"{VLLM_VERSION}-{BUILD_LABEL_PREFIX}.{label}"
    return f"{REPOSITORY}:{version}-sm{normalize_arch(target.arch)}"


def mmdebstrap_command(
    target: ImageTarget, rootfs: Path, mirror: str, security_mirror: str
) -> list[str]:
    sources = [
        f"deb {mirror} {SUITE} main",
        f"deb {mirror} {SUITE}-updates main",
        f"deb {security_mirror} {SUITE}-security main",
    ]
    return [
        "mmdebstrap",
        "--mode=root",
        "--variant=minbase",
        f"--arch={target.debian_arch}",
        f"--include={','.join(BASE_PACKAGES)}",
        SUITE,
        str(rootfs),
        *sources,
    ]


def lock_lines(report: Mapping) -> list[str]:
    """`name==version --hash=sha256:...` for every distribution pip's installation
    report resolved, but vLLM itself (its own layer), in name order. A distribution
    without a sha256 in the report is refused: the lock is installed with
    --require-hashes."""
    lines, problems = [], []
    for item in report["install"]:
        meta = item["metadata"]
        name = meta["name"].lower().replace("_", "-")
        if name == "vllm":
            continue
        sha = item["download_info"].get("archive_info", {}).get("hashes", {})
        if "sha256" not in sha:
            problems.append(
                f"{name} {meta['version']} ({item['download_info']['url']})"
            )
            continue
        lines.append(f"{name}=={meta['version']} --hash=sha256:{sha['sha256']}")
    if problems:
        raise ToolError("pip's resolution gave no sha256 for: " + ", ".join(problems))
    return sorted(lines)


def host_ca_bundle() -> Path | None:
    """The CA bundle this machine's pip trusts (an intercepting proxy's own CA may be
    in it), for pip inside the root; the image keeps Debian's own."""
    candidates = [
        os.environ.get(v) for v in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")
    ]
    candidates += [ssl.get_default_verify_paths().cafile]
    candidates += ["/etc/ssl/certs/ca-certificates.crt"]
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


def chroot_env(scratch: str, ca: bool, index_url: str | None) -> dict[str, str]:
    """The whole environment of a command inside the root: nothing of this machine's
    but the package index and its CA."""
    env = {
        "PATH": PATH_IN_ROOT,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "TMPDIR": f"{scratch}/tmp",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
        "PIP_PROGRESS_BAR": "off",
    }
    if ca:
        for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
            env[var] = f"{scratch}/ca.crt"
    if index_url:
        env["PIP_INDEX_URL"] = index_url
    return env


def chroot_command(
    rootfs: Path,
    argv: Sequence[str],
    env: Mapping[str, str],
    binds: Mapping[str, Path],
) -> list[str]:
    """`argv` run inside `rootfs` with exactly `env`, in a private mount namespace that
    holds /proc, /sys, /dev, this machine's resolv.conf and `binds` (path inside the
    root -> folder here) for this command only."""
    r = shlex.quote(str(rootfs))
    mounts = [
        f"mount -t proc proc {r}/proc",
        f"mount -t sysfs sysfs {r}/sys",
        f"mount --rbind /dev {r}/dev",
        f"mount --bind /etc/resolv.conf {r}/etc/resolv.conf",
    ]
    mounts += [
        f"mount --bind {shlex.quote(str(host))} {r}{shlex.quote(inside)}"
        for inside, host in binds.items()
    ]
    script = " && ".join(mounts) + f' && exec chroot {r} /usr/bin/env -i "$@"'
    assignments = [f"{k}={v}" for k, v in env.items()]
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        script,
        "sh",
        *assignments,
        *argv,
    ]


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this namespace (none may be, before a
    folder there is deleted)."""
    prefix = str(path.resolve())
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


def remove_tree(path: Path) -> None:
    if not path.exists():
        return
    if found := mounts_under(path):
        raise ToolError(
            f"will not delete {path}: mounted under it: {', '.join(found)} "
            "(unmount them first)"
        )
    shutil.rmtree(path)


class Root:
    """A root file system under construction: run commands in it, and keep it free of
    the mount points and scratch files those commands need."""

    def __init__(self, rootfs: Path, scratch: Path, index_url: str | None):
        self.rootfs, self.scratch = rootfs, scratch
        self.ca = host_ca_bundle()
        self.index_url = index_url

    def run(
        self,
        argv: Sequence[str],
        extra_binds: Mapping[str, Path] | None = None,
        extra_env: Mapping[str, str] | None = None,
        log: Path | None = None,
        check: bool = True,
    ) -> tuple[int, str]:
        """Run `argv` in the root, its output shown (and appended to `log`); returns
        the exit status and the output. A failure raises ToolError unless not
        `check`."""
        binds = {SCRATCH: self.scratch, **(extra_binds or {})}
        (self.scratch / "tmp").mkdir(parents=True, exist_ok=True)
        if self.ca:
            shutil.copyfile(self.ca, self.scratch / "ca.crt")
        created = []
        resolv = self.rootfs / "etc" / "resolv.conf"
        if not resolv.exists():
            resolv.touch()
            created.append(resolv)
        for inside in binds:
            point = self.rootfs / inside.lstrip("/")
            while not point.exists():
                created.append(point)
                point = point.parent
            (self.rootfs / inside.lstrip("/")).mkdir(parents=True, exist_ok=True)
        env = chroot_env(SCRATCH, self.ca is not None, self.index_url)
        env.update(extra_env or {})
        cmd = chroot_command(self.rootfs, argv, env, binds)
        print(f"  [root] {shlex.join(argv)}", flush=True)
        lines = []
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for line in proc.stdout:
                sys.stdout.write(line)
                lines.append(line)
            returncode = proc.wait()
            if log is not None:
                with open(log, "a") as out:
                    out.writelines(lines)
        finally:
            # Deepest first: a bind's mount point inside another created folder.
            for p in sorted(set(created), key=lambda p: len(p.parts), reverse=True):
                if p.is_dir():
                    p.rmdir()
                else:
                    p.unlink()
        if check and returncode != 0:
            raise ToolError(
                f"inside {self.rootfs}: {shlex.join(argv)} failed (exit {returncode})"
            )
        return returncode, "".join(lines)

    def clean(self) -> None:
        """What a command may leave that does not belong to the image."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        shutil.rmtree(self.rootfs / "root" / ".cache", ignore_errors=True)


# `pip check`'s line for an installed wheel whose WHEEL file names a tag no platform
# has. NVIDIA's aarch64 wheels do (nvidia-cusparselt-cu13 0.8.0 says
# `manylinux2014_sbsa`, though its file name says manylinux2014_aarch64, which is how
# pip chose and installed it), so such a line is recorded, not an error.
_UNSUPPORTED = re.compile(r"^(\S+) (\S+) is not supported on this platform$")


def pip_check_verdict(output: str) -> tuple[list[str], list[str]]:
    """(broken requirements, wheels whose recorded tag pip does not know) from the
    output of `pip check`."""
    broken, unsupported = [], []
    for line in output.strip().splitlines():
        if m := _UNSUPPORTED.match(line.strip()):
            unsupported.append(f"{m.group(1)} {m.group(2)}")
        elif line.strip() and line.strip() != "No broken requirements found.":
            broken.append(line.strip())
    return broken, unsupported


def umoci(*args: str) -> None:
    r = subprocess.run(["umoci", *args])
    if r.returncode != 0:
        raise ToolError(f"umoci {shlex.join(args)} failed (exit {r.returncode})")


def oci_config_args(target: ImageTarget, version: str, label: str) -> list[str]:
    """`umoci config` options: the platform, `vllm serve` as entrypoint, the venv on
    PATH, what NVIDIA's container toolkit reads to give the container the GPUs and the
    driver's compute libraries, and the OCI annotations of what it is."""
    env = {
        "PATH": PATH_IN_ROOT,
        "VIRTUAL_ENV": VENV,
        "LANG": "C.UTF-8",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    }
    labels = {
        "org.opencontainers.image.title": "vllm-exl3",
        "org.opencontainers.image.description": (
            f"vLLM {VLLM_VERSION} with EXL3 for {target.gpus} (sm_{target.sm})"
        ),
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": label,
        "org.opencontainers.image.licenses": "Apache-2.0",
    }
    args = [
        f"--architecture={target.debian_arch}",
        "--os=linux",
        f"--config.entrypoint={VENV}/bin/vllm",
        "--config.entrypoint=serve",
        "--config.cmd=--help",
        "--config.workingdir=/",
        f"--config.exposedports={PORT}/tcp",
    ]
    args += [f"--config.env={k}={v}" for k, v in env.items()]
    args += [f"--config.label={k}={v}" for k, v in labels.items()]
    return args


def _blob(layout: Path, digest: str) -> Path:
    algo, _, hexdigest = digest.partition(":")
    return layout / "blobs" / algo / hexdigest


def layout_record(layout: Path, tag: str) -> dict:
    """The tagged image of an OCI layout: its manifest digest (what `skopeo inspect`
    reports as Digest), platform, layers (digest, compressed size, what made it) and
    total compressed size (manifest + config + layers)."""
    index = json.loads((layout / "index.json").read_text())
    found = [
        m
        for m in index["manifests"]
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag
    ]
    if len(found) != 1:
        raise ToolError(f"{layout}: {len(found)} manifests tagged {tag!r}, not one")
    manifest_desc = found[0]
    manifest = json.loads(_blob(layout, manifest_desc["digest"]).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    made_by = [h for h in config.get("history", []) if not h.get("empty_layer")]
    layers = [
        {
            "digest": layer["digest"],
            "size": layer["size"],
            "comment": h.get("comment", ""),
        }
        for layer, h in zip(manifest["layers"], made_by)
    ]
    return {
        "tag": tag,
        "digest": manifest_desc["digest"],
        "platform": f"{config['os']}/{config['architecture']}",
        "layers": layers,
        "size": manifest_desc["size"]
        + manifest["config"]["size"]
        + sum(layer["size"] for layer in manifest["layers"]),
    }


def layout_files(layout: Path) -> Iterator[Path]:
    yield layout / "oci-layout"
    yield layout / "index.json"
    yield layout / "blobs"
    yield from sorted((layout / "blobs").rglob("*"))


def write_oci_archive(layout: Path, out: Path) -> None:
    """The layout as one tar (the `oci-archive` transport of skopeo and podman),
    members owned by root, readable by all."""
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(tmp, "w") as tar:
        for path in layout_files(layout):
            info = tar.gettarinfo(path, path.relative_to(layout).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mode = 0o755 if path.is_dir() else 0o644
            if path.is_dir():
                tar.addfile(info)
            else:
                with open(path, "rb") as f:
                    tar.addfile(info, f)
    tmp.replace(out)


def skopeo_verdict(inspect: Mapping, record: Mapping) -> str | None:
    """What `skopeo inspect` of the image says differently from the record (digest,
    architecture), or None when it agrees."""
    os_name, _, arch = record["platform"].partition("/")
    seen = (inspect.get("Digest"), inspect.get("Os"), inspect.get("Architecture"))
    if seen != (record["digest"], os_name, arch):
        return (
            f"skopeo reads {seen}, the record says {(record['digest'], os_name, arch)}"
        )
    return None


def skopeo_check(ref: str, record: Mapping) -> dict:
    """Another reader of the layout: skopeo's view of `ref` against the record."""
    r = subprocess.run(["skopeo", "inspect", ref], capture_output=True, text=True)
    if r.returncode != 0:
        raise ToolError(f"skopeo inspect {ref} failed: {r.stderr.strip()}")
    if problem := skopeo_verdict(json.loads(r.stdout), record):
        raise ToolError(f"{ref}: {problem}")
    return {"ref": ref, "digest": record["digest"], "agrees": True}


def tree_size(path: Path) -> int:
    """Bytes of the regular files under `path`, each hard-linked file once."""
    seen, total = set(), 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def preflight(target: ImageTarget, smoke_only: bool) -> list[str]:
    """Every reason this machine cannot build (or smoke-test) the image, each with what
    to install; empty when it can."""
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (mmdebstrap's root mode, chroot, mount)")
    tools = {"umoci": "umoci", "unshare": "util-linux", "chroot": "coreutils"}
    if not smoke_only:
        tools["mmdebstrap"] = "mmdebstrap"
    for tool, package in tools.items():
        if shutil.which(tool) is None:
            problems.append(f"{tool} not found (Debian package {package})")
    if target.machine != host_machine():
        entry = BINFMT_MISC / f"qemu-{target.machine}"
        lines = entry.read_text().splitlines() if entry.is_file() else []
        flags = next((ln.split()[1] for ln in lines if ln.startswith("flags:")), "")
        if lines[:1] != ["enabled"] or "F" not in flags:
            problems.append(
                f"{target.machine} programs do not run here: no enabled binfmt_misc "
                f"entry {entry} with the F flag (Debian: apt-get install "
                "qemu-user-static binfmt-support; if /proc/sys/fs/binfmt_misc is "
                "empty: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc, "
                "then update-binfmts --enable)"
            )
    if not smoke_only:
        try:
            find_nvcc()
            host_compiler(target.machine)
        except BuildError as e:
            problems.append(str(e))
    if target.machine not in WHEELS:
        problems.append(f"no pinned vLLM release wheel for {target.machine}")
    return problems


def run_smoke(
    target: ImageTarget,
    layout: Path,
    tag: str,
    work: Path,
    index_url: str | None,
    log: Path,
) -> dict:
    """The smoke test (image_smoke.py) inside a fresh unpacking of the tagged image,
    with the repository files it reads and its tools in a folder bound into it."""
    bundle = work / "smoke"
    remove_tree(bundle)
    umoci("unpack", "--image", f"{layout}:{tag}", str(bundle))
    tree = work / "smoke-tree"
    remove_tree(tree)
    for rel in SMOKE_TREE:
        shutil.copytree(
            ROOT / rel,
            tree / "repo" / rel,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    root = Root(bundle / "rootfs", work / "scratch", index_url)
    binds = {SMOKE: tree}
    log.write_text("")
    try:
        root.run(
            [
                PYTHON,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--target",
                f"{SMOKE}/site",
                *SMOKE_PACKAGES,
            ],
            extra_binds=binds,
        )
        root.run(
            [
                PYTHON,
                "-m",
                "vllm_exl3.image_smoke",
                "--arch",
                target.arch,
                "--cuobjdump",
                f"{SMOKE}/site/nvidia/cu13/bin/cuobjdump",
                "--json",
                f"{SMOKE}/result.json",
            ],
            extra_binds=binds,
            extra_env={
                "PYTHONPATH": f"{SMOKE}/site:{SMOKE}/repo/scripts",
                "TMPDIR": f"{SMOKE}/tmp",
            },
            log=log,
            # A failed check exits 1 with the verdicts written; their absence fails.
            check=False,
        )
    finally:
        root.clean()
    if not (tree / "result.json").is_file():
        raise ToolError(f"the smoke test wrote no verdicts ({log})")
    result = json.loads((tree / "result.json").read_text())
    remove_tree(bundle)
    remove_tree(tree)
    return result


def base_layer(root: Root, target: ImageTarget, args: argparse.Namespace) -> str:
    """Debian by mmdebstrap into the empty root; returns the layer's comment."""
    print(f"image: Debian {SUITE} for {target.debian_arch} (mmdebstrap)", flush=True)
    cmd = mmdebstrap_command(target, root.rootfs, args.mirror, args.security_mirror)
    if subprocess.run(cmd).returncode != 0:
        raise ToolError(f"{shlex.join(cmd)} failed")
    # The container runtime provides these; mmdebstrap leaves this machine's.
    for name in ("etc/resolv.conf", "etc/hostname"):
        (root.rootfs / name).unlink(missing_ok=True)
    for node in (root.rootfs / "dev").iterdir():
        if node.is_dir() and not node.is_symlink():
            shutil.rmtree(node)
        else:
            node.unlink()
    return f"Debian {SUITE} (mmdebstrap, minbase) + {' '.join(BASE_PACKAGES)}"


def dependency_layer(
    root: Root, target: ImageTarget, release: Path, wheelhouse: Path, record: dict
) -> str:
    """The venv with everything the release wheel requires, resolved by pip inside the
    root, locked with hashes, downloaded into the wheelhouse and installed from it;
    returns the layer's comment."""
    root.run(["python3", "-m", "venv", VENV])
    root.run([PYTHON, "-m", "pip", "install", "--quiet", PIP])
    root.run(
        [
            PYTHON,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--report",
            f"{SCRATCH}/resolution.json",
            f"{RELEASE_WHEELS}/{release.name}",
        ],
        extra_binds={RELEASE_WHEELS: release.parent},
    )
    report = json.loads((root.scratch / "resolution.json").read_text())
    lock = lock_lines(report)
    (root.rootfs / LOCK.lstrip("/")).write_text(
        f"# vLLM {VLLM_VERSION}'s dependencies for {target.machine}, as pip resolved "
        f"them from {release.name}\n" + "\n".join(lock) + "\n"
    )
    wheelhouse.mkdir(parents=True, exist_ok=True)
    locked = ["--no-deps", "--require-hashes", "-r", LOCK]
    root.run(
        [PYTHON, "-m", "pip", "download", "--dest", WHEELHOUSE, *locked],
        extra_binds={WHEELHOUSE: wheelhouse},
    )
    root.run(
        [PYTHON, "-m", "pip", "install", "--no-index", "--find-links", WHEELHOUSE]
        + locked,
        extra_binds={WHEELHOUSE: wheelhouse},
    )
    record["dependencies"] = len(lock)
    return (
        f"venv {VENV}: vLLM {VLLM_VERSION}'s dependencies, {len(lock)} distributions "
        f"({LOCK})"
    )


def build_kernels(root: Root, target: ImageTarget, out: Path, jobs: int) -> Path:
    """Our extension for the image's GPU, compiled here against the root's venv (for
    another machine with its cross compiler); returns the library."""
    site = next(
        (root.rootfs / VENV.lstrip("/") / "lib").glob("python3.*/site-packages")
    )
    try:
        toolchain = target_toolchain(root.rootfs, site, target.machine)
        print(
            f"image: compiling the kernels for sm_{target.sm} with {toolchain.nvcc} "
            f"(host compiler {toolchain.cxx}) against {site}",
            flush=True,
        )
        return build_extension(
            out, [target.arch], jobs, verbose=True, toolchain=toolchain
        )
    except BuildError as e:
        raise ToolError(f"the kernel build failed: {e}") from e


def wheel_layer(root: Root, wheel: Path, record: dict) -> None:
    """Our wheel over the release's dependencies, then pip's consistency check."""
    root.run(
        [
            PYTHON,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            f"{DIST}/{wheel.name}",
        ],
        extra_binds={DIST: wheel.parent},
    )
    returncode, out = root.run([PYTHON, "-m", "pip", "check"], check=False)
    broken, unsupported = pip_check_verdict(out)
    if returncode != 0 and (broken or not unsupported):
        raise ToolError(f"pip check in the image's venv: {'; '.join(broken) or out}")
    record["pip_check"] = {"wheel_tags_pip_does_not_know": unsupported}


def build_image(args: argparse.Namespace, target: ImageTarget, record: dict) -> str:
    """Layers, configuration and tag of the image in args.out_dir; returns the tag."""
    series = Series.load(ROOT)
    label = git_label(ROOT) or series.fingerprint("wheel")[:8]
    version = f"{VLLM_VERSION}+{BUILD_LABEL_PREFIX}.{label}"
    tag = image_tag(target, label)
    layout = args.out_dir / target.name
    images = args.cache_dir / "images"
    work = images / f"work-{target.name}"
    bundle = work / "bundle"
    steps = record["steps_s"]
    remove_tree(layout)
    remove_tree(bundle)
    work.mkdir(parents=True, exist_ok=True)
    ref = f"{layout}:{tag}"
    umoci("init", "--layout", str(layout))
    umoci("new", "--image", ref)
    umoci("unpack", "--image", ref, str(bundle))
    root = Root(bundle / "rootfs", work / "scratch", args.index_url)

    def step(name: str, fn, *fn_args):
        t0 = time.monotonic()
        result = fn(*fn_args)
        steps[name] = steps.get(name, 0.0) + time.monotonic() - t0
        return result

    def repack(comment: str) -> None:
        root.clean()
        step(
            "repack",
            umoci,
            "repack",
            "--refresh-bundle",
            f"--history.comment={comment}",
            "--image",
            ref,
            str(bundle),
        )

    repack(step("base", base_layer, root, target, args))
    filename, sha = WHEELS[target.machine]
    release = ensure_pinned(filename, sha, wheels_dir(args.cache_dir), offline=False)
    wheelhouse = images / "wheelhouse" / target.machine
    repack(
        step(
            "dependencies", dependency_layer, root, target, release, wheelhouse, record
        )
    )
    kernels = step(
        "kernels",
        build_kernels,
        root,
        target,
        images / "kernels" / target.machine,
        args.jobs,
    )
    record["kernels"] = {
        "built_on": host_machine(),
        "host_compiler": host_compiler(target.machine),
        "cross": target.machine != host_machine(),
    }
    wheel = step(
        "wheel", quick_build, release, series, work / "dist", work, kernels, label
    )
    record["wheel"] = wheel.name
    step("install", wheel_layer, root, wheel, record)
    record["rootfs_size"] = tree_size(root.rootfs)
    repack(f"vLLM {version} with the EXL3 kernels for sm_{target.sm}")

    umoci(
        "config",
        "--image",
        ref,
        f"--created={datetime.now(timezone.utc).isoformat()}",
        "--history.comment=vllm serve",
        *oci_config_args(target, version, label),
    )
    umoci("gc", "--layout", str(layout))
    for path in layout_files(layout):
        path.chmod(0o755 if path.is_dir() else 0o644)
    if not args.keep_rootfs:
        remove_tree(bundle)
    return tag


def run(args: argparse.Namespace) -> int:
    target = resolve_target(args.arch)
    if problems := preflight(target, args.smoke_only):
        raise ToolError(
            f"cannot build the {target.name} image here:\n  " + "\n  ".join(problems)
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record_path = args.out_dir / f"{target.name}.json"
    t_start = time.monotonic()
    if args.smoke_only:
        if not record_path.is_file():
            raise ToolError(f"--smoke-only: no record {record_path} of a built image")
        record = json.loads(record_path.read_text())
        tag = record["tag"]
    else:
        record = {
            "image": target.name,
            "arch": target.arch,
            "gpus": target.gpus,
            "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": f"{host_machine()}, {os.cpu_count()} CPUs",
            "steps_s": {},
        }
        tag = build_image(args, target, record)
    layout = args.out_dir / target.name
    record.update(layout_record(layout, tag))
    record["layout"] = str(layout)
    if args.archive:
        t0 = time.monotonic()
        archive = args.out_dir / f"{target.name}.oci.tar"
        write_oci_archive(layout, archive)
        record["steps_s"]["archive"] = time.monotonic() - t0
        record["archive"] = str(archive)
    if shutil.which("skopeo"):
        refs = [f"oci:{layout}:{tag}"]
        refs += [f"oci-archive:{record['archive']}"] if args.archive else []
        record["skopeo"] = [skopeo_check(ref, record) for ref in refs]
    if not args.smoke_only:
        record["build_s"] = time.monotonic() - t_start
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"image: {layout}:{tag} {record['digest']} ({record['platform']}, "
        f"{record['size'] / 1e9:.2f} GB compressed)",
        flush=True,
    )
    if not args.no_smoke:
        t0 = time.monotonic()
        log = args.out_dir / f"{target.name}.smoke.log"
        record["smoke"] = run_smoke(
            target,
            layout,
            tag,
            args.cache_dir / "images" / f"work-{target.name}",
            args.index_url,
            log,
        )
        record["steps_s"]["smoke"] = time.monotonic() - t0
        record_path.write_text(json.dumps(record, indent=2) + "\n")
        failed = [c["name"] for c in record["smoke"]["checks"] if not c["ok"]]
        if failed:
            raise ToolError(
                f"smoke test of {target.name} failed: {', '.join(failed)} ({log})"
            )
        print(f"image: smoke test passed ({log})", flush=True)
    print(f"image: record in {record_path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    archs = ", ".join(f"{a} ({t.gpus}, {t.machine})" for a, t in IMAGE_TARGETS.items())
    p = subparsers.add_parser(
        "image",
        help="build a serving image (OCI layout) without a container engine",
        description=(
            "Build the serving image of one GPU family as an OCI image layout in "
            "--out-dir/vllm-exl3-sm<arch>/ with a JSON record beside it (digest, "
            "sizes, times, smoke output): a Debian root made by mmdebstrap (another "
            "machine's through qemu-user-static), vLLM's dependencies in a venv, our "
            "wheel with the kernels for that GPU, `vllm serve` as entrypoint, layers "
            "written by umoci; then the smoke test inside the image. Needs root, "
            "mmdebstrap, umoci, the CUDA 13 toolkit, for an aarch64 image on x86_64 "
            "g++-aarch64-linux-gnu and qemu-user-static, and Debian's mirror and the "
            f"package index. Architectures: {archs}."
        ),
    )
    p.add_argument("--arch", required=True, help="CUDA architecture: " + archs)
    p.add_argument(
        "--out-dir",
        type=Path,
        default=default_cache_dir() / "images",
        help="where the layout, the record and --archive go "
        "(default: the cache's images/)",
    )
    p.add_argument(
        "--archive",
        action="store_true",
        help="also write the layout as one oci-archive tar (podman load -i, skopeo)",
    )
    smoke = p.add_mutually_exclusive_group()
    smoke.add_argument("--no-smoke", action="store_true", help="skip the smoke test")
    smoke.add_argument(
        "--smoke-only",
        action="store_true",
        help="only the smoke test, of the image an earlier run built in --out-dir",
    )
    p.add_argument(
        "--keep-rootfs",
        action="store_true",
        help="keep the build's root file system (the cache's images/work-*/bundle)",
    )
    p.add_argument(
        "--jobs", type=int, default=2, help="parallel kernel compiles (default 2)"
    )
    p.add_argument("--mirror", default=MIRROR, help=f"Debian mirror (default {MIRROR})")
    p.add_argument(
        "--security-mirror",
        default=SECURITY_MIRROR,
        help=f"Debian security mirror (default {SECURITY_MIRROR})",
    )
    p.add_argument(
        "--index-url",
        default=os.environ.get("PIP_INDEX_URL"),
        help="package index for pip inside the image's root (default: $PIP_INDEX_URL, "
        "else pip's own)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="cache directory (default: $VLLM_EXL3_CACHE or ~/.cache/vllm-exl3)",
    )
    p.set_defaults(func=run)
