# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm-exl3 image` without building one: the architectures it takes, the commands it
runs (mmdebstrap, the chroot in its private mount namespace, umoci's configuration),
the lock it writes from pip's resolution, the record and the oci-archive it reads and
writes from a layout, its preflight, and the smoke test's verdicts on the outputs of
cuobjdump, pytest and `vllm serve --help`."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import tarfile
from pathlib import Path

import pytest
from vllm_exl3 import ToolError, image, image_smoke, kernels_build
from vllm_exl3.cli import build_parser
from vllm_exl3.kernels_build import (
    SOURCE_GLOBS,
    STABLE_SOURCES,
    TARGET_ARCHS,
    normalize_arch,
    op_schemas,
)
from vllm_exl3.repo import ROOT, VLLM_VERSION, WHEELS

# An OCI image tag (distribution spec).
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


@pytest.mark.parametrize(
    "arch,machine,debian_arch,sm",
    [
        ("12.0", "x86_64", "amd64", "120"),
        ("sm_120", "x86_64", "amd64", "120"),
        ("121", "aarch64", "arm64", "121"),
        ("12.1", "aarch64", "arm64", "121"),
        ("9.0", "x86_64", "amd64", "90a"),
    ],
)
def test_architectures_name_their_image(arch, machine, debian_arch, sm):
    target = image.resolve_target(arch)
    assert (target.machine, target.debian_arch, target.sm) == (machine, debian_arch, sm)
    assert target.name == f"vllm-exl3-sm{normalize_arch(arch)}"
    assert image_smoke.expected_sm(target.arch) == sm


@pytest.mark.parametrize("arch", ["8.6", "10.0"])
def test_an_architecture_without_an_image_is_refused_naming_the_images(arch):
    with pytest.raises(ToolError, match=r"no image for CUDA architecture") as e:
        image.resolve_target(arch)
    assert "12.0 (RTX PRO 6000 Blackwell)" in str(e.value)
    assert "12.1 (DGX Spark GB10)" in str(e.value)


def test_an_unknown_architecture_is_refused():
    with pytest.raises(ToolError, match="unrecognised CUDA architecture"):
        image.resolve_target("blackwell")


@pytest.mark.parametrize("target", image.IMAGE_TARGETS.values(), ids=str)
def test_every_image_has_a_release_wheel_and_a_tuned_architecture(target):
    assert target.machine in WHEELS
    assert normalize_arch(target.arch) in TARGET_ARCHS


def test_tag_is_a_name_and_a_valid_tag_naming_version_and_gpu():
    ref = image.image_tag(image.resolve_target("12.1"), "0123abcd.dirty")
    name, _, tag = ref.partition(":")
    assert name == "vllm-exl3" and TAG_RE.fullmatch(tag), ref
    assert tag == f"{VLLM_VERSION}-exl3.0123abcd.dirty-sm121"


def test_parser_defaults_and_exclusive_smoke_options(tmp_path):
    args = build_parser().parse_args(["image", "--arch", "12.1"])
    assert args.func is image.run
    assert not (args.archive or args.no_smoke or args.smoke_only or args.keep_rootfs)
    assert args.out_dir.name == "images" and args.jobs == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["image", "--arch", "12.1", "--no-smoke", "--smoke-only"]
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["image"])  # --arch is required


def test_mmdebstrap_builds_the_targets_machine_with_updates_and_security():
    cmd = image.mmdebstrap_command(
        image.resolve_target("12.1"), Path("/r"), "http://m/debian", "http://s/sec"
    )
    assert cmd[:4] == ["mmdebstrap", "--mode=root", "--variant=minbase", "--arch=arm64"]
    assert f"--include={','.join(image.BASE_PACKAGES)}" in cmd
    assert {"python3-venv", "python3-dev", "gcc"} <= set(image.BASE_PACKAGES)
    i = cmd.index("/r")
    assert cmd[i - 1] == image.SUITE
    assert cmd[i + 1 :] == [
        f"deb http://m/debian {image.SUITE} main",
        f"deb http://m/debian {image.SUITE}-updates main",
        f"deb http://s/sec {image.SUITE}-security main",
    ]


def _report_item(name: str, version: str, sha: str | None, url: str = "") -> dict:
    archive = {"hashes": {"sha256": sha}} if sha else {}
    return {
        "metadata": {"name": name, "version": version},
        "download_info": {
            "url": url or f"https://x/{name}.whl",
            "archive_info": archive,
        },
    }


def test_lock_pins_every_resolved_distribution_but_vllm_with_its_hash():
    report = {
        "install": [
            _report_item("vllm", "0.26.0", "a" * 64),
            _report_item("Torch", "2.11.0", "b" * 64),
            _report_item("typing_extensions", "4.15.0", "c" * 64),
        ]
    }
    assert image.lock_lines(report) == [
        f"torch==2.11.0 --hash=sha256:{'b' * 64}",
        f"typing-extensions==4.15.0 --hash=sha256:{'c' * 64}",
    ]


def test_lock_refuses_a_distribution_without_a_hash_naming_it():
    report = {"install": [_report_item("odd", "1.0", None, "https://x/odd-1.0.tar.gz")]}
    with pytest.raises(ToolError, match=r"odd 1\.0 \(https://x/odd-1\.0\.tar\.gz\)"):
        image.lock_lines(report)


def test_chroot_command_mounts_for_one_command_and_clears_the_environment():
    cmd = image.chroot_command(
        Path("/w/root fs"),
        ["/opt/vllm/bin/python", "-c", "print(1)"],
        {"A": "1", "PATH": "/bin"},
        {"/run/x": Path("/host/x")},
    )
    assert cmd[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    assert cmd[5:7] == ["sh", "-c"]
    script = cmd[7]
    mounts = script.split(" && ")
    assert mounts[:4] == [
        "mount -t proc proc '/w/root fs'/proc",
        "mount -t sysfs sysfs '/w/root fs'/sys",
        "mount --rbind /dev '/w/root fs'/dev",
        "mount --bind /etc/resolv.conf '/w/root fs'/etc/resolv.conf",
    ]
    assert mounts[4] == "mount --bind /host/x '/w/root fs'/run/x"
    assert mounts[5] == "exec chroot '/w/root fs' /usr/bin/env -i \"$@\""
    # "$@" = the environment assignments, then the command.
    assert cmd[8:] == [
        "sh",
        "A=1",
        "PATH=/bin",
        "/opt/vllm/bin/python",
        "-c",
        "print(1)",
    ]


def test_chroot_environment_is_the_venv_the_index_and_the_ca_only(monkeypatch):
    monkeypatch.setenv("LEAK", "1")
    env = image.chroot_env("/run/s", ca=True, index_url="https://idx/simple")
    assert env["PATH"].split(":")[0] == f"{image.VENV}/bin"
    assert env["PIP_INDEX_URL"] == "https://idx/simple"
    assert env["PIP_CERT"] == env["SSL_CERT_FILE"] == "/run/s/ca.crt"
    assert env["REQUESTS_CA_BUNDLE"] == "/run/s/ca.crt"
    assert "LEAK" not in env
    bare = image.chroot_env("/run/s", ca=False, index_url=None)
    assert not {"PIP_CERT", "PIP_INDEX_URL", "SSL_CERT_FILE"} & bare.keys()


def test_pip_check_fails_on_requirements_and_records_unknown_wheel_tags():
    assert image.pip_check_verdict("No broken requirements found.\n") == ([], [])
    # NVIDIA's aarch64 wheel records the tag manylinux2014_sbsa (pip 26.3's words).
    out = "nvidia-cusparselt-cu13 0.8.0 is not supported on this platform\n"
    assert image.pip_check_verdict(out) == ([], ["nvidia-cusparselt-cu13 0.8.0"])
    out += "torch 2.11.0 requires triton==3.6.0, which is not installed.\n"
    broken, unsupported = image.pip_check_verdict(out)
    assert broken == ["torch 2.11.0 requires triton==3.6.0, which is not installed."]
    assert unsupported == ["nvidia-cusparselt-cu13 0.8.0"]


def _options(args: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in args:
        key, _, value = a.partition("=")
        out.setdefault(key, []).append(value)
    return out


def test_config_serves_with_vllm_serve_on_the_targets_platform():
    target = image.resolve_target("12.1")
    opts = _options(image.oci_config_args(target, "0.26.0+exl3.abc", "abc"))
    assert opts["--architecture"] == ["arm64"] and opts["--os"] == ["linux"]
    assert opts["--config.entrypoint"] == [f"{image.VENV}/bin/vllm", "serve"]
    assert opts["--config.cmd"] == ["--help"]
    assert opts["--config.exposedports"] == [f"{image.PORT}/tcp"]
    env = dict(e.split("=", 1) for e in opts["--config.env"])
    assert env["PATH"].startswith(f"{image.VENV}/bin:")
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) == {"compute", "utility"}
    labels = dict(e.split("=", 1) for e in opts["--config.label"])
    assert labels["org.opencontainers.image.version"] == "0.26.0+exl3.abc"
    assert "DGX Spark GB10 (sm_121)" in labels["org.opencontainers.image.description"]


def _put_blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _layout(tmp_path: Path, tag: str = "t1") -> tuple[Path, dict]:
    layout = tmp_path / "layout"
    layers = [_put_blob(layout, b"layer-one"), _put_blob(layout, b"layer-2")]
    config = {
        "os": "linux",
        "architecture": "arm64",
        "history": [
            {"comment": "base"},
            {"comment": "config only", "empty_layer": True},
            {"comment": "venv"},
        ],
    }
    config_desc = _put_blob(layout, json.dumps(config).encode())
    manifest = {"schemaVersion": 2, "config": config_desc, "layers": layers}
    manifest_desc = _put_blob(layout, json.dumps(manifest).encode())
    manifest_desc["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(
        json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]})
    )
    return layout, {"manifest": manifest_desc, "config": config_desc, "layers": layers}


def test_record_reads_digest_platform_layers_and_size_from_the_layout(tmp_path):
    layout, blobs = _layout(tmp_path)
    record = image.layout_record(layout, "t1")
    assert record["digest"] == blobs["manifest"]["digest"]
    assert record["platform"] == "linux/arm64"
    assert [(la["size"], la["comment"]) for la in record["layers"]] == [
        (9, "base"),
        (7, "venv"),
    ]
    assert record["size"] == (
        blobs["manifest"]["size"] + blobs["config"]["size"] + 9 + 7
    )
    with pytest.raises(ToolError, match="0 manifests tagged 'other'"):
        image.layout_record(layout, "other")


def test_skopeo_must_read_the_recorded_digest_and_platform():
    record = {"digest": "sha256:aa", "platform": "linux/arm64"}
    seen = {"Digest": "sha256:aa", "Os": "linux", "Architecture": "arm64"}
    assert image.skopeo_verdict(seen, record) is None
    assert "sha256:bb" in image.skopeo_verdict({**seen, "Digest": "sha256:bb"}, record)
    assert "amd64" in image.skopeo_verdict({**seen, "Architecture": "amd64"}, record)


def test_archive_holds_the_layout_owned_by_root(tmp_path):
    layout, blobs = _layout(tmp_path)
    out = tmp_path / "image.oci.tar"
    image.write_oci_archive(layout, out)
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
        names = list(members)
        assert names[:2] == ["oci-layout", "index.json"]
        digest = blobs["layers"][0]["digest"].split(":")[1]
        blob = members[f"blobs/sha256/{digest}"]
        assert tar.extractfile(blob).read() == b"layer-one"
        assert all(m.uid == 0 and m.gid == 0 for m in members.values())
        assert blob.mode == 0o644 and members["blobs"].mode == 0o755
    assert not out.with_name(out.name + ".part").exists()


def test_a_folder_with_a_mount_under_it_is_never_deleted(tmp_path, monkeypatch):
    victim = tmp_path / "bundle"
    (victim / "rootfs" / "proc").mkdir(parents=True)
    monkeypatch.setattr(
        image, "mounts_under", lambda p: [str(victim / "rootfs" / "proc")]
    )
    with pytest.raises(ToolError, match="will not delete .*rootfs/proc"):
        image.remove_tree(victim)
    assert victim.is_dir()


def test_mounts_under_reads_this_namespaces_mount_table():
    assert "/proc" in image.mounts_under(Path("/proc"))


def _binfmt(tmp_path: Path, monkeypatch, text: str | None) -> None:
    d = tmp_path / "binfmt"
    d.mkdir()
    if text is not None:
        (d / "qemu-aarch64").write_text(text)
    monkeypatch.setattr(image, "BINFMT_MISC", d)
    monkeypatch.setattr(image, "host_machine", lambda: "x86_64")


@pytest.mark.parametrize(
    "entry,runs",
    [
        (
            "enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: PF",
            True,
        ),
        ("disabled\ninterpreter /x\nflags: PF\n", False),
        ("enabled\ninterpreter /x\nflags: P\n", False),  # chroot would need qemu inside
        (None, False),
    ],
)
def test_preflight_needs_a_fixed_binary_qemu_for_another_machine(
    tmp_path, monkeypatch, entry, runs
):
    _binfmt(tmp_path, monkeypatch, entry)
    problems = image.preflight(image.resolve_target("12.1"), smoke_only=True)
    qemu = [p for p in problems if "binfmt_misc" in p]
    assert (not qemu) == runs, problems
    if qemu:
        assert "qemu-user-static" in qemu[0]


def test_preflight_asks_for_nothing_foreign_for_this_machine(tmp_path, monkeypatch):
    _binfmt(tmp_path, monkeypatch, None)
    problems = image.preflight(image.resolve_target("12.0"), smoke_only=True)
    assert not [p for p in problems if "binfmt_misc" in p]


# The smoke test's verdicts, on the tools' real output formats.

LIST_ELF_121 = """\
ELF file    1: _exl3_C.abi3.1.sm_121.cubin
ELF file    2: _exl3_C.abi3.2.sm_121.cubin
"""


def test_device_code_passes_when_every_elf_image_is_the_gpus():
    ok, detail = image_smoke.device_code_verdict(LIST_ELF_121, "121")
    assert ok and detail == "2 ELF images, all sm_121"


def test_device_code_fails_on_another_architecture_or_none():
    mixed = LIST_ELF_121 + "ELF file    3: _exl3_C.abi3.3.sm_120.cubin\n"
    ok, detail = image_smoke.device_code_verdict(mixed, "121")
    assert not ok and "sm_120" in detail
    ok, detail = image_smoke.device_code_verdict(LIST_ELF_121, "120")
    assert not ok and "sm_121" in detail
    ok, detail = image_smoke.device_code_verdict("cuobjdump info: no ELF\n", "121")
    assert not ok and "no ELF image" in detail


def test_schema_verdict_names_missing_and_changed_ops():
    expected = {"a": "a(Tensor x) -> Tensor", "b": "b(int n) -> int"}
    assert image_smoke.schema_verdict(expected, dict(expected))[0]
    ok, detail = image_smoke.schema_verdict(expected, {"a": "a(Tensor y) -> Tensor"})
    assert not ok and "['b']" in detail and "['a']" in detail


@pytest.mark.parametrize(
    "rc,out,ok",
    [
        (0, "....\n1 passed, 3 deselected, 14 warnings in 143.54s (0:02:23)\n", True),
        (1, "1 failed in 3.0s\n", False),
        (0, "2 passed in 3.0s\n", False),  # not the one test asked for
        (5, "no tests ran in 0.1s\n", False),
        (0, "", False),
    ],
)
def test_fixture_verdict_wants_exactly_the_one_test_passed(rc, out, ok):
    assert image_smoke.pytest_verdict(rc, out)[0] is ok


def test_serve_help_verdict():
    assert image_smoke.serve_help_verdict(0, "usage: vllm serve [model_tag] ...")[0]
    assert not image_smoke.serve_help_verdict(1, "usage: vllm serve")[0]
    assert not image_smoke.serve_help_verdict(0, "RuntimeError: Failed to infer")[0]


def test_the_cpu_platform_plugin_is_found_as_vllm_looks_for_it(tmp_path):
    """The distribution the serve check writes declares vLLM's CPU platform in vLLM's
    plugin group, as importlib.metadata (vLLM's plugin loader) reads it."""
    image_smoke.write_platform_plugin(tmp_path)
    dists = list(importlib.metadata.distributions(path=[str(tmp_path)]))
    assert len(dists) == 1
    (entry,) = dists[0].entry_points.select(group="vllm.platform_plugins")
    assert entry.load()() == "vllm.platforms.cpu.CpuPlatform"


def test_smoke_checks_what_our_sources_define():
    """The op loaders the smoke test calls name ops our sources register, and its
    fixture test and repository files exist (a rename breaks this, not the image)."""
    sources = [p for pattern in SOURCE_GLOBS for p in STABLE_SOURCES.glob(pattern)]
    schemas = op_schemas(sources)
    assert set(image_smoke.OP_LOADERS) <= schemas.keys()
    assert {"exl3_linear", "exl3_reconstruct", "exl3_moe"} <= schemas.keys()
    path, _, node = image_smoke.FIXTURE_TEST.partition("::")
    test_file = ROOT / path
    function, _, param = node.partition("[")
    text = test_file.read_text()
    assert f"def {function}(" in text and f'"{param.rstrip("]")}"' in text
    for rel in image.SMOKE_TREE:
        assert (ROOT / rel).exists(), rel
    for module, function in image_smoke.OP_LOADERS.values():
        rel = Path("overlay", *module.split(".")).with_suffix(".py")
        assert f"def {function}(" in (ROOT / rel).read_text(), rel


# The kernels' build against the image's root for its machine (kernels_build's
# target_toolchain), on a stand-in root and toolkit: which compiler, headers and
# libraries each command names.


@pytest.fixture
def stand_in_root(tmp_path, monkeypatch) -> tuple[Path, Path]:
    cuda = tmp_path / "cuda"
    for header in ("cuda_runtime.h", "cublas_v2.h"):
        (cuda / "include").mkdir(parents=True, exist_ok=True)
        (cuda / "include" / header).touch()
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    monkeypatch.setattr(kernels_build, "find_nvcc", lambda: str(cuda / "bin" / "nvcc"))
    monkeypatch.setattr(kernels_build, "host_machine", lambda: "x86_64")
    monkeypatch.setattr(kernels_build.shutil, "which", lambda name: f"/usr/bin/{name}")
    root = tmp_path / "rootfs"
    site = root / "opt/vllm/lib/python3.11/site-packages"
    (root / "usr/include/python3.11").mkdir(parents=True)
    (site / "torch/include").mkdir(parents=True)
    (site / "nvidia/cu13/lib").mkdir(parents=True)
    for lib in (kernels_build.CUDART_SONAME, kernels_build.CUBLAS_SONAME):
        (site / "nvidia/cu13/lib" / lib).touch()
    return root, site


def test_cross_build_uses_the_cross_compiler_and_the_roots_libraries(stand_in_root):
    root, site = stand_in_root
    tc = kernels_build.target_toolchain(root, site, "aarch64")
    assert tc.cxx == tc.ccbin == "aarch64-linux-gnu-g++"
    cuda = Path(kernels_build.os.environ["CUDA_HOME"])
    assert tc.cuda_include == [str(cuda / "include"), str(cuda / "include/cccl")]
    assert tc.torch_include == site / "torch/include"
    assert tc.python_include == str(root / "usr/include/python3.11")
    cu, cpp = Path("k.cu"), Path("ops.cpp")
    (_, _, nvcc), (_, _, cxx) = kernels_build._compile_commands(
        tc, ["121"], Path("/obj"), [cu, cpp]
    )
    assert nvcc[1:3] == ["-ccbin", "aarch64-linux-gnu-g++"]
    assert "arch=compute_121,code=sm_121" in nvcc
    assert cxx[0] == "aarch64-linux-gnu-g++"
    i = cxx.index("-idirafter")
    assert cxx[i + 1] == str(root / "usr/include")  # Debian's multiarch pyconfig.h
    link = kernels_build._link_command(tc, ["121"], [Path("/obj/k.o")], Path("/x.so"))
    assert link[1:3] == ["-ccbin", "aarch64-linux-gnu-g++"]
    assert link[link.index("-cudart") + 1] == "none"
    lib = site / "nvidia/cu13/lib"
    assert link.index(f"-l:{kernels_build.CUDART_SONAME}") > link.index("/obj/k.o")
    assert f"-L{lib}" in link and f"-l:{kernels_build.CUBLAS_SONAME}" in link


def test_the_roots_own_machine_builds_with_this_machines_compiler(
    stand_in_root, monkeypatch
):
    root, site = stand_in_root
    monkeypatch.setenv("CXX", "g++-12")
    tc = kernels_build.target_toolchain(root, site, "x86_64")
    assert tc.cxx == tc.ccbin == "g++-12"


def test_the_dev_build_links_nvccs_own_runtime():
    tc = kernels_build.Toolchain(
        nvcc="nvcc",
        cxx="g++",
        cuda_include=[],
        torch_include=Path("/t/include"),
        torch_lib=Path("/t/lib"),
        python_include="/py",
        cublas_lib=Path("/c/libcublas.so.13"),
    )
    link = kernels_build._link_command(tc, ["90"], [Path("a.o")], Path("x.so"))
    assert link[:4] == ["nvcc", "-shared", "-cudart", "shared"]


def test_a_missing_cross_compiler_names_the_debian_package(stand_in_root, monkeypatch):
    root, site = stand_in_root
    monkeypatch.setattr(kernels_build.shutil, "which", lambda name: None)
    with pytest.raises(kernels_build.BuildError, match="g\\+\\+-aarch64-linux-gnu"):
        kernels_build.target_toolchain(root, site, "aarch64")


def test_a_root_without_torch_or_cuda_runtime_is_named(stand_in_root):
    root, site = stand_in_root
    (site / "nvidia/cu13/lib" / kernels_build.CUDART_SONAME).unlink()
    (root / "usr/include/python3.11").rmdir()
    with pytest.raises(kernels_build.BuildError) as e:
        kernels_build.target_toolchain(root, site, "aarch64")
    assert f"{kernels_build.CUDART_SONAME} is missing" in str(e.value)
    assert "0 python3.* header folders" in str(e.value)


@pytest.mark.parametrize(
    "rc, out, ok, detail",
    [
        (
            0,
            "ok   exl3_linear (CPU tensors): raised\nok   exl3_moe (CPU tensors): "
            "raised\nok   exl3_linear (fake CUDA tensors): raised\nok   exl3_moe (fake "
            "CUDA tensors): raised\nok   exl3_linear rules (fake CUDA tensors): 15 of "
            "15 bad inputs refused by name\n",
            True,
            "2 ops raise their named errors on CPU tensors and on fake CUDA tensors; "
            "exl3_linear: 15 of 15 bad inputs refused by name",
        ),
        (
            -11,
            "ok   exl3_embedding (CPU tensors): raised\n",
            False,
            "exit -11 after 1 check(s)",
        ),
        (
            1,
            "FAIL exl3_plan (CPU tensors): returned\n",
            False,
            "exit 1 after 0 check(s)",
        ),
    ],
)
def test_refusal_check_fails_when_an_op_crashes_or_misnames(
    monkeypatch, rc, out, ok, detail
):
    class Spec:
        origin = "/opt/vllm/lib/python3.11/site-packages/vllm/_exl3_C.abi3.so"

    monkeypatch.setattr(image_smoke.importlib.util, "find_spec", lambda name: Spec)
    calls = []
    monkeypatch.setattr(
        image_smoke,
        "_run",
        lambda cmd, cwd=None, env=None: calls.append(cmd) or (rc, out),
    )
    got_ok, got = image_smoke.check_refusals()
    assert got_ok is ok and detail in got
    assert calls[0][-2:] == ["vllm_exl3.testing.error_path", Spec.origin]
