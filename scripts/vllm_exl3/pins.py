# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What this series is pinned to. Hashes were computed locally on the downloaded files
and agree with the package index's published sha256; a file that hashes differently is
refused."""

VLLM_VERSION = "0.26.0"

SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502"

# Official release wheels, by machine (platform.machine()). The quick build starts from
# these.
WHEELS = {
    "x86_64": (
        f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl",
        "adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de",
    ),
    # Downloaded once on 2026-11-30 (for docker/): it hashes to the index's published
    # sha256.
    "aarch64": (
        f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_aarch64.whl",
        "52a4c3e55c2c80cc8793e52ccc244457ceade25b0ad7caa1c15e5002a95a1b2c",
    ),
}
