# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EXL3 checkpoints through vllm_runner (CUDA): the method is picked from config.json,
every quantized linear and the LM head run the CUDA kernel, and greedy generation
agrees with the reference codec's and with the unquantized model's. Without a GPU:
"exl3" is resolved by name and from a checkpoint's config.json, and a model's MLP
built with vLLM's own classes loads real EXL3 tensors and computes what the dense
weights they decode to compute.

The checkpoints are ExLlamaV3 conversions of one small Qwen3, in the directory named
by EXL3_TEST_MODELS_DIR: bf16/ (the original), exl3-4.0bpw/ (3INST codebook),
exl3-3.0bpw-mcg/ (MCG codebook) and tokenizer/ (shared by all three).

Run `pytest tests/quantization/test_exl3.py`.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import vllm.envs as envs
from safetensors.torch import load_file
from tests.models.utils import check_logprobs_close
from tests.quantization.utils import is_quant_method_supported
from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    get_quantization_config,
)
from vllm.model_executor.layers.quantization.exl3 import Exl3Config, reference
from vllm.model_executor.layers.quantization.exl3.kernels import (
    CudaExl3Kernel,
    ReferenceExl3Kernel,
)
from vllm.model_executor.layers.quantization.exl3.linear import (
    Exl3LinearMethod,
    Exl3LMHeadMethod,
)
from vllm.model_executor.models.qwen3 import Qwen3MLP
from vllm.platforms import current_platform

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

needs_models = pytest.mark.skipif(
    MODELS_DIR is None, reason="EXL3_TEST_MODELS_DIR names no checkpoint directory."
)
needs_cuda = pytest.mark.skipif(
    not is_quant_method_supported("exl3"),
    reason="EXL3 needs a CUDA GPU of compute capability 8.0 or newer.",
)


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


@needs_cuda
@needs_models
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


# Without a GPU: the registry, the config from a checkpoint, and a layer on the CPU.

HIDDEN, INTERMEDIATE = 256, 768
# 4 decoder layers x 7 linears + lm_head.
CHECKPOINT_MODULES = 4 * 7 + 1


@pytest.fixture
def cpu_dist_init(tmp_path):
    """`dist_init` on any machine: a CPU VllmConfig and a gloo world of size 1.

    vLLM's own fixture builds a default VllmConfig and an NCCL world, both of which
    need a GPU. Layers must be built inside (their parameters read the tensor-parallel
    rank).
    """
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tmp_path / 'dist_init'}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        yield config
    cleanup_dist_env_and_memory()


def test_exl3_is_registered():
    assert "exl3" in QUANTIZATION_METHODS
    config_cls = get_quantization_config("exl3")
    assert config_cls is Exl3Config
    assert config_cls.get_name() == "exl3"
    assert config_cls.get_min_capability() == 80
    assert config_cls.get_config_filenames() == ["quantization_config.json"]
    if not current_platform.is_cuda_alike():
        assert not is_quant_method_supported("exl3")


@needs_models
@pytest.mark.parametrize("model", QUANTIZED)
def test_exl3_resolved_from_checkpoint(model, tmp_path):
    root = Path(MODELS_DIR)
    for f in [*(root / model).iterdir(), *(root / "tokenizer").iterdir()]:
        (tmp_path / f.name).symlink_to(f.resolve())
    model_config = ModelConfig(model=str(tmp_path), dtype="bfloat16")
    assert model_config.quantization == "exl3"
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig(device="cpu")
    )
    quant_config = vllm_config.quant_config
    assert isinstance(quant_config, Exl3Config)
    assert len(quant_config.modules) == CHECKPOINT_MODULES


def _dense(tensors: dict[str, torch.Tensor], config: Exl3Config, prefix: str):
    """W float64 [k, n] (y = x @ W) of a checkpoint module, decoded by the reference."""
    return reference.reconstruct(
        tensors[f"{prefix}.trellis"],
        tensors[f"{prefix}.suh"],
        tensors[f"{prefix}.svh"],
        int(config.modules[prefix].codebook),
        dtype=torch.float64,
    )


@needs_models
@pytest.mark.parametrize("model", QUANTIZED)
def test_exl3_mlp_on_cpu(cpu_dist_init, model):
    ckpt = Path(MODELS_DIR) / model
    tensors = load_file(str(ckpt / "model.safetensors"))
    config = Exl3Config.from_config({"quant_method": "exl3"})
    config.maybe_update_config(str(ckpt))
    prefix = "model.layers.1.mlp"
    mlp = Qwen3MLP(HIDDEN, INTERMEDIATE, "silu", quant_config=config, prefix=prefix)

    # What Qwen3's load_weights does: gate and up go to the merged layer as shards 0 and
    # 1.
    for layer, module, shard_id in [
        (mlp.gate_up_proj, "gate_proj", 0),
        (mlp.gate_up_proj, "up_proj", 1),
        (mlp.down_proj, "down_proj", None),
    ]:
        for name, loaded in tensors.items():
            owner, _, suffix = name.rpartition(".")
            if owner == f"{prefix}.{module}":
                param = getattr(layer, suffix)
                args = () if shard_id is None else (shard_id,)
                param.weight_loader(param, loaded, *args)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        assert isinstance(layer.quant_method, Exl3LinearMethod)
        layer.quant_method.process_weights_after_loading(layer)
        assert isinstance(layer.quant_method.kernel, ReferenceExl3Kernel)

    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(0))
    # On CPU vLLM compiles its native SiluAndMul with inductor (a C++ build: 18 s on
    # the CI machine, 70 s on a GPU host's first use); eager runs the same math.
    with torch.compiler.set_stance("force_eager"):
        y = mlp(x)

    gate, up, down = (
        _dense(tensors, config, f"{prefix}.{m}")
        for m in ("gate_proj", "up_proj", "down_proj")
    )
    xd = x.double()
    expected = (F.silu(xd @ gate) * (xd @ up)) @ down
    assert y.dtype == torch.float32 and y.shape == expected.shape
    torch.testing.assert_close(
        y.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max()
    )
