# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The op wrappers and fake implementations without a GPU: a spawned process registers a
CPU stand-in for `_C::exl3_linear` / `_C::exl3_reconstruct` (what the quick-build
extension registers for CUDA), after which the CUDA kernel class's path is live:
`load_exl3_ops` finds the ops and registers the fakes, and a real vLLM layer's `apply`
traces under torch.compile (aot_eager: fake tensors through the op, as Dynamo does in
vLLM) to the reference result."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

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
    from exl3_harness import (
        CKPT_MCG,
        assert_matches,
        config_for,
        dense,
        gloo_world,
        load_module,
    )
    from exl3_harness import tensors as fixture_tensors
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization.exl3 import ops, reference
    from vllm.model_executor.layers.quantization.exl3.kernels import CudaExl3Kernel
    from vllm.model_executor.layers.quantization.exl3.linear import layer_runs

    assert ops.load_exl3_ops.__wrapped__()[0] is False  # nothing registered yet
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
        kernel = CudaExl3Kernel()  # the op path, here on CPU tensors
        kernel.prepare(layer_runs(layer.quant_method.layout, layer))
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
