# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the repository's fixture checkpoints are (tests/fixtures/README.md says how
each was made). Tests run from a copy of vLLM's test tree (ci/test_vllm_harness.sh)
find them through the installed package, which points into this checkout."""

from ..repo import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
QWEN3_TINY = FIXTURES / "qwen3-tiny"
MOE_FIXTURES = FIXTURES / "moe"
TOKENIZER = QWEN3_TINY / "tokenizer"
# Qwen3.5 and Qwen3.5-MoE in the multimodal layout, converted by ExLlamaV3 1.6.5.
QWEN3_5 = FIXTURES / "qwen3_5"
# The tool's launcher, for tests that run it as a user would.
CLI = ROOT / "scripts" / "vllm-exl3"
