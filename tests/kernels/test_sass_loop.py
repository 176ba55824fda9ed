# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/bench/sass_loop.py: the k loop of both trellis GEMMs found and counted in
their SASS. It looks kernels up by mangled name; when the dense kernel gained a
template parameter the lookup once found nothing and every count came out 0, which
silently dropped the decode term of bench_linear.py's speed of light. The compile test
needs nvcc and cuobjdump, no GPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from vllm_exl3 import kernels_build
from vllm_exl3.bench import sass_loop

DENSE = "_ZN9vllm_exl316exl3_gemm_kernelILi8ELi1ELi1ELb0ELb0EEEvNS_10GemmParamsE"
MOE = (
    "_ZN9vllm_exl320exl3_moe_gemm_kernelILi4ELi2ELi2ELNS_8MoeStageE1EEE"
    "vNS_13MoeGemmParamsE"
)
# A k loop of two stages (one HMMA each) after a loop without tensor instructions, and
# a longer tail loop starting later.
LISTING = f"""
        Function : {DENSE}
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   BRA 0x10 ;
        /*0030*/                   LOP3.LUT R4, R5, 0xff, RZ, 0xc0, !PT ;
        /*0040*/                   IMAD R6, R4, 0x3, RZ ;
        /*0050*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0060*/               @P0 PRMT R4, R5, 0x5410, R6 ;
        /*0070*/                   HMMA.16816.F32 R8, R12, R18, R8 ;
        /*0080*/              @!P1 BRA 0x30 ;
        /*0090*/                   LDS R4, [R2] ;
        /*00a0*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*00b0*/                   SHF.L.U32 R4, R4, 0x1, RZ ;
        /*00c0*/                   IADD3 R4, R4, 0x1, RZ ;
        /*00d0*/                   IADD3 R4, R4, 0x1, RZ ;
        /*00e0*/                   BRA 0x90 ;
        /*00f0*/                   EXIT ;
        Function : {MOE}
        /*0000*/                   EXIT ;
"""


def test_the_first_loop_with_tensor_instructions_is_counted():
    body = sass_loop.functions(LISTING)[DENSE]
    prof = sass_loop.loop_profile(body, stages=2, weights_per_stage=4)
    assert prof["loop_instructions"] == 6  # 0x30 .. 0x80
    assert prof["per_stage"] == 3 and prof["per_weight"] == 0.75
    assert prof["by_pipe"] == {"alu": 1, "fma": 0.5, "tensor": 1, "control": 0.5}
    assert sass_loop.loop_profile("/*0000*/ EXIT ;", 1, 32) == {}


def test_kernels_are_named_by_their_template_arguments():
    assert list(sass_loop.functions(LISTING)) == [DENSE, MOE]
    dense, moe = sass_loop.Kernel.parse(DENSE), sass_loop.Kernel.parse(MOE)
    assert dense == sass_loop.Kernel(False, 8, 1, 1, False, False, 0)
    assert dense.key == "4:1"
    assert moe.key == "moe:2:2:mt2:down"
    wg = sass_loop.Kernel.parse(
        "_ZN9vllm_exl321exl3_moe_wgmma_kernelILi8ELi1ELi8ELNS_8MoeStageE0EEEvNS_13MoeGemmParamsE"
    )
    assert wg.key == "moe:4:1:mt8:wgmma:gate_up"
    sk = sass_loop.Kernel.parse(
        "_ZN9vllm_exl316exl3_gemm_kernelILi8ELi0ELi16ELb1ELb1EEEvNS_10GemmParamsE"
    )
    assert sk.key == "4:0:mt16:wgmma:sk"
    assert sass_loop.Kernel.parse("_ZN9vllm_exl312other_kernelEv") is None


def test_stage_geometry_is_read_from_the_gemm_header():
    text = sass_loop.GEMM_HEADER.read_text()
    assert sass_loop.header_constant("kLoopStages", text) >= 1
    # 64 k x 128 columns over 256 threads.
    assert sass_loop.weights_per_thread_per_stage(text) == 32


def _toolchain_or_skip() -> None:
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("nvcc not available")
    try:
        kernels_build.find_cuobjdump()
    except kernels_build.BuildError:
        pytest.skip("cuobjdump not available")


def test_compiled_k_loops_are_found_and_counted(tmp_path: Path):
    _toolchain_or_skip()
    out = tmp_path / "sass.json"
    assert sass_loop.main(["--compile", "--bits", "4", "--json", str(out)]) == 0
    loops = json.loads(out.read_text())
    for cb in (0, 1, 2):
        for mt in (1, 2, 4, 8):
            suffix = "" if mt == 1 else f":mt{mt}"
            for key in (f"4:{cb}{suffix}", f"moe:4:{cb}{suffix}:gate_up"):
                loop = loops[key]
                # A 4-bit decode is 5.5-10 instructions per weight; the loop holds
                # its tensor instructions.
                assert 4.0 < loop["per_weight"] < 12.0, (key, loop)
                assert loop["by_pipe"].get("tensor", 0) > 0, (key, loop)
        # mma.sync issues one more MMA per 16 rows a block holds, so the per-weight
        # cost grows with the block; wgmma's tiers decode at one cost.
        moe = [
            loops[f"moe:4:{cb}{'' if m == 1 else f':mt{m}'}:down"] for m in (1, 2, 4, 8)
        ]
        costs = [m["per_weight"] for m in moe]
        assert costs == sorted(costs), costs
        assert loops[f"moe:4:{cb}:mt4:wgmma:down"]["per_weight"] < costs[3]
