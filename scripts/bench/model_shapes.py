# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shapes `_C::exl3_linear` runs for the models people serve in EXL3, per
tensor-parallel rank, as vLLM 0.26 builds their layers: what tune_plans.py tunes.

Each model is the numbers of its published config.json (under config.json's own keys,
the Hugging Face repository named), and from them the linears vLLM builds with EXL3
weights: the fused q/k/v projection (QKVParallelLinear: q, k, v shards; Qwen3.5's q
twice as wide, its output gate), o_proj, the fused gate/up projection and down_proj of
dense MLPs and shared experts, lm_head; DeepSeek-V3's MLA as fused_qkv_a_proj
(replicated: q_a_proj and kv_a_proj_with_mqa as two shards), q_b_proj and o_proj;
Qwen3.5's Gated DeltaNet as in_proj_qkvz (four shards q, k, v, z from the two stored
modules in_proj_qkv and in_proj_z) and out_proj.

Not here: routed experts (the MoE op runs them, with its own kernels and plans); MTP
layers (used only for speculative decoding, their attention and MLP repeat the
model's); Qwen3.5's vision tower; what stays unquantized (routers, the shared-expert
gate, MLA's kv_b_proj, Qwen3.5's in_proj_ba).

A rank's shape is the EXL3 loader's own arithmetic (layout.plan_linear and
plan_lm_head, read through vllm_exl3.codec): k and every shard padded to the 128-wide
Hadamard block as ExLlamaV3 stores them, a column-parallel rank computing the
128-aligned window of checkpoint blocks covering its columns, a vocab-parallel head
its window of vLLM's 64-padded vocab. One kernel run covers the layer's shards when
they share a bitrate and codebook, the common case, which is the run named here.

A tensor-parallel size is skipped for a model where vLLM cannot split one of these
layers (a head count or width not divisible) or the EXL3 loader refuses it (a
row-parallel k per rank not a multiple of 128, tp_rules.py), with the reason. Routed
experts do not decide it: where their width does not split into 128-blocks they run
with expert parallelism (--enable-expert-parallel), which does not split them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_exl3.codec import exl3_format, layout, tp_rules

PAD = exl3_format.HADAMARD_SIZE
# vLLM pads the vocab to this many rows before dividing it over ranks
# (vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Model:
    name: str  # the --models name
    repo: str  # the Hugging Face repository whose config.json the numbers are from
    config: Mapping[str, Any]  # those numbers, under config.json's keys


def _qwen3(name: str, repo: str, hidden: int, inter: int, heads: int) -> Model:
    # Every dense Qwen3: 8 kv heads of 128, the 151936-token vocab.
    return Model(
        name,
        repo,
        {
            "model_type": "qwen3",
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_attention_heads": heads,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
        },
    )


MODELS: tuple[Model, ...] = (
    _qwen3("qwen3-0.6b", "Qwen/Qwen3-0.6B", 1024, 3072, 16),
    _qwen3("qwen3-1.7b", "Qwen/Qwen3-1.7B", 2048, 6144, 16),
    _qwen3("qwen3-4b", "Qwen/Qwen3-4B", 2560, 9728, 32),
    _qwen3("qwen3-8b", "Qwen/Qwen3-8B", 4096, 12288, 32),
    _qwen3("qwen3-14b", "Qwen/Qwen3-14B", 5120, 17408, 40),
    _qwen3("qwen3-32b", "Qwen/Qwen3-32B", 5120, 25600, 64),
    Model(
        "qwen3-30b-a3b",
        "Qwen/Qwen3-30B-A3B",
        {
            "model_type": "qwen3_moe",
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "num_experts": 128,
            "moe_intermediate_size": 768,
            "mlp_only_layers": [],
        },
    ),
    Model(
        "qwen3-235b-a22b",
        "Qwen/Qwen3-235B-A22B",
        {
            "model_type": "qwen3_moe",
            "hidden_size": 4096,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "num_experts": 128,
            "moe_intermediate_size": 1536,
            "mlp_only_layers": [],
        },
    ),
    # Qwen3.5's numbers are its config.json's text_config.
    Model(
        "qwen3.5-27b",
        "Qwen/Qwen3.5-27B",
        {
            "model_type": "qwen3_5_text",
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "attn_output_gate": True,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "vocab_size": 248320,
        },
    ),
    Model(
        "qwen3.5-35b-a3b",
        "Qwen/Qwen3.5-35B-A3B",
        {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "attn_output_gate": True,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_experts": 256,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "vocab_size": 248320,
        },
    ),
    Model(
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B-Instruct",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
        },
    ),
    Model(
        "llama-3.1-70b",
        "meta-llama/Llama-3.1-70B-Instruct",
        {
            "model_type": "llama",
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
        },
    ),
    Model(
        "glm-4.5-air",
        "zai-org/GLM-4.5-Air",
        {
            "model_type": "glm4_moe",
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "first_k_dense_replace": 1,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "moe_intermediate_size": 1408,
            "vocab_size": 151552,
        },
    ),
    Model(
        "deepseek-v3",
        "deepseek-ai/DeepSeek-V3",
        {
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_attention_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "first_k_dense_replace": 3,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "moe_intermediate_size": 2048,
            "vocab_size": 129280,
        },
    ),
)

# Models kept out of the table, to check the default plans (the cost model) on shapes
# nothing was tuned for (tune_plans.py --check-gap).
HELD_OUT: tuple[Model, ...] = (
    Model(
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B-Instruct",
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
        },
    ),
    Model(
        "llama-3.2-3b",
        "meta-llama/Llama-3.2-3B-Instruct",
        {
            "model_type": "llama",
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
        },
    ),
    Model(
        "mistral-nemo-12b",
        "mistralai/Mistral-Nemo-Instruct-2407",
        {
            "model_type": "mistral",
            "hidden_size": 5120,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 131072,
        },
    ),
)

BY_NAME: dict[str, Model] = {m.name: m for m in MODELS + HELD_OUT}


class ShapeError(ValueError):
    """A model's layer cannot be split over this many ranks (by vLLM or the EXL3
    loader); the message names the layer and the rule."""


# How vLLM splits a linear over tensor-parallel ranks.
QKV, COLUMN, ROW, REPLICATED, VOCAB = "qkv", "column", "row", "replicated", "vocab"


@dataclass(frozen=True)
class Linear:
    """One EXL3 linear as vLLM builds it, across all ranks (real, unpadded sizes)."""

    name: str  # vLLM's module name in a decoder layer, e.g. self_attn.qkv_proj
    split: str  # QKV, COLUMN, ROW, REPLICATED or VOCAB
    k: int
    widths: tuple[int, ...]  # output features of each shard
    # Output features of each stored checkpoint module, in shard order (default: one
    # module per shard; a module may cover consecutive shards, layout.module_spans).
    module_widths: tuple[int, ...] = ()
    # QKV: the head size and the q and kv head counts (q and k/v shard widths).
    head_size: int = 0
    q_heads: int = 0
    kv_heads: int = 0

    @property
    def stored(self) -> tuple[int, ...]:
        return self.module_widths or self.widths


def _qkv(name: str, hidden: int, head: int, q_heads: int, kv_heads: int) -> Linear:
    return Linear(
        name,
        QKV,
        hidden,
        (q_heads * head, kv_heads * head, kv_heads * head),
        head_size=head,
        q_heads=q_heads,
        kv_heads=kv_heads,
    )


def _mlp(prefix: str, hidden: int, inter: int) -> list[Linear]:
    return [
        Linear(f"{prefix}.gate_up_proj", COLUMN, hidden, (inter, inter)),
        Linear(f"{prefix}.down_proj", ROW, inter, (hidden,)),
    ]


def model_linears(model: Model) -> list[Linear]:
    """The EXL3 linears vLLM builds for `model` (one of each distinct layer)."""
    c = model.config
    mtype, hidden = c["model_type"], c["hidden_size"]
    heads = c["num_attention_heads"]
    out: list[Linear] = []
    if mtype == "deepseek_v3":
        qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        kv_a = c["kv_lora_rank"] + c["qk_rope_head_dim"]
        out += [
            Linear(
                "self_attn.fused_qkv_a_proj",
                REPLICATED,
                hidden,
                (c["q_lora_rank"], kv_a),
            ),
            Linear("self_attn.q_b_proj", COLUMN, c["q_lora_rank"], (heads * qk_head,)),
            Linear("self_attn.o_proj", ROW, heads * c["v_head_dim"], (hidden,)),
        ]
    else:
        head = c.get("head_dim") or hidden // heads
        gate = 2 if c.get("attn_output_gate") else 1
        kv_heads = c["num_key_value_heads"]
        out += [
            _qkv("self_attn.qkv_proj", hidden, head, gate * heads, kv_heads),
            Linear("self_attn.o_proj", ROW, heads * head, (hidden,)),
        ]
    if mtype in ("qwen3_5_text", "qwen3_5_moe_text"):
        key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        value = c["linear_num_value_heads"] * c["linear_value_head_dim"]
        out += [
            Linear(
                "linear_attn.in_proj_qkvz",
                COLUMN,
                hidden,
                (key, key, value, value),
                module_widths=(2 * key + value, value),
            ),
            Linear("linear_attn.out_proj", ROW, value, (hidden,)),
        ]
    # Dense MLPs: every layer of a dense model, the first_k_dense_replace layers of a
    # DeepSeek-style MoE model; none in Qwen3-MoE (mlp_only_layers empty).
    moe = bool(c.get("num_experts") or c.get("n_routed_experts"))
    if not moe or c.get("first_k_dense_replace"):
        out += _mlp("mlp", hidden, c["intermediate_size"])
    if c.get("n_shared_experts"):
        shared = c["moe_intermediate_size"] * c["n_shared_experts"]
        out += _mlp("mlp.shared_experts", hidden, shared)
    if c.get("shared_expert_intermediate_size"):
        out += _mlp("mlp.shared_expert", hidden, c["shared_expert_intermediate_size"])
    out.append(Linear("lm_head", VOCAB, hidden, (c["vocab_size"],)))
    return out


@dataclass(frozen=True)
class RankShape:
    """One kernel run on one rank: k and each shard's columns as allocated."""

    k: int
    widths: tuple[int, ...]

    @property
    def n(self) -> int:
        return sum(self.widths)


def _divide(what: str, value: int, tp: int, layer: str) -> int:
    if value % tp:
        raise ShapeError(f"{layer}: {what} = {value} not divisible by tp={tp} (vLLM)")
    return value // tp


def _spec(name: str, k: int, n: int):
    return exl3_format.Exl3ModuleSpec(
        prefix=name,
        in_features=tp_rules.round_up(k, PAD),
        out_features=tp_rules.round_up(n, PAD),
        bits=4.0,
        codebook=exl3_format.Codebook.MUL1,
        has_bias=False,
        legacy_signs=False,
        tensor_names=(),
    )


def rank_shapes(lin: Linear, tp: int) -> list[RankShape]:
    """The kernel run of `lin` on each of `tp` ranks, as the EXL3 loader lays it out;
    raises ShapeError where vLLM or the loader cannot split it."""
    specs = [_spec(f"{lin.name}.{i}", lin.k, w) for i, w in enumerate(lin.stored)]
    if lin.split == VOCAB:
        padded = tp_rules.round_up(lin.widths[0], VOCAB_PADDING)
        per = _divide(f"vocab padded to {VOCAB_PADDING}", padded, tp, lin.name)
        layouts = [
            layout.plan_lm_head(
                lin.name,
                specs[0],
                tp_rank=r,
                hidden=lin.k,
                vocab_start=r * per,
                vocab_per_rank=per,
                org_vocab=lin.widths[0],
            )
            for r in range(tp)
        ]
    else:
        split, k, widths, replicas = layout.Split.COLUMN, lin.k, lin.widths, None
        size = tp
        if lin.split == QKV:
            q = _divide("q heads", lin.q_heads, tp, lin.name)
            if tp >= lin.kv_heads:
                # vLLM replicates each kv head over tp / kv_heads ranks.
                if tp % lin.kv_heads:
                    raise ShapeError(
                        f"{lin.name}: {lin.kv_heads} kv heads cannot be replicated "
                        f"evenly over tp={tp} (vLLM)"
                    )
                kv, replicas = 1, [1, tp // lin.kv_heads, tp // lin.kv_heads]
            else:
                kv = _divide("kv heads", lin.kv_heads, tp, lin.name)
            widths = (q * lin.head_size, kv * lin.head_size, kv * lin.head_size)
        elif lin.split == COLUMN:
            widths = tuple(_divide("output width", w, tp, lin.name) for w in widths)
        elif lin.split == ROW:
            split, k = layout.Split.ROW, _divide("input width", lin.k, tp, lin.name)
        else:  # REPLICATED
            split, size = layout.Split.NONE, 1
        try:
            layouts = [
                layout.plan_linear(
                    lin.name,
                    specs,
                    split=split,
                    tp_rank=r,
                    tp_size=size,
                    k_width=k,
                    widths=widths,
                    kv_replicas=replicas,
                )
                for r in range(size)
            ]
        except layout.Exl3LayoutError as e:
            raise ShapeError(str(e)) from None
    shapes = []
    for lay in layouts:
        (run,) = lay.runs  # one bitrate and codebook: one run
        shapes.append(RankShape(lay.k_alloc, tuple(run.shard_widths)))
    return shapes


@dataclass
class Shape:
    """A distinct kernel run across models and TP sizes, and where it occurs."""

    k: int
    widths: tuple[int, ...]
    # "<model> tp=<tp> <layer>" for every occurrence.
    sources: list[str] = field(default_factory=list)
    # Whether every occurrence is an lm_head (vLLM computes logits only for the
    # sampled positions, so it never sees more rows than sequences in a step).
    lm_head_only: bool = True

    @property
    def n(self) -> int:
        return sum(self.widths)

    @property
    def shards(self) -> int:
        return len(self.widths)


def model_rank_shapes(model: Model, tp: int) -> list[tuple[str, RankShape]]:
    """(layer name, kernel run) of every layer and rank of `model` at `tp`; raises
    ShapeError where `tp` cannot run it."""
    out = []
    for lin in model_linears(model):
        for shape in rank_shapes(lin, tp):
            out.append((lin.name, shape))
    return out


def collect(
    models: Iterable[Model], tps: Sequence[int] = TP_SIZES
) -> tuple[list[Shape], list[str]]:
    """The distinct runs (by k, n and shard count: what a table key holds) of `models`
    at every TP size in `tps`, in first-seen order, and one line per (model, TP) that
    cannot run, with the reason."""
    shapes: dict[tuple[int, int, int], Shape] = {}
    skipped = []
    for model in models:
        for tp in tps:
            try:
                runs = model_rank_shapes(model, tp)
            except ShapeError as e:
                skipped.append(f"{model.name} tp={tp}: {e}")
                continue
            for layer, run in runs:
                key = (run.k, run.n, len(run.widths))
                shape = shapes.setdefault(key, Shape(run.k, run.widths))
                source = f"{model.name} tp={tp} {layer}"
                if source not in shape.sources:
                    shape.sources.append(source)
                shape.lm_head_only &= layer == "lm_head"
    return list(shapes.values()), skipped


def held_out_shapes(tps: Sequence[int] = (1,)) -> list[Shape]:
    """The HELD_OUT models' runs that no tuned model has at any TP size."""
    tuned, _ = collect(MODELS)
    seen = {(s.k, s.n, s.shards) for s in tuned}
    shapes, _ = collect(HELD_OUT, tps)
    return [s for s in shapes if (s.k, s.n, s.shards) not in seen]


def resolve(names: Sequence[str]) -> list[Model]:
    """Models by --models names ("all": every tuned model, not the held-out ones)."""
    if list(names) == ["all"]:
        return list(MODELS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ShapeError(
            f"unknown model {', '.join(unknown)}; known: all, {', '.join(BY_NAME)}"
        )
    return [BY_NAME[n] for n in names]
