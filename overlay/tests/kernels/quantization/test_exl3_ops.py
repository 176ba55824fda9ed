# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The EXL3 ops `_C::exl3_linear` and `_C::exl3_reconstruct`: schemas, fake
implementations (opcheck) and, on CUDA, results against the reference codec.

Without the CUDA build (any machine without a GPU), the schemas are read from the
ops' registration in csrc/ and registered here with the reference codec as a CPU
kernel. opcheck then checks the Python wrappers and the fake implementations the EXL3
package registers against that kernel, as torch.compile meets them.

Run `pytest tests/kernels/quantization/test_exl3_ops.py`.
"""

import math
import re
from pathlib import Path

import pytest
import torch
from tests.kernels.utils import (
    ALL_OPCHECK_TEST_UTILS,
    DEFAULT_OPCHECK_TEST_UTILS,
    opcheck,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from vllm.model_executor.layers.quantization.exl3 import ops, plans, reference
from vllm.model_executor.layers.quantization.exl3.format import TILE, Codebook
from vllm.model_executor.layers.quantization.exl3.layout import trellis_words
from vllm.platforms import current_platform

OPS_SOURCES = Path(__file__).parents[3] / "csrc/libtorch_stable/quantization/exl3"
# (bits per weight, codebook): every codebook, low and high rates, a fractional one
# (MUL1 only).
RATES = [
    (2, Codebook.THREE_INST),
    (4, Codebook.THREE_INST),
    (8, Codebook.THREE_INST),
    (3, Codebook.MCG),
    (5, Codebook.MCG),
    (2.5, Codebook.MUL1),
    (6, Codebook.MUL1),
]
# (k, output widths of the fused shards): one shard; three shards (as qkv); a long k.
SHAPES = [(256, [256]), (512, [128, 256, 128]), (4096, [512])]
M_VALUES = [1, 16, 100, 1000]
# Output error bounds (fp16 operands, fp32 accumulation, one output rounding): relative
# Frobenius error and max |error| / rms(reference). The derivation is in the design
# notes.
TOLERANCE = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (5e-3, 6e-2)}


def linear_args(x, layer, bias) -> ops.Exl3LinearArgs:
    """The arguments of `_C::exl3_linear` (and `ops.exl3_linear`) in schema order:
    no plan table entries (the op's cost model plans every m) and a zeroed workspace
    large enough for split-k at every m tested."""
    header = plans.plan_header(False, False, plans.PlanPins())
    workspace = torch.zeros(
        max(M_VALUES) * sum(layer["widths"]), dtype=torch.float32, device=x.device
    )
    return ops.Exl3LinearArgs(
        x,
        layer["trellis"],
        layer["suh"],
        layer["svh"],
        bias,
        layer["widths"],
        int(layer["codebook"]),
        header,
        workspace,
    )


def _linear_cpu(x, trellis, suh, svh, bias, shard_widths, codebook, *plan):
    """The reference codec as the op's CPU kernel; a kernel `plan` does not apply."""
    return reference.forward(x, trellis, suh, svh, codebook, shard_widths, bias).to(
        x.dtype
    )


def _reconstruct_cpu(trellis, codebook):
    return reference.decode_rotated(trellis, codebook)


def op_schemas() -> dict[str, str]:
    """name -> schema of every op the EXL3 sources define in `_C`."""
    schemas = {}
    for src in sorted(OPS_SOURCES.glob("*.c*")):
        text = src.read_text()
        for block in re.findall(
            r"STABLE_TORCH_LIBRARY_FRAGMENT\(_C,\s*\w+\)\s*\{(.*?)\n\}", text, re.S
        ):
            for literals in re.findall(r"\.def\(\s*((?:\"[^\"]*\"\s*)+)\)", block):
                schema = "".join(re.findall(r"\"([^\"]*)\"", literals))
                schemas[schema.split("(", 1)[0]] = schema
    return schemas


@pytest.fixture(scope="module")
def device():
    """Where the ops run: CUDA when the build's kernels load, else the CPU stand-in."""
    if current_platform.is_cuda() and ops.load_exl3_ops()[0]:
        yield "cuda"
        return
    schemas = op_schemas()
    if not {"exl3_linear", "exl3_reconstruct"} <= schemas.keys():
        pytest.fail(
            f"no exl3_linear / exl3_reconstruct registration under {OPS_SOURCES}"
        )
    lib = torch.library.Library("_C", "FRAGMENT")
    for schema in schemas.values():
        lib.define(schema)
    lib.impl("exl3_linear", _linear_cpu, "CPU")
    lib.impl("exl3_reconstruct", _reconstruct_cpu, "CPU")
    ops.load_exl3_ops.cache_clear()
    assert ops.load_exl3_ops() == (True, None)
    yield "cpu"
    ops.load_exl3_ops.cache_clear()
    lib._destroy()


def random_layer(
    k: int,
    widths: list[int],
    bits: float,
    codebook: Codebook,
    device: str,
    gen: torch.Generator,
) -> dict:
    """Random codes are valid trellises; scales are signed, two output channels
    exactly 0 (as padded channels are)."""
    n = sum(widths)

    def scales(*shape: int) -> torch.Tensor:
        mag = 0.5 + torch.rand(shape, generator=gen, device=device)
        sign = torch.rand(shape, generator=gen, device=device) < 0.5
        return torch.where(sign, -mag, mag).half()

    svh = scales(n)
    svh[torch.randint(0, n, (2,), generator=gen, device=device)] = 0
    trellis = torch.randint(
        -(2**15),
        2**15,
        (k // TILE, n // TILE, trellis_words(bits)),
        generator=gen,
        device=device,
        dtype=torch.int32,
    ).to(torch.int16)
    return {
        "trellis": trellis,
        "suh": scales(len(widths), k),
        "svh": svh,
        "widths": widths,
        "codebook": codebook,
    }


def fresh_generator(device: str) -> tuple[torch.Generator, int]:
    gen = torch.Generator(device=device)
    return gen, gen.seed()


# What opcheck exercises is the schema and the fake, not the arithmetic: one case per
# codebook.
OPCHECK_CASES = [
    (2, Codebook.THREE_INST, 256, [256], torch.float16),
    (3, Codebook.MCG, 512, [128, 256, 128], torch.bfloat16),
    (2.5, Codebook.MUL1, 256, [128, 128], torch.bfloat16),
]


@pytest.mark.parametrize("bits,codebook,k,widths,dtype", OPCHECK_CASES)
def test_exl3_linear_opcheck(device, bits, codebook, k, widths, dtype):
    gen, _ = fresh_generator(device)
    layer = random_layer(k, widths, bits, codebook, device, gen)
    x = torch.randn(33, k, generator=gen, device=device).to(dtype)
    bias = torch.randn(sum(widths), generator=gen, device=device).to(dtype)
    # test_aot_dispatch_dynamic compares values between calls, which needs one reduction
    # order: the CUDA op may pick another plan from call to call. The fake's dynamic
    # shapes are the same either way, and checked against the CPU kernel.
    utils = ALL_OPCHECK_TEST_UTILS if device == "cpu" else DEFAULT_OPCHECK_TEST_UTILS
    for b in (None, bias):
        opcheck(
            torch.ops._C.exl3_linear.default,
            tuple(linear_args(x, layer, b)),
            test_utils=utils,
        )


@pytest.mark.parametrize("bits,codebook", [c[:2] for c in OPCHECK_CASES])
def test_exl3_reconstruct_opcheck(device, bits, codebook):
    gen, _ = fresh_generator(device)
    layer = random_layer(256, [384], bits, codebook, device, gen)
    opcheck(torch.ops._C.exl3_reconstruct.default, (layer["trellis"], int(codebook)))


def test_exl3_fakes(device):
    """The wrappers under FakeTensorMode (as Dynamo traces them): shapes, dtypes."""
    gen, _ = fresh_generator(device)
    layer = random_layer(512, [128, 256, 128], 4, Codebook.MCG, device, gen)
    with FakeTensorMode() as mode:
        fake = {
            k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
            for k, v in layer.items()
        }
        x = torch.empty(7, 512, dtype=torch.bfloat16, device=device)
        y = ops.exl3_linear(linear_args(x, fake, None))
        w_hat = ops.exl3_reconstruct(fake["trellis"], int(Codebook.MCG))
    assert (tuple(y.shape), y.dtype) == ((7, 512), torch.bfloat16)
    assert (tuple(w_hat.shape), w_hat.dtype) == ((512, 512), torch.float16)


@pytest.mark.skipif(not current_platform.is_cuda(), reason="needs the CUDA build")
def test_exl3_schemas_match_the_sources(device):
    if device != "cuda":
        pytest.skip("the EXL3 CUDA kernels are not built into this vLLM")
    for name, schema in op_schemas().items():
        registered = getattr(torch.ops._C, name).default._schema
        assert str(registered) == str(torch._C.parse_schema(f"_C::{schema}")), name


def _errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max |error| / rms(ref)); NaN or Inf never passes."""
    if not bool(torch.isfinite(y).all()):
        return math.inf, math.inf
    d = y.double() - ref
    norm = float(ref.norm())
    rms = norm / math.sqrt(ref.numel())
    return float(d.norm()) / norm, float(d.abs().max()) / rms


@pytest.mark.skipif(not current_platform.is_cuda(), reason="needs the CUDA build")
@pytest.mark.parametrize("bits,codebook", RATES)
@pytest.mark.parametrize("k,widths", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exl3_linear_matches_reference(device, bits, codebook, k, widths, dtype):
    if device != "cuda":
        pytest.skip("the EXL3 CUDA kernels are not built into this vLLM")
    gen, seed = fresh_generator(device)
    layer = random_layer(k, widths, bits, codebook, device, gen)
    bias = torch.randn(sum(widths), generator=gen, device=device).to(dtype)
    tol_rel, tol_max = TOLERANCE[dtype]
    for m in M_VALUES:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        b = bias if m == M_VALUES[-1] else None
        # The op takes its output from torch's caching allocator: leave a NaN-filled
        # block of that size there, so a tile the kernel fails to write cannot pass.
        poison = torch.full((m, sum(widths)), math.nan, dtype=dtype, device=device)
        del poison
        y = ops.exl3_linear(linear_args(x, layer, b))
        ref = reference.forward(
            x,
            layer["trellis"],
            layer["suh"],
            layer["svh"],
            int(codebook),
            widths,
            b,
            dtype=torch.float64,
        )
        assert y.dtype == dtype and y.shape == ref.shape
        rel, worst = _errors(y, ref)
        assert rel <= tol_rel and worst <= tol_max, (
            f"m={m} bias={b is not None} seed={seed}: relative error {rel:.3g} (bound "
            f"{tol_rel}), max error {worst:.3g} rms (bound {tol_max})"
        )


@pytest.mark.skipif(not current_platform.is_cuda(), reason="needs the CUDA build")
@pytest.mark.parametrize("bits,codebook", RATES)
def test_exl3_reconstruct_bit_exact(device, bits, codebook):
    if device != "cuda":
        pytest.skip("the EXL3 CUDA kernels are not built into this vLLM")
    gen, seed = fresh_generator(device)
    layer = random_layer(256, [384], bits, codebook, device, gen)
    w_hat = ops.exl3_reconstruct(layer["trellis"], int(codebook))
    expected = reference.decode_rotated(layer["trellis"], int(codebook))
    assert w_hat.dtype == torch.float16
    assert torch.equal(w_hat.view(torch.int16), expected.view(torch.int16)), (
        f"seed={seed}"
    )
