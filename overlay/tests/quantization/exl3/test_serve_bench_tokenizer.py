# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The serving benchmark's tokenizer (scripts/e2e/serve_bench.py) against the API
server's own prompt checks, on the CPU.

The serving rows send `vllm bench serve --dataset-name random` prompts: runs of
consecutive ids of the model's vocabulary, decoded to text by the tokenizer the servers
share. The API server refuses, before tokenizing, a text of more characters than the
input tokens it allows times its tokenizer's longest token, so the prompt of the
longest words must pass that check and encode back to its ids; the random dataset's own
decode / re-encode must keep every prompt at its requested length.
"""

from __future__ import annotations

import pytest
from vllm.renderers.params import TokenizeParams
from vllm.tokenizers.registry import get_tokenizer
from vllm_exl3.e2e import serve_bench as sb

VOCAB = sb.QWEN3_VOCAB


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return get_tokenizer(str(sb.vocab_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)))


def test_longest_prompt_passes_the_api_servers_length_check(served):
    limits = TokenizeParams(
        max_total_tokens=sb.MAX_MODEL_LEN, max_output_tokens=sb.OUTPUT_LEN
    )
    longest = list(range(VOCAB - sb.INPUT_LEN, VOCAB))
    text = served.decode(longest)
    assert limits.apply_pre_tokenization(served, {"prompt": text})["prompt"] == text
    assert served(text, add_special_tokens=False).input_ids == longest


def test_random_dataset_prompts_keep_their_length(served):
    from vllm.benchmarks.datasets.datasets import RandomDataset

    requests = RandomDataset(random_seed=1006).sample(
        tokenizer=served,
        num_requests=8,
        input_len=sb.INPUT_LEN,
        output_len=sb.OUTPUT_LEN,
    )
    for r in requests:
        assert r.prompt_len == sb.INPUT_LEN
        assert len(served(r.prompt, add_special_tokens=False).input_ids) == sb.INPUT_LEN
