# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`bundle`: everything an air-gapped GPU host needs to run our vLLM, in parts of a
chosen size.

The host already has Python, torch 2.11.0+cu130 and the big ML libraries, but no vLLM,
no index and no network, and takes files of limited size per transfer. The bundle holds
the built wheel cut down to what serving needs (the dropped pieces are listed in
_DROPPED), the dependency wheels the host lacks (bundle_requirements.txt) and an
install.sh that checks every part's sha256, reassembles them and installs with
`pip install --no-index --no-deps --target DIR`.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from . import ToolError
from .build import WheelName, unpack, write
from .fetch import sha256_file
from .repo import BUILD_LABEL_PREFIX, ROOT, VLLM_VERSION, default_cache_dir

DEFAULT_PART_SIZE = (
    "60MB"  # under a ~64 MB per-transfer limit, with room for install.sh
)
DEFAULT_PYTHON = "3.12"  # the GPU host's interpreter
REQUIREMENTS = Path(__file__).with_name("bundle_requirements.txt")
PART_STEM = "vllm-exl3-bundle.part"
INSTALLER = Path(__file__).with_name("bundle_install.sh")
# Environment the host needs: flashinfer is not bundled, and the sampler would import
# it.
HOST_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}

# Pieces of the release wheel a model on Hopper/Blackwell does not need; together ~140
# MB compressed (fa2 123, vllm-rs 14, fmha_sm100's headers 3). fa3
# (vllm_flash_attn/_vllm_fa3_C) is the flash-attention build serving uses. DeepGEMM's
# headers (3 MB compressed) stay: the DeepSeek-Sparse-Attention indexer (DeepSeek-V3.2,
# GLM-5) runs DeepGEMM kernels that it JIT-compiles on the host with nvcc against them.
# fmha_sm100 serves datacenter Blackwell (sm_100) only.
_DROPPED = (
    (
        re.compile(r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"),
        "FlashAttention-2 build",
    ),
    (re.compile(r"^vllm/vllm-rs$"), "Rust frontend binary"),
    (
        re.compile(r"^vllm/third_party/fmha_sm100/.*include/"),
        "C++ headers of the sm_100 FMHA JIT kernels",
    ),
)
_MOE = re.compile(r"^vllm/_moe_C_stable_libtorch\.abi3\.so$")
_VERSIONED_EXT = re.compile(r"\.cpython-(\d+)-[^/]*\.so$")
# Without these vLLM does not start on a CUDA host: platform detection imports pynvml
# (else it falls back to an unspecified platform and fails later), the CUDA platform
# imports _C_stable_libtorch, and model code imports the flash-attention wrapper and
# its extension.
_REQUIRED = (
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/third_party/pynvml.py",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/vllm_flash_attn/__init__.py",
)
KERNELS = "vllm/_exl3_C.abi3.so"

_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (e.g. 60MB, 64MiB, 1000000)"
        )
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"part size must be positive: {text!r}")
    return size


def drop_reason(path: str, pyver: str, with_moe: bool) -> str | None:
    """Why a wheel member stays out of the bundle, or None to keep it."""
    for rx, why in _DROPPED:
        if rx.search(path):
            return why
    if _MOE.search(path) and not with_moe:
        return "MoE extension (--without-moe)"
    m = _VERSIONED_EXT.search(path)
    if m and m.group(1) != pyver.replace(".", ""):
        return "extensions for other Python versions"
    return None


def trim_wheel(wheel: Path, out_dir: Path, pyver: str, with_moe: bool) -> Path:
    """The wheel without what serving does not need (same name, fresh RECORD)."""
    name = WheelName.parse(wheel.name)
    with zipfile.ZipFile(wheel) as zf:
        infos = zf.infolist()
    members = {i.filename for i in infos}
    missing = [r for r in _REQUIRED if r not in members]
    if missing:
        raise ToolError(
            f"{wheel.name} lacks {', '.join(missing)}; not a vLLM release-based build"
        )
    if KERNELS not in members:
        print(
            f"bundle: WARNING: {wheel.name} has no {KERNELS} (built with "
            "--no-kernels?); EXL3 "
            "layers will run the slow reference path"
        )
    dropped: dict[str, list[int]] = {}
    for i in infos:
        why = drop_reason(i.filename, pyver, with_moe)
        if why:
            dropped.setdefault(why, []).append(i.file_size)
    for why, sizes in dropped.items():
        print(
            f"bundle: leaving out {why}: {len(sizes)} file(s), {sum(sizes) / 1e6:.1f} "
            "MB"
        )
    with tempfile.TemporaryDirectory(prefix="vllm-exl3-trim-", dir=out_dir) as tmp:
        tree = Path(tmp) / "tree"
        unpack(wheel, tree, keep=lambda p: drop_reason(p, pyver, with_moe) is None)
        out = out_dir / name.filename
        write(tree, name, out)
    return out


def _platforms(machine: str) -> list[str]:
    # pip does not widen manylinux_2_28 to older glibc tags by itself; wheels built for
    # any glibc up to the release wheel's own (2.28) run on the host.
    return [f"manylinux_2_{v}_{machine}" for v in range(28, 16, -1)] + [
        f"manylinux2014_{machine}"
    ]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def download_deps(
    requirements: Path, dest: Path, pyver: str, machine: str
) -> list[Path]:
    """pip download (binary wheels only, no dependency resolution: the list is the
    closure)."""
    wanted = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ToolError(
                    f"{requirements}: {line!r} is not pinned as name==version"
                )
            wanted[_normalize(name)] = version.strip()
    dest.mkdir(parents=True, exist_ok=True)
    abi = "cp" + pyver.replace(".", "")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--no-deps",
        "--python-version",
        pyver,
        "--implementation",
        "cp",
        "--abi",
        abi,
        *[a for p in _platforms(machine) for a in ("--platform", p)],
        "-d",
        str(dest),
        "-r",
        str(requirements),
    ]
    print(
        f"bundle: downloading {len(wanted)} dependency wheels for {abi} {machine} into "
        f"{dest}"
    )
    r = subprocess.run(cmd, text=True, capture_output=True)
    if r.returncode != 0:
        raise ToolError(
            f"pip download failed (offline? a pin without a {abi} wheel?):\n"
            + (r.stderr or r.stdout)[-3000:]
        )
    found = {}
    for whl in dest.glob("*.whl"):
        w = WheelName.parse(whl.name)
        if wanted.get(_normalize(w.name)) == w.version:
            found[_normalize(w.name)] = whl
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ToolError(f"pip download left no wheel for: {', '.join(missing)}")
    return sorted(found.values())


def split(payload: Path, out_dir: Path, part_size: int) -> list[tuple[str, str, int]]:
    """Cut `payload` into PART_STEM01, 02, ... of at most part_size bytes: (name,
    sha256, size)."""
    parts = []
    with open(payload, "rb") as f:
        n = 1
        while chunk := f.read(part_size):
            name = f"{PART_STEM}{n:02d}"
            (out_dir / name).write_bytes(chunk)
            parts.append((name, hashlib.sha256(chunk).hexdigest(), len(chunk)))
            n += 1
    return parts


def installer(
    label: str, pyver: str, payload_sha: str, parts: list[tuple[str, str, int]]
) -> str:
    """install.sh for these parts (bundle_install.sh with its @PLACEHOLDERS@ filled)."""
    text = INSTALLER.read_text()
    for key, value in {
        "@LABEL@": label,
        "@PYVER@": pyver,
        "@PAYLOAD_SHA256@": payload_sha,
        "@PARTS@": "\n".join(f"  '{n} {s} {z}'" for n, s, z in parts),
        "@ENV_LINES@": "\n".join(
            f"  echo 'export {k}={v}'" for k, v in HOST_ENV.items()
        ),
    }.items():
        text = text.replace(key, value)
    return text


def make_bundle(
    wheel: Path,
    out_dir: Path,
    part_size: int,
    pyver: str,
    with_moe: bool,
    deps: list[Path],
) -> list[tuple[str, str, int]]:
    if out_dir.exists():
        ours = [
            p
            for p in out_dir.iterdir()
            if p.name.startswith(PART_STEM) or p.name == "install.sh"
        ]
        if len(ours) != len(list(out_dir.iterdir())):
            raise ToolError(
                f"{out_dir} holds files that are not a bundle's; choose another --out"
            )
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory(
        prefix="vllm-exl3-bundle-", dir=out_dir.parent
    ) as tmp:
        work = Path(tmp)
        trimmed = trim_wheel(wheel, work, pyver, with_moe)
        payload = work / "payload.tar"
        with tarfile.open(payload, "w", format=tarfile.PAX_FORMAT) as tar:
            for w in [trimmed, *deps]:
                info = tar.gettarinfo(str(w), arcname=f"wheels/{w.name}")
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(w, "rb") as f:
                    tar.addfile(info, f)
        parts = split(payload, out_dir, part_size)
        payload_sha = sha256_file(payload)
    script = out_dir / "install.sh"
    script.write_text(
        installer(WheelName.parse(wheel.name).version, pyver, payload_sha, parts)
    )
    script.chmod(0o755)
    return parts


def _default_wheel(dist: Path) -> Path:
    built = sorted(
        dist.glob(f"vllm-{VLLM_VERSION}+{BUILD_LABEL_PREFIX}*.whl"),
        key=lambda p: p.stat().st_mtime,
    )
    if not built:
        raise ToolError(
            f"no built wheel in {dist}; run `scripts/vllm-exl3 build` first "
            "(or pass --wheel)"
        )
    return built[-1]


def run(args: argparse.Namespace) -> int:
    wheel = args.wheel or _default_wheel(args.dist_dir)
    machine = "aarch64" if "aarch64" in WheelName.parse(wheel.name).tag else "x86_64"
    deps: list[Path] = []
    if not args.without_deps:
        pytag = "cp" + args.python_version.replace(".", "")
        deps = download_deps(
            args.requirements,
            args.cache_dir / "bundle-deps" / f"{pytag}-{machine}",
            args.python_version,
            machine,
        )
    out = args.out or args.dist_dir / f"bundle-{WheelName.parse(wheel.name).version}"
    parts = make_bundle(
        wheel, out, args.part_size, args.python_version, args.with_moe, deps
    )
    total = sum(z for _, _, z in parts)
    print(
        f"{out}: install.sh + {len(parts)} part(s), {total / 1e6:.1f} MB "
        f"({wheel.name} trimmed + {len(deps)} dependency wheels, Python "
        f"{args.python_version})"
    )
    for i, (name, _, size) in enumerate(parts, 1):
        extra = " + install.sh" if i == 1 else ""
        print(f"  transfer {i}: {name} ({size / 1e6:.1f} MB){extra}")
    print(
        "on the host, with all parts and install.sh in one directory: bash install.sh "
        "[DIR]"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bundle",
        help="offline bundle (built wheel, trimmed, + dependency wheels) in parts of a "
        "set size",
        description=(
            "Pack the built wheel (dist/, newest vllm-0.26.0+exl3*) without what "
            "serving does not "
            "need (FlashAttention-2, the Rust frontend, kernel headers; the MoE "
            "extension with --without-moe), plus binary wheels of the dependencies an "
            "offline GPU host lacks "
            "(bundle_requirements.txt), into parts of at most --part-size bytes each, "
            "with an "
            "install.sh that checks each part's sha256, reassembles and installs with "
            "`pip install --no-index --no-deps --target DIR`, then prints the "
            "environment to set."
        ),
    )
    p.add_argument(
        "--wheel",
        type=Path,
        help="the wheel to bundle (default: the newest build in dist/)",
    )
    p.add_argument(
        "--part-size",
        type=parse_size,
        default=parse_size(DEFAULT_PART_SIZE),
        help=f"largest part, e.g. 60MB, 64MiB (default {DEFAULT_PART_SIZE})",
    )
    p.add_argument(
        "--python-version",
        default=DEFAULT_PYTHON,
        help=f"the host's Python (default {DEFAULT_PYTHON})",
    )
    p.add_argument(
        "--without-moe",
        dest="with_moe",
        action="store_false",
        help="leave out _moe_C_stable_libtorch (40 MB): vLLM's MoE routing and "
        "kernels, which every MoE model needs, GPTQ or EXL3; for dense-only hosts",
    )
    p.add_argument(
        "--without-deps",
        action="store_true",
        help="only the vLLM wheel (the host has the dependencies)",
    )
    p.add_argument(
        "--requirements",
        type=Path,
        default=REQUIREMENTS,
        help="pinned dependency list (default: bundle_requirements.txt)",
    )
    p.add_argument(
        "--out", type=Path, help="output directory (default dist/bundle-<version>)"
    )
    p.add_argument(
        "--dist-dir", type=Path, default=ROOT / "dist", help="where built wheels are"
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="cache directory; dependency wheels are kept in <cache>/bundle-deps",
    )
    p.set_defaults(func=run)
