# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests of the quantized token embedding's row gather `_C::exl3_embedding`
(csrc/libtorch_stable/quantization/exl3/exl3_embedding.cu) against the reference decode
(embedding_reference.py, exl3-format.md §8).

The kernel rounds every fp32 operation in the reference's order, so its fp32 output
must equal the reference exactly, and its fp16 / bf16 output the reference rounded
once: no tolerance. Fresh random tables every run (the seed is in the failure message),
every rate, hidden sizes that are and are not multiples of the 256-wide group,
vocabularies of 1 row to the real 151,936, ids with duplicates and the first and last
rows, int32 and int64; outputs come from a NaN-poisoned allocation, and NaN never
compares equal. Also: tensor parallel shards as vLLM cuts them (summed over ranks = the
whole table), the input checks, an out-of-range id stopping the kernel with its
message, no allocation beyond the output (no dense table), CUDA-graph replay, and
opcheck of the schema and fake.

Needs a CUDA GPU and the extension: $VLLM_EXL3_EXT, build/exl3/_exl3_C.abi3.so (quick
build: `python -m vllm_exl3.kernels_build` from scripts/), or an installed vllm._exl3_C
or vLLM wheel with the EXL3 kernels.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from vllm_exl3.codec import embedding_reference
from vllm_exl3.testing import exl3_oracle as vk

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

try:
    EXTENSION = vk.load_extension()
except (ImportError, OSError, RuntimeError) as e:  # pragma: no cover - host dependent
    pytest.skip(f"EXL3 extension not available: {e}", allow_module_level=True)

if not hasattr(torch.ops._C, "exl3_embedding"):
    pytest.skip(
        f"{EXTENSION} has no _C::exl3_embedding (built before it)",
        allow_module_level=True,
    )

GROUP = 256
RATES = range(1, 9)
# (rows, hidden): one row; hidden a multiple of the group; hidden 320 (the second group
# padded) and 1000 (four groups, the last 232 wide), with vocabularies off the 64-row
# padding; Qwen3-8B's hidden size.
SHAPES = [(1, 256), (1000, 320), (4099, 1000), (3001, 4096)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOKENS = 300
# A real vocabulary and hidden size (Qwen2.5/3 32B-class: 151,936 x 5,120), 4 bits.
REAL = (151936, 5120, 4)


def random_table(
    rows: int, hidden: int, bits: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A table of random rings (every word sequence decodes), each group's scale of
    either sign and an embedding's magnitude, one row's scales 0 (a padding row)."""
    groups = -(-hidden // GROUP)
    words = 1 + 16 * bits
    trellis = torch.randint(
        -(2**15),
        2**15,
        (rows, groups, words),
        generator=gen,
        device="cuda",
        dtype=torch.int32,
    ).to(torch.int16)
    scales = torch.randn(rows, groups, generator=gen, device="cuda") * 0.02
    scales[rows // 2] = 0
    trellis[:, :, 0] = scales.half().view(torch.int16)
    signs = torch.randint(0, 2, (groups, GROUP), generator=gen, device="cuda") * 2 - 1
    return trellis.view(rows, groups * words), signs.half()


def random_ids(rows: int, count: int, gen: torch.Generator, dtype) -> torch.Tensor:
    """Random rows plus the first and last, several ids twice."""
    ids = torch.randint(0, rows, (count,), generator=gen, device="cuda")
    ids[:4] = torch.tensor([0, rows - 1, 0, rows - 1])
    ids[-3:] = ids[4:7]
    return ids.to(dtype)


def gather(ids, trellis, signs, hidden, dtype) -> torch.Tensor:
    """The op, its output taken from a freshly freed NaN-filled block of the caching
    allocator, so an element the kernel fails to write cannot pass."""
    poison = torch.full((ids.shape[0], hidden), math.nan, dtype=dtype, device="cuda")
    del poison
    return torch.ops._C.exl3_embedding(ids, trellis, signs, hidden, dtype)


def assert_reference(out, ids, trellis, signs, hidden, dtype, what: str) -> None:
    # The looked-up rows only, copied to the host (not the whole table).
    rows = trellis.index_select(0, ids.long()).cpu()
    want = embedding_reference.decode_rows(
        rows, signs.cpu(), torch.arange(ids.shape[0]), hidden
    ).to(dtype)
    got = out.cpu()
    assert got.dtype == dtype and got.shape == want.shape, what
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite output"
    # Equal values (NaN never is); a zero's sign may differ where vLLM's masking adds
    # +0 to it (the tensor-parallel case), which changes nothing downstream.
    if not bool((got == want).all()):
        diff = (got.float() - want.float()).abs()
        bad = int((got != want).sum())
        raise AssertionError(
            f"{what}: {bad} of {got.numel()} values differ from the reference, max "
            f"|diff| {diff.max().item():.3g} at {divmod(int(diff.argmax()), hidden)}"
        )


@pytest.fixture
def gen():
    g = torch.Generator(device="cuda")
    seed = g.seed()  # fresh inputs every run
    return g, seed


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("bits", RATES)
def test_gather_matches_reference(gen, bits, rows, hidden, dtype):
    g, seed = gen
    trellis, signs = random_table(rows, hidden, bits, g)
    for id_dtype in (torch.int64, torch.int32):
        ids = random_ids(rows, TOKENS, g, id_dtype)
        out = gather(ids, trellis, signs, hidden, dtype)
        assert_reference(
            out,
            ids,
            trellis,
            signs,
            hidden,
            dtype,
            f"{bits} bits, {rows} x {hidden}, {dtype}, ids {id_dtype}, seed {seed}",
        )


def test_real_vocabulary(gen):
    rows, hidden, bits = REAL
    g, seed = gen
    trellis, signs = random_table(rows, hidden, bits, g)
    ids = random_ids(rows, 64, g, torch.int64)
    out = gather(ids, trellis, signs, hidden, torch.bfloat16)
    assert_reference(
        out, ids, trellis, signs, hidden, torch.bfloat16, f"real vocab, seed {seed}"
    )


def test_no_dense_table_is_made(gen):
    """The gather allocates its output and nothing else."""
    rows, hidden, bits = REAL
    g, _ = gen
    trellis, signs = random_table(rows, hidden, bits, g)
    ids = random_ids(rows, 4096, g, torch.int64)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = torch.ops._C.exl3_embedding(ids, trellis, signs, hidden, torch.bfloat16)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= out.numel() * out.element_size() + (1 << 20), extra


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_shards(gen, world):
    """vLLM's VocabParallelEmbedding: the vocabulary padded to 64 and split evenly,
    each rank's rows past the real vocabulary zero, ids of other ranks mapped to row 0
    and their output zeroed; the ranks' sum is the whole table's lookup, exactly."""
    rows, hidden, bits = 4099, 1000, 3
    g, seed = gen
    trellis, signs = random_table(rows, hidden, bits, g)
    ids = random_ids(rows, TOKENS, g, torch.int64)
    padded = -(-rows // 64) * 64
    per_rank = padded // world
    total = torch.zeros(TOKENS, hidden, device="cuda")
    for rank in range(world):
        first = rank * per_rank
        shard = torch.zeros(
            per_rank, trellis.shape[1], dtype=torch.int16, device="cuda"
        )
        real = max(0, min(rows, first + per_rank) - first)
        shard[:real] = trellis[first : first + real]
        mine = (ids >= first) & (ids < first + real)
        local = torch.where(mine, ids - first, 0)
        out = gather(local, shard, signs, hidden, torch.float32)
        total += out.masked_fill(~mine[:, None], 0)
        # The padding rows decode to exact zeros.
        if real < per_rank:
            pad = torch.arange(real, per_rank, device="cuda")
            zeros = gather(pad, shard, signs, hidden, torch.float32)
            assert bool((zeros == 0).all()), f"rank {rank}: padding rows not zero"
    assert_reference(
        total, ids, trellis, signs, hidden, torch.float32, f"TP={world}, seed {seed}"
    )


def test_no_ids():
    trellis, signs = random_table(10, 320, 2, torch.Generator(device="cuda"))
    ids = torch.zeros(0, dtype=torch.int64, device="cuda")
    out = torch.ops._C.exl3_embedding(ids, trellis, signs, 320, torch.float16)
    assert out.shape == (0, 320) and out.dtype == torch.float16


def _checks():
    g = torch.Generator(device="cuda").manual_seed(0)
    trellis, signs = random_table(10, 320, 2, g)
    ids = torch.tensor([1, 2], device="cuda")
    good = (ids, trellis, signs, 320, torch.bfloat16)
    return good, [
        ((ids.float(),), "ids must be int64 or int32, got float32"),
        ((ids.cpu(),), "ids must be a CUDA tensor"),
        ((ids[None],), "ids must have 1 dimensions"),
        ((ids, trellis.int()), "trellis must be int16, got int32"),
        ((ids, trellis[:, :-1]), "trellis must be contiguous"),
        ((ids, trellis[:, :-2].contiguous()), r"is not \[rows >= 1, 2 groups"),
        ((ids, trellis, signs.float()), "signs must be float16, got float32"),
        ((ids, trellis, signs[:1].contiguous()), r"is not \[rows >= 1, 1 groups"),
        ((ids, trellis, signs, 256), "hidden = 256 does not fill 2 groups"),
        ((ids, trellis, signs, 513), "hidden = 513 does not fill 2 groups"),
        ((ids, trellis, signs, 320, torch.int32), "dtype must be float32, float16"),
    ]


@pytest.mark.parametrize("case", range(len(_checks()[1])))
def test_input_checks_name_the_tensor(case):
    good, cases = _checks()
    args, message = cases[case]
    full = (*args, *good[len(args) :])
    with pytest.raises(RuntimeError, match=rf"exl3_embedding: .*{message}"):
        torch.ops._C.exl3_embedding(*full)


# An id outside the table stops the kernel (a device-side error, as torch's own
# embedding raises), which leaves the CUDA context unusable: run it in a child.
OUT_OF_RANGE = """
import torch
from vllm_exl3.testing import exl3_oracle as vk
vk.load_extension()
trellis = torch.zeros(100, 33, dtype=torch.int16, device="cuda")
signs = torch.ones(1, 256, dtype=torch.float16, device="cuda")
ids = torch.tensor([5, 100, 7], device="cuda")
torch.ops._C.exl3_embedding(ids, trellis, signs, 256, torch.float16)
torch.cuda.synchronize()
print("NO ERROR")
"""


def test_out_of_range_id_stops_the_kernel():
    r = subprocess.run(
        [sys.executable, "-c", OUT_OF_RANGE], capture_output=True, text=True
    )
    output = r.stdout + r.stderr
    assert r.returncode != 0 and "NO ERROR" not in output, output[-2000:]
    assert "exl3_embedding: ids[1] = 100 is outside [0, 100)" in output, output[-2000:]


def test_cuda_graph_replay(gen):
    """Captured once, replayed with new ids in the same buffer."""
    rows, hidden, bits = 4099, 1000, 5
    g, seed = gen
    trellis, signs = random_table(rows, hidden, bits, g)
    ids = random_ids(rows, 64, g, torch.int64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        torch.ops._C.exl3_embedding(ids, trellis, signs, hidden, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops._C.exl3_embedding(ids, trellis, signs, hidden, torch.bfloat16)
    for _ in range(2):
        ids.copy_(random_ids(rows, 64, g, torch.int64))
        graph.replay()
        torch.cuda.synchronize()
        assert_reference(
            out, ids, trellis, signs, hidden, torch.bfloat16, f"graph, seed {seed}"
        )


def test_opcheck():
    """Schema, fake implementation (vLLM's embedding_ops registers it) and dispatch, as
    torch.compile meets the op."""
    embedding_ops = pytest.importorskip(
        "vllm.model_executor.layers.quantization.exl3.embedding_ops"
    )
    assert embedding_ops.load_exl3_embedding_op() == (True, None)
    g = torch.Generator(device="cuda").manual_seed(1)
    trellis, signs = random_table(200, 320, 4, g)
    for dtype in DTYPES:
        ids = random_ids(200, 33, g, torch.int64)
        torch.library.opcheck(
            torch.ops._C.exl3_embedding.default, (ids, trellis, signs, 320, dtype)
        )
