# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sparse-MLA decode wrapper (vllm/v1/attention/ops/exl3_sparse_mla.py) without a
GPU: its input checks, the split-k / workspace rule (the same as the C++ header's), the
fp32 reference against a float64 loop, the fp8_ds_mla row codec, and the fake
implementation under torch.compile (a spawned process registers a CPU stand-in)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.multiprocessing as mp
from vllm.v1.attention.ops import exl3_sparse_mla as mla
from vllm_exl3.repo import ROOT as REPO

HEADER = REPO / "csrc/libtorch_stable/attention/exl3_sparse_mla/exl3_sparse_mla.cuh"
H100_SMS, H200_SMS = 132, 132


def inputs(t=3, h=5, d=576, topk=7, nb=4, bs=8, fmt=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((t, h, d), generator=g).to(torch.bfloat16)
    kv = torch.randn((nb, bs, d), generator=g)
    cache = mla.quantize_fp8_ds_mla(kv) if fmt else kv.to(torch.bfloat16)
    idx = torch.randint(-1, nb * bs, (t, topk), generator=g, dtype=torch.int32)
    return q, cache, idx


# --- the split rule -----------------------------------------------------------------


def test_constants_mirror_the_cuda_header() -> None:
    text = HEADER.read_text()
    for name, value in {
        "kHeadsPerMma": mla.HEADS_PER_MMA,
        "kTwoTileMinHeads": mla.TWO_TILE_MIN_HEADS,
        "kRowsPerTile": mla.ROWS_PER_TILE,
        "kWgHeads": mla.WGMMA_HEADS,
        "kSplitCtasPerSmOneTile": mla.SPLIT_CTAS_PER_SM_ONE_TILE,
        "kSplitCtasPerSmTwoTiles": mla.SPLIT_CTAS_PER_SM_TWO_TILES,
        "kMinTilesPerSplit": mla.MIN_TILES_PER_SPLIT,
        "kMaxSplits": mla.MAX_SPLITS,
        "kLatent": mla.LATENT,
        "kRope": mla.ROPE,
        "kFp8ScaleGroup": mla.FP8_SCALE_GROUP,
    }.items():
        m = re.search(rf"constexpr int {name} = (\d+);", text)
        assert m and int(m.group(1)) == value, name


def test_split_rule() -> None:
    # enough work to fill every slot (two CTAs per SM at 16 heads, one group of 64
    # heads per SM from 64 heads on) without splitting: one pass, no workspace
    assert mla.num_splits(133, 16, 2048, 132) == 1
    assert mla.num_splits(67, 128, 2048, 132) == 1  # 2 groups of 64 heads
    assert mla.num_splits(66, 128, 2048, 132) == 1  # 132 units: one full pass
    assert mla.num_splits(33, 128, 2048, 132) == 2  # 66 units: two splits fill it
    # 132 tokens of 16 heads fill one of the two slots per SM: two splits
    assert mla.num_splits(132, 16, 2048, 132) == 2
    # never a second, partial wave: 128 CTAs of 16 heads take 2 splits, not 3
    assert mla.num_splits(128, 16, 2048, 132) == 2
    assert mla.num_splits(100, 16, 2048, 132) == 2
    assert [mla.head_groups(h) for h in (1, 16, 17, 63, 64, 100, 128)] == [
        1,
        1,
        2,
        4,
        2,
        4,
        4,
    ]
    assert mla.workspace_bytes(133, 16, 2048, sm_count=132) == 0
    # one token: 64 tiles cut into 32 splits of 2 (the minimum length)
    assert mla.num_splits(1, 16, 2048, 132) == 32
    assert [mla.split_units(h) for h in (1, 16, 17, 63, 64, 65, 100, 128)] == [
        1,
        1,
        2,
        4,
        1,
        2,
        2,
        2,
    ]
    # 8 tokens x 2 groups of 64 heads = 16 units, one slot per SM: 8 splits
    assert mla.num_splits(8, 128, 2048, 132) == 8
    # 20 tokens x 2 groups = 40 units: 3 splits of 22, 22 and 20 tiles
    assert mla.num_splits(20, 128, 2048, 132) == 3
    # 80 units: a second split would overfill the 132 slots
    assert mla.num_splits(40, 100, 2048, 132) == 1
    # short lists are not split below two tiles
    assert mla.num_splits(1, 16, 64, 132) == 1
    assert mla.num_splits(1, 16, 96, 132) == 1
    assert mla.num_splits(0, 16, 2048, 132) == 1


@pytest.mark.parametrize("sms", [1, 20, 48, 132, 188])
def test_splits_are_never_empty_and_cover_the_list(sms: int) -> None:
    for t in (1, 2, 3, 7, 31, 100):
        for h in (1, 16, 17, 64, 65, 128):
            for topk in (1, 31, 32, 33, 64, 100, 2048, 4095, 4096):
                s = mla.num_splits(t, h, topk, sms)
                tiles = math.ceil(topk / mla.ROWS_PER_TILE)
                per = math.ceil(tiles / s)
                assert 1 <= s <= mla.MAX_SPLITS
                assert (s - 1) * per < tiles <= s * per, (t, h, topk, sms)
                assert s == 1 or per >= mla.MIN_TILES_PER_SPLIT
                need = mla.workspace_bytes(t, h, topk, sm_count=sms)
                assert need == (0 if s == 1 else 4 * s * t * h * 513)


def test_max_workspace_covers_every_batch() -> None:
    for sms in (8, 132, 188):
        for h in (1, 16, 65, 128):
            for topk in (64, 2048, 4096):
                for max_t in (1, 5, 64, 8192):
                    top = mla.max_workspace_bytes(max_t, h, topk, sm_count=sms)
                    need = [
                        mla.workspace_bytes(t, h, topk, sm_count=sms)
                        for t in range(1, min(max_t, 400) + 1)
                    ]
                    assert top == max(need), (sms, h, topk, max_t)


# --- input checks -------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda a: a.update(q=a["q"].float()), "q must be a bfloat16 tensor"),
        (lambda a: a.update(q=a["q"][0]), "q must be [tokens, heads, head_size]"),
        (lambda a: a.update(q=a["q"][..., :448]), "head size must be 576"),
        (
            lambda a: a.update(q=torch.zeros((3, 129, 576), dtype=torch.bfloat16)),
            "129 heads; 1..128",
        ),
        (
            lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
            "q's last dimension must be contiguous",
        ),
        (lambda a: a.update(fmt=3), "kv_format must be 0"),
        (lambda a: a.update(fmt="fp8_e5m2"), "kv_format 'fp8_e5m2' is not one of"),
        (lambda a: a.update(fmt=1), "must have a 1-byte dtype"),
        (lambda a: a.update(cache=a["cache"].float()), "must be bfloat16, got"),
        (lambda a: a.update(cache=a["cache"][..., :512]), "rows do not match"),
        (lambda a: a.update(cache=a["cache"][0]), "kv_cache must be [num_blocks"),
        (lambda a: a.update(cache=a["cache"][:0]), "is empty"),
        (
            lambda a: a.update(
                cache=a["cache"].transpose(0, 2).contiguous().transpose(0, 2)
            ),
            "kv_cache rows must be contiguous",
        ),
        (lambda a: a.update(idx=a["idx"].long()), "indices must be int32"),
        (lambda a: a.update(idx=a["idx"][:2]), "indices must be [tokens = 3, topk]"),
        (lambda a: a.update(idx=a["idx"][:, :0]), "topk (indices.shape[1]) must be"),
        (
            lambda a: a.update(idx=a["idx"].t().contiguous().t()),
            "indices' last dimension",
        ),
        (lambda a: a.update(scale=float("nan")), "scale must be finite"),
    ],
)
def test_checks_name_the_argument(change, needle) -> None:
    q, cache, idx = inputs()
    a = dict(q=q, cache=cache, idx=idx, fmt=0, scale=0.1)
    change(a)
    with pytest.raises(mla.SparseMLAInputError) as ei:
        mla.check_inputs(a["q"], a["cache"], a["idx"], a["scale"], a["fmt"])
    assert str(ei.value).startswith("exl3_sparse_mla_decode: ")
    assert needle in str(ei.value), str(ei.value)


def test_decode_on_cpu_tensors_says_why() -> None:
    """Without the extension: the op is not available; with it: CPU tensors are
    refused (either way an error naming the op, never a dispatcher trace)."""
    q, cache, idx = inputs()
    with pytest.raises(
        (RuntimeError, mla.SparseMLAInputError), match="exl3_sparse_mla_decode"
    ):
        mla.sparse_mla_decode(q, cache, idx, 0.1, 0)


def test_fp8_checks() -> None:
    q, cache, idx = inputs(fmt=1)
    # float8 storage is viewed as the uint8 rows the op reads
    viewed, fmt = mla.check_inputs(
        q, cache.view(torch.float8_e4m3fn), idx, 0.1, "fp8_ds_mla"
    )
    assert viewed.dtype == torch.uint8 and fmt == mla.KV_FORMAT_FP8_DS_MLA
    with pytest.raises(mla.SparseMLAInputError, match="656 bytes"):
        mla.check_inputs(q, cache[..., :640], idx, 0.1, 1)
    with pytest.raises(
        mla.SparseMLAInputError, match="576-wide rows but q's head size is 512"
    ):
        mla.check_inputs(q[..., :512], cache, idx, 0.1, 1)


# --- the reference ------------------------------------------------------------------


def direct(q, cache, idx, scale, fmt):
    """float64, one token and head at a time."""
    t, h, _ = q.shape
    nb, bs = cache.shape[:2]
    out = torch.zeros((t, h, 512), dtype=torch.float64)
    lse = torch.full((t, h), -math.inf, dtype=torch.float64)
    for i in range(t):
        sel = [int(s) for s in idx[i] if 0 <= int(s) < nb * bs]
        if not sel:
            continue
        rows = torch.stack([cache[s // bs, s % bs] for s in sel])
        k = (mla.dequantize_fp8_ds_mla(rows) if fmt else rows.float()).double()
        for j in range(h):
            s = (k @ q[i, j].double()) * scale
            m = s.max()
            w = torch.exp(s - m)
            out[i, j] = (w[:, None] * k[:, :512]).sum(0) / w.sum()
            lse[i, j] = m + torch.log(w.sum())
    return out, lse


@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("d", [576, 512])
def test_reference_matches_float64(fmt: int, d: int) -> None:
    if fmt and d == 512:
        pytest.skip("fp8_ds_mla rows are 576 wide")
    q, cache, idx = inputs(t=4, h=3, d=d, topk=9, fmt=fmt, seed=fmt * 10 + d)
    idx[1] = -1  # an empty token
    idx[2, :3] = 10_000  # slots outside the cache count as none
    out, lse = mla.sparse_mla_reference(q, cache, idx, 0.2, fmt)
    ref_out, ref_lse = direct(q, cache, idx, 0.2, fmt)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all()


@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_reference_into_chunks_write_every_token(monkeypatch, fmt, chunk) -> None:
    """The backend's forced-reference path: chunk after chunk into poisoned outputs,
    the same as the reference on the whole batch (out rounded to bf16 once)."""
    q, cache, idx = inputs(t=7, h=4, topk=9, fmt=fmt, seed=40 + fmt)
    # Slot 0 (the row a "none" slot is gathered from) is an unwritten NaN row.
    cache.view(torch.uint8)[0, 0] = 0xFF
    idx[idx == 0] = 1
    idx[2] = -1  # an empty token
    idx[5, :4] = 10_000  # slots outside the cache count as none
    monkeypatch.setattr(mla, "REFERENCE_CHUNK_BYTES", chunk * 9 * 576 * 4)
    assert mla.reference_chunk_tokens(9, 576) == chunk
    out = torch.full((7, 4, 512), math.nan, dtype=torch.bfloat16)
    lse = torch.full((7, 4), math.nan)
    got_out, got_lse = mla.sparse_mla_reference_into(
        q, cache, idx, 0.2, fmt, out=out, lse=lse
    )
    assert got_out is out and got_lse is lse
    ref_out, ref_lse = mla.sparse_mla_reference(q, cache, idx, 0.2, fmt)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(
        out.float(), ref_out.to(torch.bfloat16).float(), rtol=2.0**-7, atol=1e-6
    )
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isinf(lse[2]).all() and (lse[2] < 0).all()


def test_reference_into_reads_no_value_on_the_host(monkeypatch) -> None:
    """On meta tensors (no values) any .item(), tensor -> bool or nonzero raises: the
    forced-reference path runs there, so nothing in it syncs a CUDA stream and a CUDA
    graph captures it."""
    monkeypatch.setattr(mla, "REFERENCE_CHUNK_BYTES", 2 * 9 * 576 * 4)
    for fmt in (0, 1):
        q, cache, idx = (x.to("meta") for x in inputs(t=5, h=4, topk=9, fmt=fmt))
        out, lse = mla.sparse_mla_reference_into(q, cache, idx, 0.2, fmt)
        assert out.shape == (5, 4, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (5, 4) and lse.dtype == torch.float32
    with pytest.raises(RuntimeError):
        bool(idx[0, 0] >= 0)  # the probe: a host read does fail on meta


def test_reference_into_checks_its_outputs() -> None:
    q, cache, idx = inputs(t=3, h=2, topk=5)
    bad = torch.empty((3, 2, 512), dtype=torch.float32)
    with pytest.raises(mla.SparseMLAInputError, match="out must be bfloat16"):
        mla.sparse_mla_reference_into(q, cache, idx, 0.2, 0, out=bad)
    with pytest.raises(mla.SparseMLAInputError, match=r"lse must be float32 \[3, 2\]"):
        mla.sparse_mla_reference_into(q, cache, idx, 0.2, 0, lse=torch.empty(3, 3))


def test_fp8_rows_roundtrip_like_the_cache_writer() -> None:
    kv = torch.randn((5, 576)) * torch.tensor([3.0] * 128 + [0.01] * 128 + [1.0] * 320)
    kv[2, 128:256] = 0.0  # an all-zero group: scale FLT_MIN, values 0
    rows = mla.quantize_fp8_ds_mla(kv)
    assert rows.shape == (5, 656) and rows.dtype == torch.uint8
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    amax = kv[:, :512].view(5, 4, 128).abs().amax(-1)
    torch.testing.assert_close(
        scales, (amax / 448).clamp_min(torch.finfo(torch.float32).tiny)
    )
    back = mla.dequantize_fp8_ds_mla(rows)
    assert torch.equal(back[:, 512:], kv[:, 512:].to(torch.bfloat16).float())
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each group's amax
    err = (back[:, :512] - kv[:, :512]).view(5, 4, 128).abs().amax(-1)
    assert bool((err <= amax / 16 + 1e-30).all())
    assert torch.equal(back[2, 128:256], torch.zeros(128))


# --- the fake under torch.compile ---------------------------------------------------


def _compile_with_stand_in(conn) -> None:
    try:
        lib = torch.library.Library("_C", "FRAGMENT")  # noqa: F841 - keeps it alive
        lib.define(
            "exl3_sparse_mla_decode(Tensor q, Tensor kv_cache, Tensor indices, "
            "float scale, int kv_format, Tensor(a!) out, Tensor(b!) lse, "
            "Tensor workspace) -> ()"
        )

        def cpu_impl(q, kv_cache, indices, scale, kv_format, out, lse, workspace):
            o, l_ = mla.sparse_mla_reference(q, kv_cache, indices, scale, kv_format)
            out.copy_(o)
            lse.copy_(l_)

        lib.impl("exl3_sparse_mla_decode", cpu_impl, "CPU")
        ok, why = mla.load_sparse_mla_op()
        assert ok, why
        assert torch._C._dispatch_has_kernel_for_dispatch_key(
            "_C::exl3_sparse_mla_decode", "Meta"
        )
        q, cache, idx = inputs(t=2, h=4, topk=6)

        def f(q, cache, idx):
            out = q.new_empty((q.shape[0], q.shape[1], 512))
            lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
            mla.sparse_mla_decode(q, cache, idx, 0.3, 0, out, lse)
            return out * 2, lse

        got_out, got_lse = torch.compile(f, backend="aot_eager", fullgraph=True)(
            q, cache, idx
        )
        ref_out, ref_lse = mla.sparse_mla_reference(q, cache, idx, 0.3, 0)
        torch.testing.assert_close(
            got_out.float(), 2 * ref_out.to(torch.bfloat16).float()
        )
        torch.testing.assert_close(got_lse, ref_lse)
        conn.send(None)
    except BaseException as e:  # report to the parent
        conn.send(repr(e))


def test_fake_traces_under_torch_compile() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_compile_with_stand_in, args=(child,))
    p.start()
    p.join(300)
    assert p.exitcode == 0, f"exit code {p.exitcode}"
    err = parent.recv()
    assert err is None, err


def test_fake_returns_nothing() -> None:
    q, cache, idx = inputs()
    out = torch.empty((3, 5, 512), dtype=torch.bfloat16)
    lse = torch.empty((3, 5))
    assert mla.sparse_mla_decode_fake(q, cache, idx, 0.1, 0, out, lse, out) is None
