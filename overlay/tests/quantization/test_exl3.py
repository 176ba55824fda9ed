# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EXL3 checkpoints through vllm_runner: the method is picked from config.json,
every quantized linear and the LM head run the CUDA kernel, and greedy generation
agrees with the reference codec's and with the unquantized model's.

The checkpoints are ExLlamaV3 conversions of one small Qwen3, in the directory named
by EXL3_TEST_MODELS_DIR: bf16/ (the original), exl3-4.0bpw/ (3INST codebook),
exl3-3.0bpw-mcg/ (MCG codebook) and tokenizer/ (shared by all three).

Run `pytest tests/quantization/test_exl3.py`.
"""

import os
from pathlib import Path

import pytest
import vllm.envs as envs
from tests.models.utils import check_logprobs_close
from tests.quantization.utils import is_quant_method_supported
from vllm.model_executor.layers.quantization.exl3.kernels import (
    CudaExl3Kernel,
    ReferenceExl3Kernel,
)
from vllm.model_executor.layers.quantization.exl3.linear import (
    Exl3LinearMethod,
    Exl3LMHeadMethod,
)

MODELS_DIR = os.environ.get("EXL3_TEST_MODELS_DIR")
QUANTIZED = ["exl3-4.0bpw", "exl3-3.0bpw-mcg"]
# 4 decoder layers x (qkv, o, gate_up, down) + lm_head.
EXL3_LAYERS = 4 * 4 + 1
# The model was trained on Python source; prompts it can continue.
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Node:\n    def __init__(self, value):\n",
    "    for i in range(len(items)):\n        if ",
]
MAX_TOKENS = 24
NUM_LOGPROBS = 5
MAX_MODEL_LEN = 512

pytestmark = [
    pytest.mark.skipif(
        not is_quant_method_supported("exl3"),
        reason="EXL3 needs a CUDA GPU of compute capability 8.0 or newer.",
    ),
    pytest.mark.skipif(
        MODELS_DIR is None, reason="EXL3_TEST_MODELS_DIR names no checkpoint directory."
    ),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Complete model directories: each checkpoint's files plus the shared tokenizer."""
    root = Path(MODELS_DIR)
    out = {}
    for name in ["bf16", *QUANTIZED]:
        dest = tmp_path_factory.mktemp(name)
        for f in [*(root / name).iterdir(), *(root / "tokenizer").iterdir()]:
            (dest / f.name).symlink_to(f.resolve())
        out[name] = str(dest)
    return out


@pytest.fixture(scope="module")
def bf16_outputs(vllm_runner, model_dirs):
    with vllm_runner(
        model_dirs["bf16"], dtype="bfloat16", max_model_len=MAX_MODEL_LEN
    ) as llm:
        return llm.generate_greedy_logprobs(PROMPTS, MAX_TOKENS, NUM_LOGPROBS)


@pytest.mark.parametrize("model", QUANTIZED)
def test_exl3_model(vllm_runner, model_dirs, bf16_outputs, model, monkeypatch):
    # `LLM.apply_model` pickles the function.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    def exl3_kernels(net) -> dict[str, str]:
        return {
            name: type(module.quant_method.kernel).__name__
            for name, module in net.named_modules()
            if isinstance(
                getattr(module, "quant_method", None),
                (Exl3LinearMethod, Exl3LMHeadMethod),
            )
        }

    # vLLM's defaults: the EXL3 ops traced by torch.compile, run in CUDA graphs.
    with vllm_runner(
        model_dirs[model], dtype="bfloat16", max_model_len=MAX_MODEL_LEN
    ) as llm:
        assert llm.llm.model_config.quantization == "exl3"
        (kernels,) = llm.apply_model(exl3_kernels)
        exl3_outputs = llm.generate_greedy_logprobs(PROMPTS, MAX_TOKENS, NUM_LOGPROBS)
    assert len(kernels) == EXL3_LAYERS, kernels
    assert set(kernels.values()) == {CudaExl3Kernel.__name__}, kernels

    # The same weights through the reference codec (plain PyTorch) as the oracle.
    monkeypatch.setenv("VLLM_EXL3_FORCE_REFERENCE", "1")
    envs.disable_envs_cache()
    with vllm_runner(
        model_dirs[model],
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
    ) as llm:
        (kernels,) = llm.apply_model(exl3_kernels)
        reference_outputs = llm.generate_greedy_logprobs(
            PROMPTS, MAX_TOKENS, NUM_LOGPROBS
        )
    assert set(kernels.values()) == {ReferenceExl3Kernel.__name__}, kernels

    check_logprobs_close(
        outputs_0_lst=reference_outputs,
        outputs_1_lst=exl3_outputs,
        name_0="reference",
        name_1="cuda_kernel",
    )
    check_logprobs_close(
        outputs_0_lst=bf16_outputs,
        outputs_1_lst=exl3_outputs,
        name_0="bf16",
        name_1=model,
    )
