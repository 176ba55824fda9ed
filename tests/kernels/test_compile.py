# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CI (no GPU): every EXL3 CUDA source compiles for the architectures the kernels are
tuned for, sm_90 (as sm_90a), sm_120 and sm_121, with the local nvcc, and the Hopper
wgmma engine compiles without ptxas serializing its MMAs; the architectures only built
(sm_80, sm_86, sm_89, sm_100) compile a unit of each kernel.

Compile only (objects, no link), through the same quick-build script that makes
vllm/_exl3_C.abi3.so, against the venv's torch 2.11 stable-ABI headers, into the folder
`scripts/vllm-exl3 build` uses: objects that `build` compiled for the same architectures
are reused (and the other way round), so `build` followed by `ci/test.sh` compiles the
kernels once. The whole set for the three architectures compiled in 164 s on 2 shared
cores (measured 2026-11-30, nvcc 13.0), well inside CI's 20-minute budget, so every
translation unit is compiled for every architecture.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_exl3 import cxx_runtime, kernels_build, repo
from vllm_exl3.codec import exl3_format

ARCHS = [kernels_build.dotted(a) for a in kernels_build.TARGET_ARCHS]
# The ops the extension registers (torch.ops._C.exl3_*).
EXL3_OPS = (
    "exl3_embedding",
    "exl3_linear",
    "exl3_moe",
    "exl3_moe_reconstruct",
    "exl3_plan",
    "exl3_reconstruct",
    "exl3_sparse_mla_decode",
    "exl3_time_plans",
)
# Built, never run and not tuned for (README).
UNTUNED_ARCHS = sorted(
    set(kernels_build.BUILT_ARCHS) - set(kernels_build.TARGET_ARCHS), key=int
)


def ptxas_report(src: Path, arch: str, out: Path, include: bool = True) -> str:
    """ptxas's verbose report (stderr) of compiling `src` to a cubin for `arch` with the
    quick build's flags; fails the test with the tail of it when nvcc fails."""
    flags = [f for f in kernels_build.NVCC_FLAGS if f not in ("-Xcompiler", "-fPIC")]
    r = subprocess.run(
        [
            "nvcc",
            *flags,
            "-cubin",
            f"-arch={arch}",
            *([f"-I{kernels_build.SOURCES}"] if include else []),
            "-Xptxas",
            "-v",
            str(src),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


@pytest.mark.slow
def test_all_sources_compile_for_every_arch() -> None:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    obj_dir = kernels_build.build_extension(
        kernels_build.DEFAULT_OUT, ARCHS, jobs=os.cpu_count() or 1, compile_only=True
    )
    sources = kernels_build.sources(kernels_build.DEFAULT_OUT, with_standalone=False)
    for src in sources:
        obj = obj_dir / f"{src.name}.o"
        assert obj.is_file() and obj.stat().st_size > 0, obj
        assert not kernels_build._stale(obj, src), f"{obj} is older than the sources"


@pytest.mark.slow
def test_every_op_refuses_bad_input_through_the_stable_abi() -> None:
    """The objects above linked into the quick build's extension: each op's CUDA kernel,
    called on CPU tensors, and on fake CUDA tensors that pass its device checks, raises
    an error naming the op back through the stable ABI's boxing
    (vllm_exl3.testing.error_path); a process that dies fails (a refusal path that
    crashes was seen once in a library built otherwise)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    lib = kernels_build.build_extension(
        kernels_build.DEFAULT_OUT, ARCHS, jobs=os.cpu_count() or 1
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_exl3.testing.error_path",
            str(lib),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("ok ")]
    # exl3_linear's rules one by one (exl3_oracle.check_errors on fake CUDA tensors).
    rules = [line for line in lines if line.startswith("ok   exl3_linear rules")]
    assert len(rules) == 1 and "bad inputs refused by name" in rules[0], r.stdout
    lines.remove(rules[0])
    cpu = [line for line in lines if "(CPU tensors)" in line]
    fake = [line for line in lines if "(fake CUDA tensors)" in line]
    assert len(cpu) == len(fake) == len(EXL3_OPS) == len(lines) / 2, r.stdout
    assert all(" must be a CUDA tensor" in line for line in cpu), r.stdout
    # Past the device checks: refused by a later rule, still by name.
    assert not any(" must be a CUDA tensor" in line for line in fake), r.stdout


@pytest.mark.slow
def test_a_static_libstdcxx_is_caught_at_link_and_by_error_path(tmp_path: Path) -> None:
    """The same objects linked with a static libstdc++ (what the GPU host's compiler
    wrapper did to the whole-target library): the build's check refuses the library, and
    error_path, run on it anyway, fails every op, since each refusal is cut at its first
    number (the line of its check) and names no rule."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    kernels_build.build_extension(
        kernels_build.DEFAULT_OUT, ARCHS, jobs=os.cpu_count() or 1
    )
    tc = kernels_build.find_toolchain()
    archs, out_dir, obj_dir = kernels_build._object_dir(
        kernels_build.DEFAULT_OUT, ARCHS
    )
    objects = [
        o
        for _, o, _ in kernels_build._compile_commands(
            tc, archs, obj_dir, kernels_build.sources(out_dir)
        )
    ]
    lib = tmp_path / kernels_build.EXTENSION
    with pytest.raises(kernels_build.BuildError, match="linked libstdc\\+\\+ into it"):
        kernels_build.link_extension(
            tc, archs, objects, lib, host_link_flags=("-static-libstdc++",)
        )
    assert cxx_runtime.LIBSTDCXX not in cxx_runtime.needed_libraries(lib)
    r = subprocess.run(
        [sys.executable, "-m", "vllm_exl3.testing.error_path", str(lib)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    calls = [line for line in r.stdout.splitlines() if "tensors):" in line]
    assert len(calls) == 2 * len(EXL3_OPS) + 1, r.stdout
    assert all(line.startswith("FAIL") for line in calls), r.stdout


def test_one_generated_unit_per_rate_of_the_format(tmp_path: Path) -> None:
    """The generator's rates are the format's (every valid bitrate has its kernels, no
    other), one translation unit each, and a second run leaves unchanged units alone
    (their objects stay fresh) while removing a rate no longer built."""
    gen = repo.kernel_generator()
    assert sorted(gen.RATES) == sorted(int(2 * b) for b in exl3_format.VALID_BITS)
    (tmp_path / "exl3_rate_k9.cu").write_text("// a rate no longer built\n")
    written = gen.write_build_sources(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        [gen.rate_unit_name(k2) for k2 in gen.RATES] + [gen.RATE_TABLE]
    )
    assert sorted(p.name for p in written) == names
    for k2 in gen.RATES:
        unit = (tmp_path / gen.rate_unit_name(k2)).read_text()
        assert f"EXL3_DEFINE_RATE({k2})" in unit
        assert f"EXL3_DEFINE_MOE_RATE({k2})" in unit
        table = (tmp_path / gen.RATE_TABLE).read_text()
        assert f"return rate_kernels_k{k2}();" in table
        assert f"return moe_rate_kernels_k{k2}();" in table
    mtimes = {p: p.stat().st_mtime_ns for p in written}
    os.utime(written[0], ns=(1, 1))
    gen.write_build_sources(tmp_path)
    assert written[0].stat().st_mtime_ns == 1
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items() if p != written[0])


def test_build_and_this_test_share_one_object_folder() -> None:
    from vllm_exl3 import build

    assert build.KERNEL_BUILD_DIR == kernels_build.DEFAULT_OUT


def test_arch_names_normalise() -> None:
    assert [
        kernels_build.normalize_arch(a) for a in ("9.0", "sm_120", "12.1", "90")
    ] == ["90", "120", "121", "90"]
    with pytest.raises(kernels_build.BuildError):
        kernels_build.normalize_arch("hopper")


def test_hopper_builds_carry_the_arch_specific_features() -> None:
    assert kernels_build.gencode_flags(["90", "120"]) == [
        "-gencode",
        "arch=compute_90a,code=sm_90a",
        "-gencode",
        "arch=compute_120,code=sm_120",
    ]


@pytest.mark.slow
def test_wgmma_engine_is_not_serialized(tmp_path: Path) -> None:
    """ptxas silently serializes a wgmma (waits for it before the next instruction) when
    it cannot prove the asynchronous operands are left alone, and says so only as an
    info line (C7513); every tier of the engine must compile without it, without spills,
    and within the register budget its occupancy assumes (GemmShape::kMinBlocks: 1 block
    of 256 threads at 256 tokens, 2 at 128, 3 at 64), in both its grids (classic;
    stream-k at 128 and 256)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    src = tmp_path / "wgmma_tiers.cu"
    src.write_text(
        '#include "exl3_gemm.cuh"\nnamespace vllm_exl3 {\n'
        + "".join(
            f"template __global__ void exl3_gemm_kernel<{k2}, {cb}, {mt}, true, {sk}>"
            "(const __grid_constant__ GemmParams);\n"
            for k2, cb in ((4, 1), (8, 0), (8, 1), (8, 2), (5, 2), (12, 1))
            for mt in (4, 8, 16)
            for sk in (("false", "true") if mt >= 8 else ("false",))
        )
        + "}\n"
    )
    err = ptxas_report(src, "sm_90a", tmp_path / "w.cubin")
    assert "C7513" not in err and "serialized" not in err, err[-3000:]
    entries = re.findall(
        r"Compiling entry function '(\S+)'.*?Used (\d+) registers([^\n]*)",
        err,
        re.S,
    )
    assert len(entries) == 30, err[-3000:]
    for name, regs, rest in entries:
        mt = int(re.search(r"ELi(\d+)ELb1E", name).group(1))
        budget = {4: 85, 8: 128, 16: 255}[mt]
        assert int(regs) <= budget and "stack" not in rest, (name, regs, rest)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120", "sm_121"])
def test_moe_grouped_gemm_does_not_spill(tmp_path: Path, arch: str) -> None:
    """The grouped MoE GEMM runs the dense k loop with the routed-row epilogues: at the
    widest windows (1.5, 3.5 and 8 bits) every codebook x tier x stage fits its register
    budget (kMoeMinBlocks) without local memory, on mma.sync and, for the 64- and
    128-row tiers, on wgmma (sm_90a; a trap elsewhere), whose MMAs ptxas must not
    serialize (C7513) and whose registers stay within the dense wgmma tiers' budget
    (3 blocks of 256 threads at 64 rows, 2 at 128)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    gen = repo.kernel_generator()
    gen.write_build_sources(tmp_path)
    for k2 in (3, 7, 16):
        src = tmp_path / gen.rate_unit_name(k2)
        err = ptxas_report(src, arch, tmp_path / f"moe{k2}.cubin")
        assert "C7513" not in err and "serialized" not in err, err[-3000:]
        entries = re.findall(
            r"Compiling entry function '(\S*exl3_moe_(?:gemm|wgmma)\S*)'.*?"
            r"(\d+) bytes stack frame, (\d+) bytes spill stores.*?Used (\d+) registers",
            err,
            re.S,
        )
        # MUL1 only at the half rates; per codebook, 4 tiers x 2 stages on mma.sync
        # and 2 tiers x 2 stages on wgmma.
        codebooks = 1 if k2 % 2 else 3
        assert len(entries) == codebooks * (8 + 4), err[-3000:]
        wgmma = [e for e in entries if "exl3_moe_wgmma" in e[0]]
        assert len(wgmma) == codebooks * 4, entries
        for name, stack, spills, regs in entries:
            assert int(stack) == 0 and int(spills) == 0, (name, stack, spills, regs)
        for name, _, _, regs in wgmma:
            mt = int(re.search(r"ELi(\d+)ELNS_8MoeStage", name).group(1))
            assert int(regs) <= {4: 85, 8: 128}[mt], (name, regs)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120", "sm_121"])
def test_original_basis_reconstructs_fit_without_spills(
    tmp_path: Path, arch: str
) -> None:
    """The dense original-basis reconstruct and the MoE one (W^T) hold a Hadamard
    pass's fp32 accumulators in registers: at the narrowest and widest windows, every
    codebook of 4 bits and both output dtypes, neither uses local memory on any target
    (kReconOriginalMinBlocks: 80 registers on sm_90, 128 on sm_12x)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    cases = [(2, 1), (3, 2), (8, 0), (8, 1), (8, 2), (16, 1)]
    src = tmp_path / "reconstructs.cu"
    src.write_text(
        '#include "exl3_moe.cuh"\n#include "exl3_rate_instance.cuh"\n'
        "namespace vllm_exl3 {\n"
        + "".join(
            f"template __global__ void {kernel}<{k2}, {cb}, {t}>({params});\n"
            for k2, cb in cases
            for t in ("__half", "__nv_bfloat16")
            for kernel, params in (
                ("exl3_reconstruct_original_kernel", "ReconParams"),
                ("exl3_moe_reconstruct_kernel", "MoeReconParams"),
            )
        )
        + "}\n"
    )
    err = ptxas_report(src, arch, tmp_path / "r.cubin")
    entries = re.findall(
        r"Compiling entry function '(\S*reconstruct\S*)'.*?"
        r"(\d+) bytes stack frame, (\d+) bytes spill stores.*?Used (\d+) registers",
        err,
        re.S,
    )
    assert len(entries) == 4 * len(cases), err[-3000:]
    for name, stack, spills, regs in entries:
        assert int(stack) == 0 and int(spills) == 0, (name, stack, spills, regs)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120", "sm_121"])
def test_sparse_mla_kernels_fit_without_spills(tmp_path: Path, arch: str) -> None:
    """The sparse-MLA decode kernels (bf16 576 / 512, fp8_ds_mla; 16 and 32 heads a
    CTA, the latter also with Hopper's deep pipeline; Hopper's wgmma path, a trap
    elsewhere) and the split-k combine compile for every target without local memory
    (the portable shared-memory layouts fit sm_12x's 99 KB per block, the deep and
    wgmma ones Hopper's 227 KB: static_asserts of the header), and ptxas serializes
    none of the wgmma path's MMAs (C7513)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    sources = kernels_build.SPARSE_MLA_SOURCES
    entries = []
    for unit in ("exl3_sparse_mla_bf16.cu", "exl3_sparse_mla_fp8.cu"):
        err = ptxas_report(
            sources / unit, arch, tmp_path / f"{unit}.cubin", include=False
        )
        assert "warning" not in err.lower(), err[-3000:]
        assert "C7513" not in err and "serialized" not in err, err[-3000:]
        entries += re.findall(
            r"Compiling entry function '(\S*sparse_mla\S*)'.*?"
            r"(\d+) bytes stack frame, (\d+) bytes spill stores.*?Used (\d+) registers",
            err,
            re.S,
        )
    # bf16 576 / 512 and fp8_ds_mla, each with one head tile, two head tiles, two
    # head tiles deep and the wgmma path, and the combine
    assert len(entries) == 13, entries
    assert sum("wgmma" in name for name, *_ in entries) == 3, entries
    for name, stack, spills, regs in entries:
        assert int(stack) == 0 and int(spills) == 0, (name, stack, spills)
        assert int(regs) <= 255, (name, regs)


@pytest.mark.slow
@pytest.mark.parametrize("arch", UNTUNED_ARCHS)
def test_untuned_architectures_compile(tmp_path: Path, arch: str) -> None:
    """An architecture the full build compiles but the kernels are not tuned for gets
    a whole image: the 1.5-bit rate unit (dense and MoE GEMMs, reconstructs), both
    sparse-MLA units and the shared wgmma probe compile for it, and the sparse-MLA
    kernels and the GEMMs keep their registers (no local memory), as on the tuned
    targets. (ptxas spills a few bytes in the original-basis reconstructs on sm_100,
    whose register cap is sm_90's; untuned, not measured.)"""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not available")
    gen = repo.kernel_generator()
    gen.write_build_sources(tmp_path)
    units = [
        tmp_path / gen.rate_unit_name(3),
        kernels_build.SPARSE_MLA_SOURCES / "exl3_sparse_mla_bf16.cu",
        kernels_build.SPARSE_MLA_SOURCES / "exl3_sparse_mla_fp8.cu",
        kernels_build.STABLE_SOURCES / "exl3_mma.cu",
    ]
    entries = []
    for unit in units:
        err = ptxas_report(unit, f"sm_{arch}", tmp_path / f"{unit.stem}.cubin")
        entries += re.findall(
            r"Compiling entry function '(\S+)'.*?"
            r"(\d+) bytes stack frame, (\d+) bytes spill stores",
            err,
            re.S,
        )
    kept = [e for e in entries if "gemm" in e[0] or "sparse_mla" in e[0]]
    assert len(kept) > 13, entries  # the 13 sparse-MLA kernels and the GEMMs
    for name, stack, spills in kept:
        assert int(stack) == 0 and int(spills) == 0, (name, stack, spills)
