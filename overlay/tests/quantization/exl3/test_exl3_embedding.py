# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Quantized token embeddings (`--embed_bits`, exl3-format.md §8) on the CPU.

The reference decode against the format's test vectors (decoded by ExLlamaV3 1.6.5's own
decoder) and an independent bit packer; the container's validation, failing closed with
the tensor and the rule; a synthetic checkpoint with a quantized `embed_tokens` in
ExLlamaV3's layout loaded through vLLM's real Qwen3 class, its lookups equal to the
reference decode of the same rows and its logits to transformers' Qwen3 on the decoded
weights; tensor parallel 2 over gloo equal to TP=1; damaged embedding tensors named.
The CUDA row gather is checked against the same reference in
tests/kernels/quantization/test_exl3_embedding.py (GPU).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch._subclasses.fake_tensor import FakeTensorMode
from vllm.model_executor.layers.quantization.exl3 import (
    embedding_ops,
    embedding_reference,
)
from vllm.model_executor.layers.quantization.exl3.format import (
    Exl3FormatError,
    embedding_spec,
)
from vllm_exl3.testing import synthetic_checkpoint as synth

from .exl3_harness import config_for, dense, gloo_world

EMBED = "model.embed_tokens"
GROUP = 256
# The §7 LCG.
LCG_MULT = 6364136223846793005
LCG_ADD = 1442695040888963407
MASK64 = (1 << 64) - 1

# qwen3-tiny with a hidden size that is not a multiple of the 256-wide group (two
# groups, the second padded) and a vocabulary vLLM pads to 4032 (2016 rows per rank
# at TP=2, the last 32 of rank 1 padding).
HIDDEN, VOCAB, VOCAB_PADDED = 320, 4000, 4032
MODEL = {
    **synth.PRESETS["qwen3-tiny"],
    "hidden_size": HIDDEN,
    "vocab_size": VOCAB,
    "num_hidden_layers": 1,
    "layer_types": ["full_attention"],
}
EMBED_BITS = 4
# Token ids: each shard's first and last rows, duplicates, rows of both ranks.
IDS = torch.tensor([0, 1, 2015, 2016, 3999, 7, 7, 2016, 3000, 0, 1234, 3999])


def lcg16(seed: int, count: int) -> list[int]:
    x, out = seed, []
    for _ in range(count):
        x = (x * LCG_MULT + LCG_ADD) & MASK64
        out.append(x >> 48)
    return out


def lcg_embedding(
    seed: int, rows: int, groups: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The §8.4 table: LCG words, LCG scales in word 0, LCG signs."""
    words = 1 + 16 * bits
    raw = lcg16(seed, rows * groups * words)
    table = torch.tensor([v - 65536 if v >= 32768 else v for v in raw])
    table = table.to(torch.int16).view(rows, groups, words)
    scales = [
        (-1.0 if r & 0x8000 else 1.0) * (0.5 + (r & 0x3FF) / 1024) / 64
        for r in lcg16(seed + 1, rows * groups)
    ]
    table[:, :, 0] = torch.tensor(scales).half().view(torch.int16).view(rows, groups)
    signs = [1.0 if r & 1 else -1.0 for r in lcg16(seed + 2, groups * GROUP)]
    return table.view(rows, -1), torch.tensor(signs).half().view(groups, GROUP)


# exl3-format.md §8.4: (bits, hidden, rows) -> (SHA-256 prefix of the fp32 rows, row 0
# elements 0..2, last element), from ExLlamaV3 1.6.5's dequant_rows.
VECTORS = {
    (1, 256, 3): (
        "8b10ca149cfd0755",
        (-0.0044193319, -0.00202852674, 0.0123721119),
        -0.000858510844,
    ),
    (3, 320, 4): (
        "ecf41a7db4217be2",
        (0.0108176973, -0.0122549608, -0.0230562277),
        0.00593652204,
    ),
    (4, 512, 4): (
        "93e929ecaeb34a95",
        (-0.0125043597, 0.00110259175, 0.00773966871),
        0.00102129532,
    ),
    (8, 300, 3): (
        "f6a914b68bd1a4c3",
        (-0.0129923392, -0.00811094791, 0.0206833445),
        -0.000739502953,
    ),
}


@pytest.mark.parametrize("case", sorted(VECTORS), ids=lambda c: f"{c[0]}b-h{c[1]}")
def test_format_test_vectors(case):
    bits, hidden, rows = case
    sha, first, last = VECTORS[case]
    table, signs = lcg_embedding(1000 + bits, rows, -(-hidden // GROUP), bits)
    got = embedding_reference.decode_rows(table, signs, torch.arange(rows), hidden)
    assert got.dtype == torch.float32 and got.shape == (rows, hidden)
    assert hashlib.sha256(got.numpy().tobytes()).hexdigest()[:16] == sha
    assert got[0, :3].tolist() == pytest.approx(first, rel=1e-8)
    assert got[-1, -1].item() == pytest.approx(last, rel=1e-8)


def pack_symbols(symbols: list[int], bits: int) -> list[int]:
    """One ring's stream words, written from the format's words (§8.2): symbol i is
    stream bits [i*K, i*K + K), lowest bit first; stream bit b is bit b % 16 of word
    b // 16."""
    stream = [(s >> t) & 1 for s in symbols for t in range(bits)]
    return [
        sum(bit << j for j, bit in enumerate(stream[w : w + 16]))
        for w in range(0, len(stream), 16)
    ]


@pytest.mark.parametrize("bits", range(1, 9))
def test_states_follow_the_ring(bits):
    symbols = [v & ((1 << bits) - 1) for v in lcg16(50 + bits, GROUP)]
    words = [0x3C00] + pack_symbols(symbols, bits)  # scale 1.0, then the stream
    ring = torch.tensor([w - 65536 if w >= 32768 else w for w in words])
    states = embedding_reference.ring_states(ring.to(torch.int16)[None], bits)[0]
    # s_i = ((s_{i-1} << K) | symbol_i) & 0xFFFF around the ring: two laps settle it.
    state, want = 0, []
    for i in range(2 * GROUP):
        state = ((state << bits) | symbols[i % GROUP]) & 0xFFFF
        if i >= GROUP:
            want.append(state)
    assert states.tolist() == want


def test_rows_are_gathered_and_decoded_alone():
    table, signs = lcg_embedding(7, 50, 2, 3)
    full = embedding_reference.decode_rows(table, signs, torch.arange(50), 300)
    ids = torch.tensor([[49, 0, 17], [17, 17, 3]], dtype=torch.int32)
    got = embedding_reference.decode_rows(table, signs, ids, 300)
    assert got.shape == (2, 3, 300)
    assert torch.equal(got, full[ids.long()])
    # One row alone decodes to the same values: nothing depends on the other rows.
    alone = embedding_reference.decode_rows(table[17:18], signs, torch.tensor([0]), 300)
    assert torch.equal(alone[0], full[17])
    # A zero row (a rank's padding) decodes to exact zeros.
    table[5] = 0
    zero = embedding_reference.decode_rows(table, signs, torch.tensor([5]), 300)
    assert torch.all(zero == 0)


@pytest.mark.parametrize(
    "ids,message",
    [
        (
            torch.tensor([3, 50]),
            "ids: token id 50 is outside [0, 50), the rows of E.trellis",
        ),
        (torch.tensor([-1]), "ids: token id -1 is outside [0, 50)"),
        (torch.tensor([1.0]), "ids: dtype torch.float32, expected int32 or int64"),
    ],
)
def test_reference_rejects_bad_ids(ids, message):
    table, signs = lcg_embedding(7, 50, 1, 2)
    with pytest.raises(Exl3FormatError, match=re.escape(message)):
        embedding_reference.decode_rows(table, signs, ids, 256, "E")


def test_reference_rejects_a_hidden_size_its_groups_do_not_hold():
    table, signs = lcg_embedding(7, 4, 2, 2)
    with pytest.raises(Exl3FormatError, match=r"E: hidden 513 is outside \(0, 512\]"):
        embedding_reference.decode_rows(table, signs, torch.tensor([0]), 513, "E")


GOOD = {"trellis": ((4000, 2 * 65), "I16"), "signs": ((2, 256), "F16")}


@pytest.mark.parametrize(
    "edit,needles",
    [
        ({"weight": ((4000, 320), "BF16")}, ("E.weight", "unexpected tensor")),
        ({"signs": None}, ("E.signs", "missing tensor")),
        ({"trellis": None}, ("E.trellis", "missing tensor")),
        ({"trellis": ((4000, 130), "F16")}, ("E.trellis", "dtype F16, expected I16")),
        ({"signs": ((2, 256), "F32")}, ("E.signs", "dtype F32, expected F16")),
        ({"signs": ((2, 128), "F16")}, ("E.signs", "expected [groups, 256]")),
        ({"signs": ((512,), "F16")}, ("E.signs", "expected [groups, 256]")),
        ({"trellis": ((4000, 131), "I16")}, ("E.trellis", "width 131 is not 2 groups")),
        ({"trellis": ((4000, 2 * 145), "I16")}, ("E.trellis", "bits in 1..8")),
        ({"trellis": ((0, 130), "I16")}, ("E.trellis", "rows >= 1")),
        ({"trellis": ((250, 8, 65), "I16")}, ("E.trellis", "expected 2 dims")),
    ],
)
def test_container_fails_closed(edit, needles):
    members = dict(GOOD)
    for suffix, value in edit.items():
        if value is None:
            del members[suffix]
        else:
            members[suffix] = value
    with pytest.raises(Exl3FormatError) as e:
        embedding_spec("E", members)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_container_spec():
    spec = embedding_spec("E", GOOD)
    assert (spec.rows, spec.groups, spec.bits) == (4000, 2, 4)
    assert (spec.group_words, spec.row_words) == (65, 130)
    assert spec.hidden_problem(320) is None and spec.hidden_problem(512) is None
    assert "hidden_size 256 is stored as" in spec.hidden_problem(256)


def test_op_fake_shapes():
    """The fake implementation Dynamo traces the CUDA gather with."""
    with FakeTensorMode() as mode:
        ids = mode.from_tensor(torch.zeros(7, dtype=torch.int64))
        trellis = mode.from_tensor(torch.zeros(100, 130, dtype=torch.int16))
        signs = mode.from_tensor(torch.ones(2, 256, dtype=torch.float16))
        out = embedding_ops.exl3_embedding_fake(
            ids, trellis, signs, 320, torch.bfloat16
        )
    assert (tuple(out.shape), out.dtype) == ((7, 320), torch.bfloat16)


# ---- a checkpoint with a quantized embedding through vLLM's loader


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 1-layer synthetic Qwen3 (hidden 320, vocab 4000) with a 4-bit embedding."""
    path = tmp_path_factory.mktemp("embed") / "ckpt"
    synth.write_checkpoint(MODEL, path, bits=4, embed_bits=EMBED_BITS, seed=3)
    return path


def stored(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def reference_rows(ckpt, ids: torch.Tensor) -> torch.Tensor:
    named = stored(ckpt)
    return embedding_reference.decode_rows(
        named[f"{EMBED}.trellis"], named[f"{EMBED}.signs"], ids, HIDDEN
    )


def test_synthetic_checkpoint_layout(ckpt):
    """What ExLlamaV3's converter writes for --embed_bits (§8): trellis + signs, no
    weight, no JSON key."""
    named = stored(ckpt)
    assert f"{EMBED}.weight" not in named
    assert named[f"{EMBED}.trellis"].dtype == torch.int16
    assert tuple(named[f"{EMBED}.trellis"].shape) == (VOCAB, 2 * (1 + 16 * EMBED_BITS))
    assert named[f"{EMBED}.signs"].dtype == torch.float16
    assert set(named[f"{EMBED}.signs"].unique().tolist()) == {-1.0, 1.0}
    config = json.loads((ckpt / "config.json").read_text())
    assert "embed_bits" not in config["quantization_config"]
    storage = json.loads((ckpt / "quantization_config.json").read_text())
    entry = storage["tensor_storage"][EMBED]
    assert "quant_format" not in entry
    assert set(entry["stored_tensors"]) == {f"{EMBED}.trellis", f"{EMBED}.signs"}
    config = config_for(ckpt)
    assert set(config.embeddings) == {EMBED}
    assert config.embeddings[EMBED].bits == EMBED_BITS


def transformers_logits(ckpt, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' Qwen3 on the decoded weights: every EXL3 linear by the linear
    reference, the embedding by the embedding reference (all rows)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("quantization_config")
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    named = stored(ckpt)
    state = {}
    for name, param in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module == EMBED:
            state[name] = reference_rows(ckpt, torch.arange(VOCAB))
        elif f"{module}.trellis" in named:
            out, inp = param.shape
            state[name] = dense(named, module)[:inp, :out].t()
        else:
            state[name] = named[name].float()
    model.load_state_dict(state)
    model.to(dtype)
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def load_model(ckpt, monkeypatch, dtype: str):
    from .test_exl3_model import vllm_logits

    return vllm_logits(ckpt, IDS, monkeypatch, dtype=dtype)


def test_model_looks_up_the_reference_rows(ckpt, monkeypatch, world1):
    from vllm.model_executor.layers.quantization.exl3.embedding import (
        Exl3EmbeddingMethod,
    )

    logits, model = load_model(ckpt, monkeypatch, "bfloat16")
    embed = model.model.embed_tokens
    assert isinstance(embed.quant_method, Exl3EmbeddingMethod)
    # No dense copy of the table: the layer holds the trellis words and the signs.
    params = {n: (tuple(p.shape), p.dtype) for n, p in embed.named_parameters()}
    assert params == {
        "trellis": ((VOCAB_PADDED, 2 * (1 + 16 * EMBED_BITS)), torch.int16),
        "signs": ((2, GROUP), torch.float16),
    }
    assert not any(b.is_floating_point() for b in embed.buffers())
    with torch.no_grad():
        got = model.model.embed_input_ids(IDS)
    want = reference_rows(ckpt, IDS)
    assert got.dtype == torch.bfloat16 and got.shape == (len(IDS), HIDDEN)
    assert torch.equal(got, want.to(torch.bfloat16))
    # vLLM's padding rows (ids 4000..4031 at TP=1) are zeros, as for a dense table.
    with torch.no_grad():
        pad = model.model.embed_input_ids(torch.tensor([VOCAB, VOCAB_PADDED - 1]))
    assert torch.all(pad == 0)

    # The whole model runs on these rows: as close to fp32 transformers as
    # transformers' own bf16 run.
    exact = transformers_logits(ckpt, IDS, torch.float32)
    bf16 = transformers_logits(ckpt, IDS, torch.bfloat16)
    assert logits.shape == exact.shape == (len(IDS), VOCAB)
    err = (logits - exact).abs().max().item()
    bf16_err = (bf16 - exact).abs().max().item()
    assert err <= 2 * bf16_err, (
        f"max |logit err| {err:.4f}, transformers bf16 {bf16_err:.4f}"
    )


# Tensor parallel 2: two spawned processes in one gloo world. Each builds vLLM's
# VocabParallelEmbedding with the EXL3 method, loads the whole checkpoint tensors
# through its loaders (each rank keeps its rows), and looks up ids of both ranks (the
# all-reduce sums one decoded row and zeros, so exactly); then the whole model.

WORLD = 2
TP2_OUT = "tp2.pt"


def _rank_main(rank: int, init_file: str, ckpt_dir: str, out_dir: str) -> None:
    from pathlib import Path

    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    ckpt = Path(ckpt_dir)
    named = stored(ckpt)
    with gloo_world(WORLD, rank, init_file):
        layer = VocabParallelEmbedding(
            VOCAB,
            HIDDEN,
            params_dtype=torch.float32,
            quant_config=config_for(ckpt),
            prefix=EMBED,
        )
        for suffix in ("trellis", "signs"):
            param = getattr(layer, suffix)
            param.weight_loader(param, named[f"{EMBED}.{suffix}"])
        layer.quant_method.process_weights_after_loading(layer)
        per_rank = VOCAB_PADDED // WORLD
        assert layer.trellis.shape[0] == per_rank
        first = per_rank * rank
        real = min(VOCAB, first + per_rank) - first
        assert torch.equal(
            layer.trellis[:real], named[f"{EMBED}.trellis"][first : first + real]
        )
        assert torch.all(layer.trellis[real:] == 0)
        # vLLM compiles the id masking; eager runs the same ops without inductor.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            got = layer(IDS)
        assert torch.equal(got, reference_rows(ckpt, IDS)), f"rank {rank}"

        with pytest.MonkeyPatch.context() as monkeypatch:
            logits, model = load_model(ckpt, monkeypatch, "float16")
            with torch.no_grad():
                embedded = model.model.embed_input_ids(IDS)
        if rank == 0:
            torch.save({"logits": logits, "embedded": embedded}, f"{out_dir}/{TP2_OUT}")


@pytest.mark.slow
def test_tensor_parallel_2_equals_1(ckpt, tmp_path, monkeypatch, world1):
    mp.spawn(
        _rank_main,
        args=(str(tmp_path / "init"), str(ckpt), str(tmp_path)),
        nprocs=WORLD,
        join=True,
    )
    tp2 = torch.load(tmp_path / TP2_OUT)
    logits, model = load_model(ckpt, monkeypatch, "float16")
    with torch.no_grad():
        embedded = model.model.embed_input_ids(IDS)
    assert torch.equal(tp2["embedded"], embedded)
    # The rest of the model differs only in summation order (all-reduces): a few ulps.
    err = (tp2["logits"] - logits).abs().max().item()
    bound = 8 * torch.finfo(torch.float16).eps * logits.abs().max().item()
    assert err <= bound, f"TP=2 vs TP=1: max |logit diff| {err:.3g} > {bound:.3g}"


# ---- damaged embedding tensors, named before any weight is read


def _damaged(ckpt, dst, edit=None, config_edit=None):
    dst.mkdir()
    for f in ckpt.iterdir():
        shutil.copy(f, dst / f.name)
    if edit is not None:
        named = stored(ckpt)
        edit(named)
        save_file(named, str(dst / "model.safetensors"))
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_edit)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _set(name, tensor):
    return lambda named: named.__setitem__(name, tensor)


def _signs_fp32(named):
    named[f"{EMBED}.signs"] = named[f"{EMBED}.signs"].float()


def _narrow_trellis(named):
    named[f"{EMBED}.trellis"] = named[f"{EMBED}.trellis"][:, :-1].contiguous()


def _fewer_rows(named):
    named[f"{EMBED}.trellis"] = named[f"{EMBED}.trellis"][:3000].contiguous()


def _one_group(named):
    named[f"{EMBED}.trellis"] = named[f"{EMBED}.trellis"][:, :65].contiguous()
    named[f"{EMBED}.signs"] = named[f"{EMBED}.signs"][:1].contiguous()


def _dense_too(named):
    named[f"{EMBED}.weight"] = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)


def _no_signs(named):
    del named[f"{EMBED}.signs"]


def _no_head(named):
    for name in [n for n in named if n.startswith("lm_head.")]:
        del named[name]


DAMAGED = [
    ("signs-fp32", _signs_fp32, None, (f"{EMBED}.signs", "dtype F32, expected F16")),
    ("trellis-width", _narrow_trellis, None, (f"{EMBED}.trellis", "width 129")),
    (
        "rows-vs-vocab",
        _fewer_rows,
        None,
        (f"{EMBED}.trellis", "3000 rows", "vocab_size = 4000"),
    ),
    (
        "groups-vs-hidden",
        _one_group,
        None,
        (f"{EMBED}.signs", "1 groups of 256", "hidden_size 320"),
    ),
    ("dense-and-quantized", _dense_too, None, (f"{EMBED}.weight", "unexpected tensor")),
    ("signs-missing", _no_signs, None, (f"{EMBED}.signs", "missing tensor")),
    (
        "tied-head",
        _no_head,
        {"tie_word_embeddings": True},
        (f"{EMBED}.trellis", "tie_word_embeddings = true", "output layer"),
    ),
]


@pytest.mark.parametrize(
    "edit,config_edit,needles", [d[1:] for d in DAMAGED], ids=[d[0] for d in DAMAGED]
)
def test_damaged_embedding_is_named(ckpt, tmp_path, edit, config_edit, needles):
    damaged = _damaged(ckpt, tmp_path / "ckpt", edit, config_edit)
    with pytest.raises(Exl3FormatError) as e:
        config_for(damaged)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def _layer(ckpt):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    return VocabParallelEmbedding(
        VOCAB, HIDDEN, quant_config=config_for(ckpt), prefix=EMBED
    )


def test_signs_other_than_plus_minus_one_are_named(ckpt, world1):
    layer = _layer(ckpt)
    signs = stored(ckpt)[f"{EMBED}.signs"].clone()
    signs[1, 7] = 0.5
    with pytest.raises(
        Exl3FormatError, match=rf"{EMBED}\.signs: value 0\.5 at \[1, 7\]"
    ):
        layer.signs.weight_loader(layer.signs, signs)


def test_embedding_tensors_load_exactly_once(ckpt, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    named = stored(ckpt)
    layer = _layer(ckpt)
    layer.signs.weight_loader(layer.signs, named[f"{EMBED}.signs"])
    with pytest.raises(
        Exl3LayoutError, match="checkpoint tensors never loaded: trellis"
    ):
        layer.quant_method.process_weights_after_loading(layer)
    layer = _layer(ckpt)
    layer.trellis.weight_loader(layer.trellis, named[f"{EMBED}.trellis"])
    with pytest.raises(Exl3LayoutError, match="trellis written twice"):
        layer.trellis.weight_loader(layer.trellis, named[f"{EMBED}.trellis"])


def test_a_tied_head_is_refused_at_run_time(ckpt, world1):
    """For a hub checkpoint (not validated as a directory) the head's first call says
    why instead of running."""
    layer = _layer(ckpt)
    with pytest.raises(NotImplementedError, match="cannot serve as the output layer"):
        layer.quant_method.apply(layer, torch.zeros(1, HIDDEN))


# qwen3-tiny converted by ExLlamaV3 1.6.5 itself with --embed_bits 4
# (tests/fixtures/qwen3-tiny/exl3-4.0bpw-embed4): the format's ground truth. Its table
# decodes to the trained bf16 table within 4-bit error (a wrong ring, group or sign
# order decodes to noise, about sqrt(2) off), and vLLM looks up exactly those rows.
# Relative Frobenius error of a 4-bit trellis table, with margin over the 0.066 measured
# (every row 0.066-0.067); a misdecoded table is near 1.4.
FIXTURE_EMBED_RTOL = 0.12
FIXTURE_IDS = torch.tensor([0, 1, 5, 4095, 2048, 17, 17, 300, 4000, 1])


@pytest.fixture(scope="module")
def exllamav3_ckpt(tmp_path_factory):
    from vllm_exl3.testing.fixtures import QWEN3_TINY, TOKENIZER

    path = tmp_path_factory.mktemp("embed-fixture") / "ckpt"
    shutil.copytree(QWEN3_TINY / "exl3-4.0bpw-embed4", path)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, path / f.name)
    return path


def test_exllamav3_embedding_decodes_to_the_trained_table(exllamav3_ckpt):
    from vllm_exl3.testing.fixtures import QWEN3_TINY

    named = stored(exllamav3_ckpt)
    hidden = json.loads((exllamav3_ckpt / "config.json").read_text())["hidden_size"]
    trellis = named[f"{EMBED}.trellis"]
    table = embedding_reference.decode_rows(
        trellis, named[f"{EMBED}.signs"], torch.arange(trellis.shape[0]), hidden
    )
    original = load_file(str(QWEN3_TINY / "bf16" / "model.safetensors"))
    original = original[f"{EMBED}.weight"].float()
    assert table.shape == original.shape
    err = ((table - original).norm() / original.norm()).item()
    assert err < FIXTURE_EMBED_RTOL, err
    # Row by row too: no row decodes to another row's values; the padding token's
    # row, zero in training, stays near zero.
    norms = original.norm(dim=1)
    live = norms > 0
    per_row = (table - original)[live].norm(dim=1) / norms[live]
    assert per_row.max().item() < FIXTURE_EMBED_RTOL, per_row.max().item()
    assert table[~live].abs().max().item() < FIXTURE_EMBED_RTOL * norms.mean().item()


def test_exllamav3_embedding_checkpoint_runs_in_vllm(
    exllamav3_ckpt, monkeypatch, world1
):
    from vllm.model_executor.layers.quantization.exl3.embedding import (
        Exl3EmbeddingMethod,
    )

    from .test_exl3_model import vllm_logits

    logits, model = vllm_logits(
        exllamav3_ckpt, FIXTURE_IDS, monkeypatch, dtype="bfloat16"
    )
    embed = model.model.embed_tokens
    assert isinstance(embed.quant_method, Exl3EmbeddingMethod)
    named = stored(exllamav3_ckpt)
    want = embedding_reference.decode_rows(
        named[f"{EMBED}.trellis"], named[f"{EMBED}.signs"], FIXTURE_IDS, 256
    )
    with torch.no_grad():
        got = model.model.embed_input_ids(FIXTURE_IDS)
    assert torch.equal(got, want.to(torch.bfloat16))
    assert torch.isfinite(logits).all() and logits.shape[0] == len(FIXTURE_IDS)
