# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The op wrappers, plans and warm-up without a GPU.

A spawned process registers a CPU stand-in for `_C::exl3_linear` /
`_C::exl3_reconstruct` (what the quick-build extension registers for CUDA), after which
the CUDA kernel class's path is live: `load_exl3_ops` finds the ops and registers the
fakes, and a real vLLM layer's `apply` traces under torch.compile (aot_eager: fake
tensors through the op, as Dynamo does in vLLM) to the reference result. The plan
settings and tables (exl3/plans.py, env_compat.py, ops.py): the VLLM_EXL3_PLAN parser
and its errors, the op's header, the per-device JSON table's loader and lookup, the
deprecated per-knob variables, the fake implementation of the new schema. Load-time
warm-up (exl3/plans.py) on vLLM's real layers: a kernel that runs plans is called once
per power-of-two token count up to the scheduler's budget, on zeros, once per distinct
layer configuration, with the layer's own shapes; the memory cap stops the walk;
kernels that do not tune (the reference) are never called.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from vllm.model_executor.layers.quantization.exl3 import kernels, ops, plan_table, plans
from vllm.model_executor.layers.quantization.exl3.env_compat import (
    adopt_deprecated_env_names,
)
from vllm.model_executor.layers.quantization.exl3.plans import (
    Exl3PlanError,
    PlanPins,
    parse_plan_setting,
)

from .exl3_harness import CKPT_3INST, config_for, tensors
from .test_exl3_linear import ATTN, HIDDEN, finish, load_qkv, qkv_layer

SCHEMAS = (
    "exl3_linear(Tensor x, Tensor trellis, Tensor suh, Tensor svh, Tensor? bias, "
    "int[] shard_widths, int codebook, int[] plans, Tensor workspace) -> Tensor",
    "exl3_reconstruct(Tensor trellis, int codebook) -> Tensor",
    "exl3_plan(Tensor trellis, int shards, int codebook, bool bf16, int m, int[] "
    "plans, "
    "int workspace_floats) -> int[]",
    "exl3_time_plans(Tensor x, Tensor trellis, Tensor suh, Tensor svh, Tensor? bias, "
    "int[] shard_widths, int codebook, int[] plans, Tensor workspace) -> int[]",
)


def _main(_: int, init_file: str) -> None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization.exl3 import ops, reference
    from vllm.model_executor.layers.quantization.exl3.kernels import CudaExl3Kernel

    from .exl3_harness import (
        CKPT_MCG,
        assert_matches,
        config_for,
        dense,
        gloo_world,
        load_module,
    )
    from .exl3_harness import tensors as fixture_tensors

    assert ops.load_exl3_ops.__wrapped__()[0] is False  # nothing registered yet
    # The load-time preparation below resolves plans; the walk on zeros is
    # test_each_bucket_once_per_configuration's.
    os.environ["VLLM_EXL3_WARMUP"] = "0"
    lib = torch.library.Library("_C", "FRAGMENT")
    for schema in SCHEMAS:
        lib.define(schema)
    seen_plans = []

    def linear(x, trellis, suh, svh, bias, widths, codebook, plans, workspace):
        seen_plans.append((list(plans), workspace.dtype))
        return reference.forward(x, trellis, suh, svh, codebook, widths, bias).to(
            x.dtype
        )

    lib.impl("exl3_linear", linear, "CPU")
    lib.impl(
        "exl3_reconstruct",
        lambda trellis, codebook: reference.decode_rotated(trellis, codebook),
        "CPU",
    )
    resolved = []

    def plan(trellis, shards, codebook, bf16, m, plans, workspace_floats):
        """The cost model's answer for every bucket: fused, 16 rows, split 1."""
        resolved.append(m)
        return [m, ops.PATH_FUSED, 16, 1, 0, 0, 0, 0, ops.SOURCE_COST_MODEL]

    lib.impl("exl3_plan", plan, "CPU")
    assert ops.load_exl3_ops() == (True, None)

    named = fixture_tensors(CKPT_MCG)
    mlp = "model.layers.0.mlp"
    trellis = named[f"{mlp}.up_proj.trellis"]
    w_hat = torch.compile(ops.exl3_reconstruct, backend="aot_eager", fullgraph=True)(
        trellis, 1
    )
    assert w_hat.dtype == torch.float16 and w_hat.shape == (256, 768)
    assert torch.equal(w_hat, reference.decode_rotated(trellis, 1))

    def gate_up(width: int) -> MergedColumnParallelLinear:
        layer = MergedColumnParallelLinear(
            256,
            [width, width],
            bias=False,
            quant_config=config_for(CKPT_MCG),
            prefix=f"{mlp}.gate_up_proj",
            params_dtype=torch.bfloat16,
        )
        load_module(layer, named, f"{mlp}.gate_proj", 0)
        load_module(layer, named, f"{mlp}.up_proj", 1)
        layer.quant_method.process_weights_after_loading(layer)
        # The op path, here on CPU tensors: its load-time preparation, then its GEMMs.
        kernel = CudaExl3Kernel(layer.quant_method.kernel.config)
        kernel.process_weights_after_loading(layer)
        assert resolved and kernel.workspace is not None
        layer.quant_method.kernel = kernel
        return layer

    with gloo_world(1, 0, init_file):
        layer = gate_up(768)
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).to(
            torch.bfloat16
        )
        compiled = torch.compile(
            lambda t: layer(t)[0], backend="aot_eager", fullgraph=True, dynamic=True
        )
        y = compiled(x)
        w = torch.cat(
            [dense(named, f"{mlp}.gate_proj"), dense(named, f"{mlp}.up_proj")], 1
        )
        assert_matches(y, x.float() @ w, "compiled gate_up through _C::exl3_linear")
        # The plan table reached the op: the header (version, no flags by default) and
        # an fp32 workspace; no entries without a checked-in table for this CPU
        # "device".
        plans, ws_dtype = seen_plans[-1]
        assert plans[:2] == [ops.PLAN_VERSION, 0] and len(plans) == ops.PLAN_HEADER_LEN
        assert ws_dtype == torch.float32

        # Shards keeping part of their last block: the kept columns are gathered in the
        # graph.
        cut = gate_up(700)
        y = torch.compile(
            lambda t: cut(t)[0], backend="aot_eager", fullgraph=True, dynamic=True
        )(x)
        assert_matches(
            y,
            x.float() @ torch.cat([w[:, :700], w[:, 768:1468]], 1),
            "compiled gate_up keeping 700 of 768 columns per shard",
        )


def test_ops_fakes_and_compiled_apply(tmp_path):
    mp.spawn(_main, args=(str(tmp_path / "init"),), nprocs=1, join=True)


# The plan settings and tables without a GPU (exl3/plans.py, env_compat.py, ops.py): the
# VLLM_EXL3_PLAN parser and its errors, the op's header, the per-device JSON table's
# loader and lookup, the deprecated per-knob variables, and the fake implementation of
# the new schema.


def test_parser_accepts_every_key():
    pins = parse_plan_setting("bm=128, split_k=4,wgmma=1,spread=1,split_k_traffic=0.5")
    assert pins == PlanPins(
        bm=128, split_k=4, wgmma=1, spread=1, reconstruct_m=0, split_k_traffic=0.5
    )
    assert parse_plan_setting("stream_k=1,bm=256") == PlanPins(
        bm=256, stream_k=1, reconstruct_m=0
    )
    assert parse_plan_setting("path=fused") == PlanPins(reconstruct_m=0)
    assert parse_plan_setting("path=original") == PlanPins(
        basis=ops.PATH_ORIGINAL, reconstruct_m=1
    )
    assert parse_plan_setting("path=rotated,reconstruct_m=512,bm=64") == PlanPins(
        bm=64, basis=ops.PATH_ROTATED, reconstruct_m=512
    )
    assert parse_plan_setting("reconstruct_m=0") == PlanPins(reconstruct_m=0)
    assert parse_plan_setting("") == PlanPins() and not PlanPins().pinned
    assert PlanPins(split_k_traffic=0.5).pinned


@pytest.mark.parametrize(
    "text, message",
    [
        ("bm=48", "bm=48 must be one of"),
        ("bm=x", "not an integer"),
        ("split_k=0", "split_k=0 must be >= 1"),
        ("wgmma=2", "wgmma=2 must be one of 0, 1"),
        ("blocks=4", "unknown key 'blocks'"),
        ("bm", "is not key=value"),
        ("bm=64,bm=128", "bm is given twice"),
        ("path=cublas", "must be fused, rotated or original"),
        ("split_k_traffic=-1", "split_k_traffic"),
        ("split_k_traffic=nan", "split_k_traffic"),
        ("stream_k=1,split_k=4", "exclude each other"),
        ("stream_k=1,wgmma=0", "only for the wgmma engine"),
        ("stream_k=1,bm=64", "BM 128 and 256 only"),
        ("bm=256,wgmma=0", "bm=256 exists only for the wgmma engine"),
        ("bm=16,wgmma=1", "mma.sync tier"),
        ("path=fused,reconstruct_m=512", "contradicts"),
        ("path=original,bm=64", "runs no fused GEMM"),
        ("path=rotated,reconstruct_m=0", "never takes it"),
    ],
)
def test_parser_errors_name_the_rule(text, message):
    with pytest.raises(Exl3PlanError, match="VLLM_EXL3_PLAN") as e:
        parse_plan_setting(text)
    assert message in str(e.value)


def test_header_layout():
    header = plans.plan_header(True, True, parse_plan_setting("bm=64,split_k=2"))
    assert len(header) == ops.PLAN_HEADER_LEN
    assert header == [
        ops.PLAN_VERSION,
        ops.FLAG_DETERMINISTIC | ops.FLAG_BATCH_INVARIANT,
        -1,
        64,
        2,
        -1,
        -1,
        -1,
        0,
        250,
    ]


def test_header_follows_the_settings(monkeypatch):
    monkeypatch.delenv("VLLM_EXL3_PLAN", raising=False)
    monkeypatch.setenv("VLLM_EXL3_DETERMINISTIC", "1")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert (
        plans.current_header()[1] == ops.FLAG_DETERMINISTIC | ops.FLAG_BATCH_INVARIANT
    )
    monkeypatch.setenv("VLLM_EXL3_PLAN", "bm=999")
    with pytest.raises(Exl3PlanError, match="bm=999"):
        plans.current_header()


PLAN = {
    "path": "fused",
    "bm": 16,
    "split_k": 8,
    "wgmma": 0,
    "stream_blocks": 0,
    "early_release": 1,
    "spread": 1,
}
KEY = plan_table.layer_key(4096, 12288, 4.0, 1, 3, torch.bfloat16)


def test_layer_key_and_file_name():
    assert KEY == "k=4096,n=12288,bits=4,codebook=1,shards=3,dtype=bfloat16"
    assert plan_table.layer_key(256, 512, 2.5, 2, 1, torch.float16).endswith(
        "bits=2.5,codebook=2,shards=1,dtype=float16"
    )
    assert plans.config_file_name("NVIDIA_H200") == "device_name=NVIDIA_H200.json"


def write_table(tmp_path, data) -> object:
    path = tmp_path / "device_name=TEST.json"
    path.write_text(json.dumps(data))
    plans.load_table.cache_clear()
    return path


def test_table_loads_sorted_entries(tmp_path):
    path = write_table(
        tmp_path,
        {
            KEY: {
                "64": {**PLAN, "bm": 64, "split_k": 2, "spread": 0},
                "1": PLAN,
                "4096": {**PLAN, "path": "rotated", "split_k": 1},
            }
        },
    )
    table = plans.load_table(path)
    assert table[KEY] == [
        [1, 0, 16, 8, 0, 0, 1, 1],
        [64, 0, 64, 2, 0, 0, 1, 0],
        [4096, ops.PATH_ROTATED, 16, 1, 0, 0, 1, 1],
    ]
    assert plans.entry_to_json(table[KEY][0]) == PLAN
    assert plans.load_table(tmp_path / "absent.json") == {}


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "JSON object"),
        ({KEY: []}, "keyed by bucket"),
        ({KEY: {"3": PLAN}}, "not a power of two"),
        ({KEY: {"one": PLAN}}, "not a power of two"),
        ({KEY: {"1": {**PLAN, "path": "cublas"}}}, "unknown path"),
        (
            {KEY: {"1": {**PLAN, "split_k": -1}}},
            "split_k must be a non-negative integer",
        ),
        ({KEY: {"1": {**PLAN, "wgmma": True}}}, "wgmma must be a non-negative integer"),
        (
            {KEY: {"1": {k: v for k, v in PLAN.items() if k != "spread"}}},
            "exactly the keys",
        ),
    ],
)
def test_table_errors(tmp_path, data, message):
    with pytest.raises(Exl3PlanError, match=message):
        plans.load_table(write_table(tmp_path, data))


def test_bad_json(tmp_path):
    path = tmp_path / "device_name=BAD.json"
    path.write_text("{")
    with pytest.raises(Exl3PlanError, match="not valid JSON"):
        plans.load_table(path)


def test_layer_plans_from_the_table(tmp_path, monkeypatch):
    table = plans.load_table(
        write_table(
            tmp_path,
            {
                KEY: {
                    "1": PLAN,
                    "2048": {**PLAN, "path": "original", "split_k": 1, "spread": 0},
                }
            },
        )
    )
    monkeypatch.setattr(plans, "device_table", lambda device: table)
    monkeypatch.setattr(plans, "_tuned", {})
    for name in ("VLLM_EXL3_PLAN", "VLLM_EXL3_DETERMINISTIC", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    cuda = torch.device("cuda", 0)
    flat = plans.layer_plans(KEY, cuda)
    header = flat[: ops.PLAN_HEADER_LEN]
    assert header == plans.current_header() and header[1] == 0
    assert flat[ops.PLAN_HEADER_LEN :] == [*table[KEY][0], *table[KEY][1]]
    assert plans.table_entries(KEY, cuda)[1] == "table"
    assert plans.table_entries("k=1", cuda) == ([], "cost-model")
    # Deterministic mode drops the split-k entry (the op would refuse it): the cost
    # model, which then plans without split-k, serves that bucket.
    monkeypatch.setenv("VLLM_EXL3_DETERMINISTIC", "1")
    assert plans.layer_plans(KEY, cuda)[ops.PLAN_HEADER_LEN :] == table[KEY][1]
    # Batch invariance admits neither: every bucket goes to the cost model's invariant
    # plan.
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert len(plans.layer_plans(KEY, cuda)) == ops.PLAN_HEADER_LEN
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    monkeypatch.delenv("VLLM_EXL3_DETERMINISTIC")
    # Forced plans: only the header, whose pins the cost model applies to every bucket.
    monkeypatch.setenv("VLLM_EXL3_PLAN", "bm=64")
    assert plans.layer_plans(KEY, cuda)[3] == 64
    assert len(plans.layer_plans(KEY, cuda)) == ops.PLAN_HEADER_LEN
    # Tuned entries (VLLM_EXL3_TUNE=1) take precedence over the table.
    monkeypatch.delenv("VLLM_EXL3_PLAN")
    plans.record_tuned(KEY, [[8, 0, 16, 1, 0, 0, 0, 0]])
    assert plans.table_entries(KEY, cuda) == ([[8, 0, 16, 1, 0, 0, 0, 0]], "tuned")


def test_no_table_off_cuda():
    assert plans.device_table(torch.device("cpu")) == {}


def test_checked_in_tables_parse():
    for path in plans.CONFIG_DIR.glob("device_name=*.json"):
        plans.load_table.cache_clear()
        for key, entries in plans.load_table(path).items():
            assert key.startswith("k=") and entries, path


def test_deprecated_plan_knobs_become_the_plan_setting():
    env = {
        "VLLM_EXL3_BM": "128",
        "CUDA_EXL3_SPLIT_K": "4",
        "VLLM_EXL3_RECONSTRUCT_M": "-1",
        "CUDA_EXL3_DETERMINISTIC": "1",
    }
    assert adopt_deprecated_env_names(env) == [
        "VLLM_EXL3_DETERMINISTIC",
        "VLLM_EXL3_SPLIT_K",
        "VLLM_EXL3_PLAN",
    ]
    assert env == {
        "CUDA_EXL3_SPLIT_K": "4",
        "CUDA_EXL3_DETERMINISTIC": "1",
        "VLLM_EXL3_DETERMINISTIC": "1",
        "VLLM_EXL3_PLAN": "bm=128,split_k=4,reconstruct_m=0",
    }
    assert parse_plan_setting(env["VLLM_EXL3_PLAN"]) == PlanPins(
        bm=128, split_k=4, reconstruct_m=0
    )
    # An explicit VLLM_EXL3_PLAN wins over the old knobs.
    env = {"VLLM_EXL3_WGMMA": "0", "VLLM_EXL3_PLAN": "bm=64"}
    assert adopt_deprecated_env_names(env) == []
    assert env == {"VLLM_EXL3_PLAN": "bm=64"}
    env = {"CUDA_EXL3_RECONSTRUCT_BASIS": "rotated"}
    adopt_deprecated_env_names(env)
    assert env["VLLM_EXL3_PLAN"] == "path=rotated"


def test_fake_has_the_new_schema():
    x = torch.empty(7, 256, dtype=torch.bfloat16, device="meta")
    trellis = torch.empty(16, 48, 64, dtype=torch.int16, device="meta")
    suh = torch.empty(2, 256, dtype=torch.float16, device="meta")
    svh = torch.empty(768, dtype=torch.float16, device="meta")
    ws = torch.empty(0, dtype=torch.float32, device="meta")
    y = ops.exl3_linear_fake(
        x,
        trellis,
        suh,
        svh,
        None,
        [384, 384],
        1,
        plans.plan_header(False, False, PlanPins()),
        ws,
    )
    assert y.shape == (7, 768) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    w = ops.exl3_reconstruct_fake(trellis, 1)
    assert w.shape == (256, 768) and w.dtype == torch.float16


# Load-time warm-up (exl3/plans.py) on vLLM's real layers: a kernel that runs plans is
# called once per power-of-two token count up to the scheduler's budget, on zeros, once
# per distinct layer configuration, with the layer's own shapes; the memory cap stops
# the walk; kernels that do not tune (the reference) are never called.


class RecordingKernel(kernels.ReferenceExl3Kernel):
    """The reference's arithmetic, warmed up after loading as the CUDA kernel is,
    recording each GEMM."""

    def __init__(self, c):
        super().__init__(c)
        self.calls: list[tuple[int, int, tuple[int, ...]]] = []

    def process_weights_after_loading(self, layer):
        self.warm_up(layer)

    def run_gemm(self, x, index, run, bias):
        assert not x.any(), "warm-up inputs are zeros"
        self.calls.append((x.shape[0], x.shape[1], tuple(run.shard_widths)))
        return super().run_gemm(x, index, run, bias)


def prepared(kernel_class, layer):
    """`kernel_class` for the loaded layer, after its load-time preparation."""
    kernel = kernel_class(layer.quant_method.kernel.config)
    kernel.process_weights_after_loading(layer)
    return kernel


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(plans, "_warmed", set())
    monkeypatch.setattr(plans, "max_tokens", lambda: 40)


def loaded_qkv(prefix: str = f"{ATTN}.qkv_proj"):
    layer = qkv_layer(config_for(CKPT_3INST), prefix=prefix)
    load_qkv(layer, tensors(CKPT_3INST))
    finish(layer)
    return layer


@pytest.mark.usefixtures("world1")
def test_bucket_walk_covers_the_token_budget():
    assert plans.warmup_m_values(1) == [1]
    assert plans.warmup_m_values(8192) == [2**j for j in range(14)]
    assert plans.warmup_m_values(5000)[-2:] == [4096, 8192]


@pytest.mark.usefixtures("world1")
def test_each_bucket_once_per_configuration(fresh):
    kernel = prepared(RecordingKernel, loaded_qkv())
    assert [m for m, _, _ in kernel.calls] == [1, 2, 4, 8, 16, 32, 64]
    assert {(k, widths) for _, k, widths in kernel.calls} == {(HIDDEN, (256, 128, 128))}
    # A second layer with the same configuration (another decoder layer) is not
    # re-tuned.
    other = prepared(RecordingKernel, loaded_qkv("model.layers.1.self_attn.qkv_proj"))
    assert other.calls == []


@pytest.mark.usefixtures("world1")
def test_memory_cap_stops_the_walk(fresh, monkeypatch):
    layer = loaded_qkv()
    n = layer.quant_method.layout.out_width
    # Room for m = 8 (8 rows x (k + n) x 4 bytes), not for 16.
    monkeypatch.setattr(plans, "MAX_WARMUP_BYTES", 8 * (HIDDEN + n) * 4)
    kernel = prepared(RecordingKernel, layer)
    assert [m for m, _, _ in kernel.calls] == [1, 2, 4, 8]


@pytest.mark.usefixtures("world1")
def test_env_turns_it_off(fresh, monkeypatch):
    monkeypatch.setenv("VLLM_EXL3_WARMUP", "0")
    kernel = prepared(RecordingKernel, loaded_qkv())
    assert kernel.calls == []


@pytest.mark.usefixtures("world1")
def test_reference_kernel_is_not_warmed(fresh, monkeypatch):
    layer = loaded_qkv()
    called = []
    monkeypatch.setattr(
        kernels.ReferenceExl3Kernel, "run_gemm", lambda *a, **k: called.append(1)
    )
    prepared(kernels.ReferenceExl3Kernel, layer)
    assert not called


def test_budget_comes_from_the_scheduler_config(world1):
    # world1 runs under a real VllmConfig: the walk follows its max_num_batched_tokens.
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        assert plans.max_tokens() == plans.DEFAULT_MAX_TOKENS
    else:
        assert plans.max_tokens() == config.scheduler_config.max_num_batched_tokens


@pytest.mark.slow
def test_whole_model_load_warms_each_configuration_once(tmp_path, monkeypatch, world1):
    """vLLM's real loader on the fixture: with a plan-tuning kernel selected, every
    distinct linear configuration (qkv, o, gate_up, down, lm_head) is warmed once over
    the whole bucket walk, not once per decoder layer, and the load completes."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    from .exl3_harness import checkpoint_copy
    from .test_exl3_model import CPU_ATTENTION_BACKEND

    calls: list[tuple[int, int, tuple[int, ...]]] = []

    class Tuning(RecordingKernel):
        def __init__(self, c):
            super().__init__(c)
            self.calls = calls

    monkeypatch.setattr(kernels, "CANDIDATES", (Tuning,))
    monkeypatch.setattr(plans, "_warmed", set())
    monkeypatch.setattr(plans, "max_tokens", lambda: 64)
    monkeypatch.setattr(
        current_platform,
        "get_attn_backend_cls",
        lambda *args, **kwargs: CPU_ATTENTION_BACKEND,
    )
    model_config = ModelConfig(
        model=str(checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", tokenizer=True)),
        dtype="bfloat16",
    )
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    model = get_model_loader(vllm_config.load_config).load_model(
        vllm_config=vllm_config, model_config=model_config
    )
    assert isinstance(model.lm_head.quant_method.kernel, Tuning)
    configs = {(k, widths) for _, k, widths in calls}
    walks = {c: [m for m, k, w in calls if (k, w) == c] for c in configs}
    assert all(ms == plans.warmup_m_values(64) for ms in walks.values()), walks
    # The 4 decoder layers share their four configurations (o, qkv, gate_up, down); the
    # head (vocab 4096) adds one: 5 walks, not 4 x 4 + 1.
    assert set(walks) == {
        (256, (256,)),
        (256, (256, 128, 128)),
        (256, (768, 768)),
        (768, (256,)),
        (256, (4096,)),
    }, sorted(walks)
