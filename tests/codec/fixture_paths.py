# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the codec tests find the repository, its fixtures and the tools."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "qwen3-tiny"
TOKENIZER = FIXTURES / "tokenizer"
VAL_TEXT = FIXTURES / "val.txt"
CLI = REPO / "scripts" / "vllm-exl3"
# The two real ExLlamaV3 1.6.5 conversions: name -> (decoder bits, head bits, codebook
# name).
EXL3_FIXTURES = {
    "exl3-4.0bpw": (4, 6, "3inst"),
    "exl3-3.0bpw-mcg": (3, 6, "mcg"),
}
