# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Patch 0012: a compiled artifact is keyed by the multimodal limits.

With every modality's limit at 0 the model runner takes the text-only path (input_ids);
with images allowed it passes inputs_embeds. Both runs of one checkpoint must not share
torch.compile's AOT artifact: the Qwen3.5 fixture run text-only and then with one image
per prompt failed in its first forward on the GPU before the limits were in the key.
"""

import shutil

import pytest


@pytest.fixture
def qwen3_5_dense(tmp_path):
    from vllm_exl3.testing.fixtures import QWEN3_5

    for src in (QWEN3_5 / "dense-exl3-4.0bpw", QWEN3_5 / "tokenizer"):
        for f in src.iterdir():
            shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_compiled_artifacts_are_keyed_by_the_multimodal_limits(qwen3_5_dense):
    from vllm.config import ModelConfig

    def key(**kwargs) -> str:
        config = ModelConfig(model=str(qwen3_5_dense), dtype="bfloat16", **kwargs)
        assert config.multimodal_config is not None
        return config.compute_hash()

    text_only = key(limit_mm_per_prompt={"image": 0, "video": 0})
    assert text_only == key(limit_mm_per_prompt={"image": 0, "video": 0})
    assert text_only != key(limit_mm_per_prompt={"image": 1, "video": 0})
    assert key(limit_mm_per_prompt={"image": 1, "video": 0}) != key(
        limit_mm_per_prompt={"image": 2, "video": 0}
    )
