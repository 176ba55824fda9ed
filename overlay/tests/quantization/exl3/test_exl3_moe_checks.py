# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EXL3 MoE checks: bad checkpoints fail closed, and the op's host side without a GPU.

Bad EXL3 MoE checkpoints name the checkpoint tensor and the rule: a missing expert, an
expert of another shape, a bitrate quantization_config.json does not claim, mixed
codebooks in one layer, a tensor never loaded, a tensor loaded twice. Each starts from
the real qwen3moe-e16 3.0 bpw subset and changes one thing.

A spawned process defines `_C::exl3_moe` from the schema in csrc (so the two cannot
drift) with a CPU stand-in (the reference MoE kernel, ignoring the alignment), after
which `load_exl3_moe_op` finds it and registers the fake: fake tensors and torch.compile
get the output's shape and dtype from it, and the wrapper reaches the op. The CUDA
kernel class's host-side parts (rate table checks, block-size rule) are plain Python and
are checked here too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from .moe_checkpoints import assemble
from .test_exl3_moe import build_moe, run_moe

NAME = "qwen3moe-e16-3.0bpw-mcg"
EXPERTS = "model.layers.0.mlp.experts"


def edited(tmp_path, edit_tensors=None, edit_storage=None):
    """The assembled fixture with its safetensors and/or tensor_storage edited in
    place.
    """
    ckpt = assemble(NAME, tmp_path / "ckpt")
    if edit_tensors is not None:
        named = load_file(str(ckpt / "model.safetensors"))
        edit_tensors(named)
        save_file(named, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    if edit_storage is not None:
        path = ckpt / "quantization_config.json"
        document = json.loads(path.read_text())
        edit_storage(document["tensor_storage"])
        path.write_text(json.dumps(document))
    return ckpt


def drop(prefix):
    def edit(named):
        for k in [k for k in named if k.startswith(prefix + ".")]:
            del named[k]

    return edit


def test_missing_expert(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    ckpt = edited(
        tmp_path, drop(f"{EXPERTS}.5.up_proj"), lambda s: s.pop(f"{EXPERTS}.5.up_proj")
    )
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}\.5\.up_proj\.trellis: missing "
        r"tensor \(expert 5's up projection",
    ):
        build_moe(ckpt, EXPERTS)


def test_expert_of_another_shape(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.checkpoint_files import (
        Exl3FormatError,
    )
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    from .exl3_harness import config_from_tensors

    def widen(named):
        p = f"{EXPERTS}.3.gate_proj"
        named[f"{p}.trellis"] = torch.cat([named[f"{p}.trellis"]] * 2, dim=1)
        named[f"{p}.svh"] = torch.cat([named[f"{p}.svh"]] * 2)

    ckpt = edited(tmp_path, widen)
    # A local checkpoint: the whole-checkpoint validation rejects it against
    # config.json.
    with pytest.raises(
        Exl3FormatError,
        match=rf"{EXPERTS}\.3\.gate_proj\.trellis: stored "
        r"k x n = 256 x 256, but config.json .* implies 256 x 128",
    ):
        build_moe(ckpt, EXPERTS)
    # Described from its headers alone (as a hub checkpoint is): the MoE layer rejects
    # it.
    config = config_from_tensors(load_file(str(ckpt / "model.safetensors")))
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}\.3\.gate_proj\.trellis: expert of "
        r"shape k=256, n=256; the model's gate projection is k=256, n=128",
    ):
        build_moe(ckpt, EXPERTS, config=config)


def test_bitrate_the_config_does_not_claim(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    def four_bits(named):
        p = f"{EXPERTS}.7.down_proj"
        t = named[f"{p}.trellis"]
        named[f"{p}.trellis"] = torch.cat(
            [t, t[..., :16]], dim=-1
        )  # 48 -> 64 words: 4 bits

    ckpt = edited(tmp_path, four_bits)
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}\.7\.down_proj\.trellis: 4 bits per "
        r"weight \(trellis width 64\), but quantization_config.json claims 3",
    ):
        build_moe(ckpt, EXPERTS)


def test_mixed_codebooks(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    def three_inst(named):
        del named[f"{EXPERTS}.2.up_proj.mcg"]

    def storage(s):
        s[f"{EXPERTS}.2.up_proj"].pop("mcg_multiplier")
        s[f"{EXPERTS}.2.up_proj"]["stored_tensors"].pop(f"{EXPERTS}.2.up_proj.mcg")

    ckpt = edited(tmp_path, three_inst, storage)
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}: the experts of one layer mix "
        r"codebooks \(.*THREE_INST",
    ):
        build_moe(ckpt, EXPERTS)


def _load_all_but(ckpt, skip: str | None, twice: str | None = None):
    """FusedMoE for the fixture layer, fed every expert tensor except `skip` (one
    `twice`)."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoE

    from .exl3_harness import config_for
    from .moe_oracle import softmax_topk

    get_current_vllm_config().compilation_config.static_forward_context.pop(
        EXPERTS, None
    )
    moe = FusedMoE(
        num_experts=16,
        top_k=4,
        hidden_size=256,
        intermediate_size=128,
        params_dtype=torch.float32,
        quant_config=config_for(ckpt),
        prefix=EXPERTS,
        custom_routing_function=softmax_topk,
    )
    named = load_file(str(ckpt / "model.safetensors"))
    weights = [
        (k[len(EXPERTS) + 1 :], v)
        for k, v in named.items()
        if k.startswith(EXPERTS + ".") and k != skip
    ]
    if twice is not None:
        weights.append((twice[len(EXPERTS) + 1 :], named[twice]))
    for _ in moe.load_weights(iter(weights)):
        pass
    moe.routed_experts.quant_method.process_weights_after_loading(moe.routed_experts)
    return moe


def test_tensor_never_loaded(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    ckpt = assemble(NAME, tmp_path / "ckpt")
    with pytest.raises(
        Exl3LayoutError,
        match=rf"checkpoint tensors never loaded: "
        rf"{EXPERTS}\.9\.down_proj\.svh$",
    ):
        _load_all_but(ckpt, f"{EXPERTS}.9.down_proj.svh")


def test_tensor_loaded_twice(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    ckpt = assemble(NAME, tmp_path / "ckpt")
    name = f"{EXPERTS}.4.gate_proj.trellis"
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{name} -> {EXPERTS} \(rank 0\): region "
        rf"already written by {name}",
    ):
        _load_all_but(ckpt, None, twice=name)


def test_wrong_marker_value(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    def corrupt(named):
        named[f"{EXPERTS}.11.down_proj.mcg"] = torch.tensor(12345, dtype=torch.int32)

    ckpt = edited(tmp_path, corrupt)
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}\.11\.down_proj\.mcg \(rank 0\): "
        r"marker value 12345",
    ):
        _load_all_but(ckpt, None)


def test_complete_load_runs(tmp_path, world1):
    """The control: the unedited subset loads by the same path and computes finite
    output."""
    ckpt = assemble(NAME, tmp_path / "ckpt")
    moe = _load_all_but(ckpt, None)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    y = run_moe(
        moe, x, torch.randn(5, 16, generator=torch.Generator().manual_seed(2)), world1
    )
    assert y.shape == (5, 256) and torch.isfinite(y).all() and y.abs().max() > 0


# The MoE op's wrapper, fake implementation and host-side checks without a GPU.
#
# A spawned process defines `_C::exl3_moe` from the schema in csrc (so the two cannot
# drift) with a CPU stand-in (the reference MoE kernel, ignoring the alignment), after
# which `load_exl3_moe_op` finds it and registers the fake: fake tensors and
# torch.compile get the output's shape and dtype from it, and the wrapper reaches the
# op. The CUDA kernel class's host-side parts (rate table checks, block-size rule) are
# plain Python and are checked here too.

from vllm_exl3.repo import ROOT as REPO  # noqa: E402

OPS_CPP = REPO / "csrc/libtorch_stable/quantization/exl3/exl3_moe_ops.cpp"
LINEAR_OPS_CPP = REPO / "csrc/libtorch_stable/quantization/exl3/exl3_ops.cpp"


def schemas(path: Path) -> list[str]:
    """Every op schema a csrc file defines (its m.def string literals, joined)."""
    blocks = re.findall(r'm\.def\(\s*((?:"[^"]*"\s*)+)\);', path.read_text())
    assert blocks, f"no m.def(...) in {path.name}"
    return ["".join(re.findall(r'"([^"]*)"', block)) for block in blocks]


def moe_schema() -> str:
    return schemas(OPS_CPP)[0]


def _layer(experts: int, h: int, i: int, bits: float):
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import Exl3MoEWeights

    g = torch.Generator().manual_seed(3)
    k2 = int(2 * bits)
    size13 = (h // 16) * (i // 16) * 8 * k2
    size2 = (i // 16) * (h // 16) * 8 * k2
    meta13 = torch.tensor(
        [[[(2 * e + r) * size13, k2] for r in (0, 1)] for e in range(experts)]
    )
    meta2 = torch.tensor([[e * size2, k2] for e in range(experts)])

    def scales(*shape: int) -> torch.Tensor:
        return (0.5 + torch.rand(shape, generator=g)).half()

    def words(n: int) -> torch.Tensor:
        return torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(
            torch.int16
        )

    return Exl3MoEWeights(
        words(2 * experts * size13),
        meta13,
        scales(experts, 2, h),
        scales(experts, 2 * i),
        words(experts * size2),
        meta2,
        scales(experts, i),
        scales(experts, h),
        experts,
        h,
        i,
    )


def _main(_: int) -> None:
    from vllm.model_executor.layers.quantization.exl3 import moe_ops
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        ReferenceExl3MoEKernel,
    )

    assert moe_ops.ops.load_exl3_ops.__wrapped__()[0] is False  # nothing registered yet
    w = _layer(4, 128, 128, 2)
    ref = ReferenceExl3MoEKernel()

    def stand_in(*args):
        a = moe_ops.Exl3MoEArgs(*args)
        return ref.apply(
            a.x,
            a.topk_weights,
            a.topk_ids,
            w,
            activation="silu",
            apply_router_weight_on_input=a.apply_router_weight_on_input,
            expert_map=a.expert_map,
            global_num_experts=a.global_num_experts,
            codebook=a.codebook,
            deterministic=a.deterministic,
        )

    lib = torch.library.Library("_C", "FRAGMENT")
    for schema in schemas(LINEAR_OPS_CPP):  # the dense ops the loader checks for first
        lib.define(schema)
    schema = moe_schema()
    lib.define(schema)
    lib.impl("exl3_moe", stand_in, "CPU")
    assert moe_ops.load_exl3_moe_op() == (True, None)

    # The one argument list the fake and the wrapper take is the schema's, by name and
    # in order.
    names = re.findall(r"(?:Tensor\??|int\[\]|int|bool) (\w+)", schema)
    assert names[-4:] == ["gate_up_splits", "down_splits", "workspace", "wgmma"], names
    assert list(moe_ops.Exl3MoEArgs._fields) == names

    m, top_k = 5, 2
    x = torch.randn(m, 128).to(torch.bfloat16)
    topk_ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [2, 0]], dtype=torch.int32)
    topk_w = torch.rand(m, top_k)
    sorted_ids = torch.arange(m * top_k, dtype=torch.int32)
    expert_ids = torch.zeros(1, dtype=torch.int32)
    post_pad = torch.tensor([16], dtype=torch.int32)
    args = (
        topk_w,
        topk_ids,
        sorted_ids,
        expert_ids,
        post_pad,
        None,
        w.w13_trellis,
        w.w13_meta,
        w.w13_suh,
        w.w13_svh,
        w.w2_trellis,
        w.w2_meta,
        w.w2_suh,
        w.w2_svh,
        16,
        [4],
        [4],
        4,
        1,
        False,
        True,
        1,
        1,
        None,
        -1,
    )

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fx = torch.empty(7, 128, dtype=torch.float16)
        out = torch.ops._C.exl3_moe(fx, *args)
        assert out.shape == (7, 128) and out.dtype == torch.float16
        # With k-splits and their workspace: the same output.
        ws = torch.empty(moe_ops.split_workspace_floats(7, 2, 128, 128, 2, 2))
        out = torch.ops._C.exl3_moe(fx, *args[:-4], 2, 2, ws, -1)
        assert out.shape == (7, 128) and out.dtype == torch.float16
        # Either engine forced: the same output.
        for wgmma in (0, 1):
            out = torch.ops._C.exl3_moe(fx, *args[:-1], wgmma)
            assert out.shape == (7, 128) and out.dtype == torch.float16
        # The pairs layout (no alignment): the same output.
        out = torch.ops._C.exl3_moe(fx, *args[:2], None, None, None, *args[5:])
        assert out.shape == (7, 128) and out.dtype == torch.float16

    compiled = torch.compile(
        lambda t: moe_ops.exl3_moe(moe_ops.Exl3MoEArgs(t, *args)),
        backend="aot_eager",
        fullgraph=True,
    )
    y = compiled(x)
    assert y.shape == (m, 128) and y.dtype == torch.bfloat16
    expected = ref.apply(
        x,
        topk_w,
        topk_ids,
        w,
        activation="silu",
        apply_router_weight_on_input=False,
        expert_map=None,
        global_num_experts=4,
        codebook=1,
        deterministic=True,
    )
    assert torch.equal(y, expected)
    pairs_args = (*args[:2], None, None, None, *args[5:])
    compiled = torch.compile(
        lambda t: moe_ops.exl3_moe(moe_ops.Exl3MoEArgs(t, *pairs_args)),
        backend="aot_eager",
        fullgraph=True,
    )
    assert torch.equal(compiled(x), expected)


def test_moe_op_fake_and_wrapper() -> None:
    mp.spawn(_main, nprocs=1, join=True)


def test_rate_table_checks_name_the_entry() -> None:
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        CudaExl3MoEKernel,
    )

    kernel = CudaExl3MoEKernel()
    w = _layer(3, 128, 256, 3)
    assert kernel.rates(w, 1) == ([6], [6])
    bad = w.w13_meta.clone()
    bad[2, 1, 1] = 9
    with pytest.raises(ValueError, match=r"w13_meta\[2, 1\]: k2 = 9"):
        CudaExl3MoEKernel().rates(type(w)(**{**w.__dict__, "w13_meta": bad}), 1)
    bad = w.w2_meta.clone()
    bad[1, 0] += 4
    with pytest.raises(ValueError, match=r"w2_meta\[1, 0\].*unaligned or outside"):
        CudaExl3MoEKernel().rates(type(w)(**{**w.__dict__, "w2_meta": bad}), 1)
    bad = w.w2_meta.clone()
    bad[2, 0] += 8
    with pytest.raises(ValueError, match=r"w2_meta\[2, 0\].*outside w2_trellis"):
        CudaExl3MoEKernel().rates(type(w)(**{**w.__dict__, "w2_meta": bad}), 1)


def test_block_size_rule() -> None:
    """The aligned layout's row block at the H200's measured decisions (bench_moe.py
    --block-sweep): 16-row blocks up to 8 routed rows per expert, 32 at 16, 64 at 32
    and 64, 128 at 128; the largest tier for large batches; never a smaller block for
    more rows."""
    from vllm.model_executor.layers.quantization.exl3.moe_ops import BLOCK_SIZES
    from vllm.model_executor.layers.quantization.exl3.moe_plans import block_size

    rule = block_size
    assert rule(1, 8, 128) == BLOCK_SIZES[0]  # decode: a 16-row block per routed pair
    assert rule(64, 8, 128) == 16  # 4 rows per expert
    assert rule(256, 8, 256) == 16  # DeepSeek-V3, 8 rows per expert
    assert rule(256, 8, 128) == 32  # Qwen3-30B-A3B, GLM-4.5-Air: 16 rows per expert
    assert rule(1024, 8, 256) == 64  # DeepSeek-V3, 32 rows per expert
    assert rule(1024, 8, 128) == 64  # 64 rows per expert
    assert rule(2048, 8, 128) == 128  # 128 rows per expert
    assert rule(2048, 8, 256) == 64 and rule(4096, 8, 256) == 128  # DeepSeek-V3
    # Where the tiers meet for top-8 of 128 experts: 11.5, 26.6, 64.4 rows per expert.
    assert [rule(t, 8, 128) for t in (184, 185, 425, 426, 1029, 1030)] == [
        16,
        32,
        32,
        64,
        64,
        128,
    ]
    for e, top_k in ((128, 8), (256, 8), (16, 4)):
        picks = [rule(t, top_k, e) for t in range(1, 400 * e // top_k, 7)]
        assert picks == sorted(picks), (e, top_k)
    assert rule(4096, 8, 128) == BLOCK_SIZES[-1]
    assert rule(8192, 2, 16) == BLOCK_SIZES[-1]
    assert rule(3, 4, 4) == 16  # every token routed to every expert: 3 rows each


def test_expected_blocks_per_expert_is_the_binomial_expectation() -> None:
    """E[ceil(R / b)] against the sum over the whole binomial pmf (exact integers)."""
    from vllm.model_executor.layers.quantization.exl3.moe_ops import BLOCK_SIZES
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        expected_blocks_per_expert,
    )

    for tokens, top_k, experts in ((40, 2, 8), (300, 8, 128), (700, 8, 256), (5, 4, 4)):
        p = Fraction(min(top_k, experts), experts)
        pmf = [
            math.comb(tokens, r) * p**r * (1 - p) ** (tokens - r)
            for r in range(tokens + 1)
        ]
        want = [
            float(sum(w * -(-r // b) for r, w in enumerate(pmf))) for b in BLOCK_SIZES
        ]
        got = expected_blocks_per_expert(tokens, top_k, experts)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (tokens, top_k, experts)
    assert expected_blocks_per_expert(0, 8, 128) == (0.0,) * len(BLOCK_SIZES)


def test_reconstruct_op_schema_matches_the_fake_and_wrapper() -> None:
    from vllm.model_executor.layers.quantization.exl3 import moe_ops

    schema = schemas(OPS_CPP)[1]
    assert (
        schema.startswith(moe_ops.RECONSTRUCT_OP + "(") and "Tensor(a!) out" in schema
    )
    names = re.findall(r"(?:Tensor(?:\(a!\))?|int\[\]|int|bool) (\w+)", schema)
    assert list(moe_ops.Exl3MoEReconstructArgs._fields) == names


# The per-call choice (moe_plans.py) on GLM-4.5-Air's MoE layer: hidden 4096, expert
# width 1408, 128 experts, all local, 4 bits.


def glm_shape(tokens: int, top_k: int = 8, experts: int = 128):
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        Exl3MoECallShape,
    )

    return Exl3MoECallShape(tokens, top_k, experts, experts, 4096, 1408, (8, 8))


def path_of(tokens: int, top_k: int, experts: int, **kwargs):
    """moe_plans.select_moe_path for `tokens` x top-k over `experts` experts."""
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        select_moe_path,
    )

    return select_moe_path(glm_shape(tokens, top_k, experts), **kwargs)


def glm_call(kernel, tokens: int):
    """What the CUDA kernel class `kernel` runs for `tokens` x top-8 (its choice reads
    only the layer's dimensions, so the tensors are empty CPU ones)."""
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        Exl3MoEWeights,
    )

    none = torch.empty(0)
    w = Exl3MoEWeights(*[none] * 8, num_experts=128, hidden=4096, width=1408)
    return kernel.choose(tokens, 8, 128, w, ([8], [8]), torch.device("cpu"))


@pytest.fixture
def h200_on_cpu():
    """The split rule's device for CPU tensors: an H200's SMs and shared memory."""
    from vllm.model_executor.layers.quantization.exl3 import moe_plans

    cpu = torch.device("cpu")
    moe_plans._split_devices[cpu] = moe_plans.SplitDevice(H200_SMS, H200_SMEM_PER_SM)
    yield
    moe_plans._split_devices.pop(cpu, None)


def test_large_batch_rule_and_shared_scratch() -> None:
    """The rows-per-expert rule, and the scratch views: w1 [E, 2i, h] and w2 [E, h, i]
    side by side in one buffer, refused (named) when the layer was not reserved for."""
    from vllm.model_executor.layers.quantization.exl3 import moe_kernels as mk
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        MOE_THRESHOLDS,
        Exl3MoEPath,
    )

    # Not until prepare() reserved the scratch for the layer: never.
    assert not mk.CudaExl3MoEKernel().reconstruct_ready
    assert path_of(1 << 20, 8, 128, reconstruct_ready=False) is Exl3MoEPath.ALIGNED
    rows = MOE_THRESHOLDS.reconstruct_min_rows_per_expert
    assert path_of(rows * 16 - 1, 8, 128, reconstruct_ready=True) is not (
        Exl3MoEPath.RECONSTRUCT
    )
    assert path_of(rows * 16, 8, 128, reconstruct_ready=True) is (
        Exl3MoEPath.RECONSTRUCT
    )
    # Another threshold, passed as data: 16 rows per expert.
    sixteen = dataclasses.replace(MOE_THRESHOLDS, reconstruct_min_rows_per_expert=16)
    assert path_of(63, 4, 16, reconstruct_ready=True, thresholds=sixteen) is not (
        Exl3MoEPath.RECONSTRUCT
    )
    assert path_of(64, 4, 16, reconstruct_ready=True, thresholds=sixteen) is (
        Exl3MoEPath.RECONSTRUCT
    )
    assert 0 < MOE_THRESHOLDS.reconstruct_scratch_max_fraction < 1

    w = _layer(3, 128, 256, 3)
    cpu = torch.device("cpu")
    need = mk.reconstruct_scratch_bytes(w, torch.bfloat16)
    assert need == 3 * 3 * 128 * 256 * 2
    try:
        mk._reconstruct_scratch.pop(cpu, None)
        with pytest.raises(RuntimeError, match="reconstruct scratch .* not reserved"):
            mk.reconstruct_scratch(w, torch.bfloat16)
        mk.reserve_reconstruct_scratch(cpu, need // 2)
        mk.reserve_reconstruct_scratch(cpu, need)  # grows
        mk.reserve_reconstruct_scratch(cpu, need // 2)  # never shrinks
        assert mk._reconstruct_scratch[cpu].numel() == need
        w1, w2 = mk.reconstruct_scratch(w, torch.bfloat16)
        assert w1.shape == (3, 512, 128) and w2.shape == (3, 128, 256)
        assert w1.is_contiguous() and w2.is_contiguous()
        w1.fill_(1)
        w2.fill_(2)
        assert bool((w1 == 1).all()) and bool((w2 == 2).all())  # no overlap
        assert w2.data_ptr() - w1.data_ptr() == w1.numel() * 2
    finally:
        mk._reconstruct_scratch.pop(cpu, None)


# The few-token split rule (moe_plans.moe_splits) at the four bench shapes
# (scripts/bench/bench_moe.py SHAPES: hidden, expert width, experts, top-k), on an
# H200 (132 SMs, 228 KB of shared memory per SM), 4 bits.
BENCH_SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "glm-4.5-air": (4096, 1408, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}
H200_SMS, H200_SMEM_PER_SM = 132, 233472
# (gate_up_splits, down_splits) by tokens; (1, 1) at every other count.
SPLITS_AT = {
    "qwen3-30b-a3b": {},
    "qwen3-235b-a22b": {1: (2, 1)},
    "glm-4.5-air": {1: (3, 1)},
    "deepseek-v3": {1: (2, 1)},
}


def test_split_rule_at_the_bench_shapes() -> None:
    """At one token GLM-4.5-Air runs 8 experts x 22 gate/up column blocks = 176 on 132 x
    4 resident slots: 528 // 176 = 3 splits of its 64 stages (21 each, at least 20);
    its down k (22 stages) and all of Qwen3-30B-A3B's (32 and 12) are too short to
    split. From 2 tokens (about 16 of 128 experts reached) the blocks fill more than
    half the slots and nothing is split."""
    from vllm.model_executor.layers.quantization.exl3 import moe_plans as mk
    from vllm.model_executor.layers.quantization.exl3.moe_ops import (
        GATE_UP_ROLES,
        STAGE_K,
    )

    dev = mk.SplitDevice(H200_SMS, H200_SMEM_PER_SM)
    least = mk.MOE_THRESHOLDS.split_min_stages
    for name, (h, i, e, top_k) in BENCH_SHAPES.items():
        for tokens in (1, 2, 4, 8, 16, 64, 256):
            block = mk.block_size(tokens, top_k, e)
            got = mk.moe_splits(tokens, top_k, e, e, h, i, block, (8, 8), dev)
            assert got == SPLITS_AT[name].get(tokens, (1, 1)), (name, tokens, got)
            # Never past one wave of resident slots, never below the stages a split
            # needs.
            blocks = mk.expected_row_blocks(tokens, top_k, e, e, block)
            for splits, tiles, k in (
                (got[0], blocks * GATE_UP_ROLES * i // 128, h),
                (got[1], blocks * h // 128, i),
            ):
                assert splits == 1 or splits * tiles <= H200_SMS * 4, (name, tokens)
                assert splits == 1 or k // STAGE_K // splits >= least

    assert mk.expected_row_blocks(1, 8, 128, 128, 16) == 8  # exactly top-k experts
    assert mk.expected_row_blocks(0, 8, 128, 128, 16) == 0
    # Rows past a block per expert: the row count sets the blocks.
    assert mk.expected_row_blocks(64, 8, 16, 16, 16) == 32
    # Expert parallelism: DeepSeek-V3 with 32 of 256 experts local, 8 routed pairs ->
    # 1 expected block of 32 gate/up tiles (room for 16 splits), so the split is capped
    # at 20 stages a split (7168 / 64 // 20 = 5); down's 32 stages stay whole.
    assert mk.moe_splits(1, 8, 256, 32, 7168, 2048, 16, (8, 8), dev) == (5, 1)
    # The large-batch tiers have no split-k.
    for block in (64, 128):
        assert mk.moe_splits(1, 8, 128, 128, 2048, 768, block, (8, 8), dev) == (1, 1)


def test_pairs_rule() -> None:
    """moe_plans.pairs_layout: up to an eighth of a routed pair per (global) expert,
    where a uniform routing reaches nearly as many experts as it has pairs (the excess
    trellis read, P / D - 1, stays at or below 6.5 %); never for an empty batch."""
    from vllm.model_executor.layers.quantization.exl3 import moe_plans as mk

    limits = {"qwen3-30b-a3b": 2, "qwen3-235b-a22b": 2, "glm-4.5-air": 2}
    limits["deepseek-v3"] = 4
    for name, (_, _, e, top_k) in BENCH_SHAPES.items():
        for tokens in range(0, 40):
            want = 0 < tokens <= limits[name]
            assert mk.pairs_layout(tokens, top_k, e) == want, (name, tokens)
    assert mk.pairs_layout(16, 1, 128) and not mk.pairs_layout(17, 1, 128)
    assert mk.pairs_layout(8, 8, 512) and not mk.pairs_layout(9, 8, 512)
    assert not mk.pairs_layout(1, 8, 8)  # 8 pairs over 8 experts: the alignment
    # The constant's bound: the excess read at the limit, for every expert count.
    for e in (8, 64, 128, 256, 512):
        p = int(mk.MOE_THRESHOLDS.pairs_max_pairs_per_expert * e)
        reached = e * (1 - (1 - 1 / e) ** p)
        assert p / reached - 1 <= 0.065, (e, p / reached)


def test_pairs_choice_of_the_kernel_class(monkeypatch, h200_on_cpu) -> None:
    """CudaExl3MoEKernel.choose: the rule, an overridden path either way; batch
    invariance keeps the rule (a row's sums do not depend on the layout)."""
    import vllm.envs as envs
    from vllm.model_executor.layers.quantization.exl3 import moe_kernels as mk
    from vllm.model_executor.layers.quantization.exl3.moe_ops import PAIRS_BLOCK_SIZE
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        Exl3MoEOverrides,
        Exl3MoEPath,
    )

    pairs, aligned = Exl3MoEPath.PAIRS, Exl3MoEPath.ALIGNED

    def path(kernel, tokens: int) -> Exl3MoEPath:
        return glm_call(kernel, tokens).path

    kernel = mk.CudaExl3MoEKernel()
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False, raising=False)
    assert path(kernel, 2) is pairs and path(kernel, 3) is aligned
    assert glm_call(kernel, 2).block == PAIRS_BLOCK_SIZE
    assert path(mk.CudaExl3MoEKernel(Exl3MoEOverrides(path=pairs)), 1024) is pairs
    assert path(mk.CudaExl3MoEKernel(Exl3MoEOverrides(path=aligned)), 1) is aligned
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    assert path(kernel, 2) is pairs and path(kernel, 3) is aligned


def test_block_override_of_the_kernel_class(h200_on_cpu) -> None:
    """Exl3MoEOverrides.block fixes the aligned layout's row block (the benchmark's
    exl3_blockB rows); the pairs layout keeps its 16-row blocks; a block the grouped
    GEMM does not have is refused by name."""
    from vllm.model_executor.layers.quantization.exl3 import moe_kernels as mk
    from vllm.model_executor.layers.quantization.exl3.moe_ops import BLOCK_SIZES
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        Exl3MoEOverrides,
        Exl3MoEPath,
    )

    ruled = glm_call(mk.CudaExl3MoEKernel(), 256)
    assert ruled.path is Exl3MoEPath.ALIGNED and ruled.block == 32
    for b in BLOCK_SIZES:
        forced = glm_call(mk.CudaExl3MoEKernel(Exl3MoEOverrides(block=b)), 256)
        assert (forced.path, forced.block) == (Exl3MoEPath.ALIGNED, b)
    pairs = Exl3MoEOverrides(path=Exl3MoEPath.PAIRS, block=64)
    assert glm_call(mk.CudaExl3MoEKernel(pairs), 2).block == 16
    with pytest.raises(ValueError, match="block = 48: not a row block"):
        Exl3MoEOverrides(block=48)


def test_split_rule_counts_the_pairs_blocks() -> None:
    """With the pairs layout the split rule counts one working block per local routed
    pair: the aligned estimate's where every pair reaches its own expert (one token),
    more where pairs repeat experts, and the local share under expert parallelism."""
    from vllm.model_executor.layers.quantization.exl3 import moe_plans as mk

    dev = mk.SplitDevice(H200_SMS, H200_SMEM_PER_SM)
    assert mk.expected_row_blocks(1, 8, 128, 128, 16, pairs=True) == 8
    assert mk.expected_row_blocks(4, 8, 128, 128, 16, pairs=True) == 32
    assert mk.expected_row_blocks(4, 8, 128, 128, 16) == 29  # 128 (1 - (15/16)^4)
    assert mk.expected_row_blocks(0, 8, 128, 128, 16, pairs=True) == 0
    assert mk.expected_row_blocks(1, 8, 256, 32, 16, pairs=True) == 1
    assert mk.expected_row_blocks(2, 8, 256, 32, 16, pairs=True) == 2
    for name, (h, i, e, top_k) in BENCH_SHAPES.items():
        got = mk.moe_splits(1, top_k, e, e, h, i, 16, (8, 8), dev, pairs=True)
        assert got == SPLITS_AT[name].get(1, (1, 1)), (name, got)
    # GLM-4.5-Air at 2 tokens, 8 bits: 16 blocks x 22 column blocks = 352 of 528 slots,
    # one split either way.
    assert mk.moe_splits(2, 8, 128, 128, 4096, 1408, 16, (16, 16), dev, True) == (1, 1)
    # Expert parallelism (DeepSeek-V3, 32 of 256 local, one token): one working block,
    # as the aligned estimate.
    assert mk.moe_splits(1, 8, 256, 32, 7168, 2048, 16, (8, 8), dev, True) == (5, 1)


def test_split_rule_resident_blocks() -> None:
    """Shared memory caps the resident blocks: 4 on an H200 at every rate; on a 100 KB
    sm_12x SM 4 at 4 bits (4 x (4 x (2 KB + 4 KB) + 1 KB) = 100 KB) but 2 at 8."""
    from vllm.model_executor.layers.quantization.exl3 import moe_plans as mk

    h200 = mk.SplitDevice(H200_SMS, H200_SMEM_PER_SM)
    sm120 = mk.SplitDevice(170, 100 * 1024)
    for k2 in (2, 3, 8, 16):
        assert mk.resident_blocks(16, k2, h200) == 4
    assert mk.resident_blocks(16, 8, sm120) == 4
    assert mk.resident_blocks(16, 16, sm120) == 2
    assert mk.resident_blocks(32, 16, sm120) == 2
    # Fewer slots, fewer splits: GLM-4.5-Air at one token, 8 bits: 528 // 176 = 3 on the
    # H200, 170 x 2 // 176 = 1 on such a device.
    assert mk.moe_splits(1, 8, 128, 128, 4096, 1408, 16, (16, 16), h200) == (3, 1)
    assert mk.moe_splits(1, 8, 128, 128, 4096, 1408, 16, (16, 16), sm120) == (1, 1)


def test_split_choice_of_the_kernel_class(monkeypatch, h200_on_cpu) -> None:
    """moe_plans.call_splits: the rule, overridden splits (capped at k's stages),
    nothing on the large-batch tiers, nothing under batch invariance; the kernel
    class's calls follow its overrides."""
    import vllm.envs as envs
    from vllm.model_executor.layers.quantization.exl3 import moe_kernels as mk
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        Exl3MoEOverrides,
        call_splits,
    )

    def splits(tokens: int, block: int, **kw) -> tuple[int, int]:
        kw.setdefault("batch_invariant", False)
        return call_splits(glm_shape(tokens), block, False, torch.device("cpu"), **kw)

    # The rule reads only the layer's dimensions (GLM-4.5-Air's: split at one token).
    assert splits(1, 16) == (3, 1)
    assert splits(1, 64) == (1, 1)
    assert splits(1, 16, overrides=Exl3MoEOverrides(splits=(1, 1))) == (1, 1)
    capped = Exl3MoEOverrides(splits=(100, 100))
    assert splits(16, 32, overrides=capped) == (64, 22)
    assert splits(16, 128, overrides=capped) == (1, 1)
    assert splits(1, 16, batch_invariant=True) == (1, 1)
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False, raising=False)
    assert glm_call(mk.CudaExl3MoEKernel(), 1).splits == (3, 1)
    assert glm_call(mk.CudaExl3MoEKernel(capped), 16).splits == (64, 22)
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    assert glm_call(mk.CudaExl3MoEKernel(), 1).splits == (1, 1)


def test_wgmma_choice_of_the_kernel_class(monkeypatch, h200_on_cpu) -> None:
    """moe_plans.wgmma_mode: the op's own choice (-1), an override either way,
    mma.sync under batch invariance (the decode tiers have no wgmma, so one engine
    serves every batch size); the kernel class's calls follow its overrides."""
    import vllm.envs as envs
    from vllm.model_executor.layers.quantization.exl3 import moe_kernels as mk
    from vllm.model_executor.layers.quantization.exl3 import moe_ops
    from vllm.model_executor.layers.quantization.exl3.moe_plans import (
        Exl3MoEOverrides,
        wgmma_mode,
    )

    assert (moe_ops.WGMMA_AUTO, moe_ops.WGMMA_NEVER, moe_ops.WGMMA_FORCE) == (-1, 0, 1)
    # The block sizes are the kernels' tiers (16 rows each), and unsplit.
    header = (OPS_CPP.parent / "exl3_moe.h").read_text()
    tiers = re.search(r"kMoeWgmmaTiers\[\] = \{([^}]*)\}", header).group(1)
    assert tuple(16 * int(t) for t in tiers.split(",")) == moe_ops.WGMMA_BLOCK_SIZES
    assert not set(moe_ops.WGMMA_BLOCK_SIZES) & set(moe_ops.SPLIT_BLOCK_SIZES)
    assert set(moe_ops.WGMMA_BLOCK_SIZES) <= set(moe_ops.BLOCK_SIZES)
    wgmma, mma = Exl3MoEOverrides(wgmma=True), Exl3MoEOverrides(wgmma=False)
    assert wgmma_mode(Exl3MoEOverrides(), False) == moe_ops.WGMMA_AUTO
    assert wgmma_mode(wgmma, False) == moe_ops.WGMMA_FORCE
    assert wgmma_mode(mma, False) == moe_ops.WGMMA_NEVER
    assert wgmma_mode(Exl3MoEOverrides(), True) == moe_ops.WGMMA_NEVER
    assert wgmma_mode(wgmma, True) == moe_ops.WGMMA_FORCE  # an override still wins
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False, raising=False)
    assert glm_call(mk.CudaExl3MoEKernel(), 200).wgmma == moe_ops.WGMMA_AUTO
    assert glm_call(mk.CudaExl3MoEKernel(mma), 200).wgmma == moe_ops.WGMMA_NEVER
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    assert glm_call(mk.CudaExl3MoEKernel(), 200).wgmma == moe_ops.WGMMA_NEVER


def test_split_workspace_accounting() -> None:
    """The workspace the op checks: gate/up's [splits][2][pairs][width] fp32 partial
    rows, then down's [splits][pairs][hidden]; an unsplit GEMM takes none. The GPU
    tests' helper (scripts/bench/moe_layers.py) sizes it the same way."""

    from vllm.model_executor.layers.quantization.exl3.moe_ops import (
        split_workspace_floats,
    )
    from vllm_exl3.bench import moe_layers

    for tokens, top_k, h, i, s13, s2 in (
        (1, 8, 2048, 768, 5, 4),
        (2, 8, 2048, 768, 2, 2),
        (1, 8, 7168, 2048, 2, 1),
        (3, 2, 128, 128, 1, 2),
        (16, 1, 384, 256, 1, 1),
    ):
        pairs = tokens * top_k
        want = (s13 * 2 * pairs * i if s13 > 1 else 0) + (
            s2 * pairs * h if s2 > 1 else 0
        )
        assert split_workspace_floats(tokens, top_k, h, i, s13, s2) == want
        assert moe_layers.split_workspace_floats(tokens, top_k, h, i, s13, s2) == want
    # Qwen3-30B-A3B at one token with the rule's splits: 0.5 MB.
    assert split_workspace_floats(1, 8, 2048, 768, 5, 4) * 4 == 507904
    # The gate/up part ends on a 16-byte boundary (width is whole 128-column blocks),
    # so down's partial rows start aligned for float4 stores.
    assert (split_workspace_floats(1, 8, 2048, 768, 5, 1) * 4) % 16 == 0


def test_an_unsupported_activation_is_named() -> None:
    """The experts run gated SiLU only: choosing a kernel for another activation names
    the layer and the activation for each candidate, and a call that asks for one
    anyway is refused before it reads a weight."""
    from vllm.model_executor.layers.quantization.exl3 import moe_kernels as mk

    c = mk.Exl3MoEKernelConfig(
        "model.layers.0.mlp.experts",
        torch.device("cpu"),
        torch.bfloat16,
        "gelu",
        1,
        (4.0,),
    )
    with pytest.raises(ValueError) as e:
        mk.select_exl3_moe_backend(c)
    msg = str(e.value)
    assert "model.layers.0.mlp.experts: no MoE kernel" in msg, msg
    backends = list(mk.Exl3MoEBackend)
    assert msg.count("activation 'gelu' (supported: ('silu',))") == len(backends)
    for backend in backends:
        with pytest.raises(ValueError, match="EXL3 MoE: unsupported activation 'gelu'"):
            mk.backend_to_kernel_cls(backend)().apply(
                torch.zeros(1, 128),
                torch.ones(1, 1),
                torch.zeros(1, 1, dtype=torch.int32),
                None,
                activation="gelu",
                apply_router_weight_on_input=False,
                expert_map=None,
                global_num_experts=1,
                codebook=1,
                deterministic=True,
            )
