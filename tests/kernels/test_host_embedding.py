# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The quantized token embedding's CUDA decode (exl3_embedding.cuh), compiled for the
host by a small driver (embedding_host.cu next to this module), against the reference
(embedding_reference.py), bit for bit in fp32.

The driver runs every lane's own code (symbol extraction around the ring, the state
recurrence, the MUL1 codebook through the linear's decode_pair, the scale, the in-lane
butterflies, the normalisation and the signs) and emulates only the cross-lane
butterflies, which the kernel does with warp shuffles; those, and the row gather itself,
are left to the GPU test (overlay/tests/kernels/quantization/test_exl3_embedding.py).
Needs nvcc (host compile only), no GPU.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm_exl3.codec import embedding_reference

GROUPS = 6  # random groups per rate: lane 0's ring wrap and the last lanes in each
GROUP = 256


@pytest.fixture(scope="module")
def driver(host_driver) -> Path:
    return host_driver("embedding_host.cu")


@pytest.mark.parametrize("bits", range(1, 9))
def test_group_decode_matches_reference(driver: Path, tmp_path: Path, bits: int):
    gen = torch.Generator().manual_seed(bits)
    words = 1 + 16 * bits
    rings = torch.randint(
        -32768, 32768, (GROUPS, words), generator=gen, dtype=torch.int32
    ).to(torch.int16)
    # Scales of every sign and magnitude an embedding has, and one zero (a padding row).
    scales = torch.randn(GROUPS, generator=gen) * 0.02
    scales[-1] = 0.0
    rings[:, 0] = scales.half().view(torch.int16)
    signs = (torch.randint(0, 2, (GROUPS, GROUP), generator=gen) * 2 - 1).half()
    rings.numpy().tofile(tmp_path / "rings.bin")
    signs.numpy().tofile(tmp_path / "signs.bin")
    subprocess.run(
        [
            str(driver),
            str(bits),
            str(GROUPS),
            str(tmp_path / "rings.bin"),
            str(tmp_path / "signs.bin"),
            str(tmp_path / "out.bin"),
        ],
        check=True,
        capture_output=True,
    )
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype="<f4"))
    want = embedding_reference.decode_rings(rings, signs, bits).reshape(-1)
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {got.numel()} values differ at {bits} bits, first at "
        f"(group, element) {divmod(int(bad[0]), GROUP)}: {got[bad[0]].item()} vs "
        f"{want[bad[0]].item()}"
    )
    assert torch.all(want[-GROUP:] == 0)  # the zero-scale group decodes to zeros
