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
# The tool's launcher, for tests that run it as a user would.
CLI = ROOT / "scripts" / "vllm-exl3"
