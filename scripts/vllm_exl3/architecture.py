# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which linears and plain tensors a Hugging Face config implies, as ExLlamaV3 1.6.5
stores them.

One plan serves three tools: the synthetic checkpoint writer (what to write), `inspect`
(what is missing, tensor-parallel roles) and `dequantize` (the real, unpadded dims to
trim to). Names follow ExLlamaV3's converted checkpoints (docs/design/exl3_format.md
§1.8): one tensor set per projection, per-expert names for MoE, routers and kv_b_proj
unquantized, an lm_head always present.

Supported: dense decoders (llama/qwen2/qwen3-style q/k/v/o + gate/up/down), qwen2/qwen3
MoE (per-expert, optional shared expert), Mixtral (block_sparse_moe, w1/w2/w3 experts),
GLM-4.5/4.6 MoE (q/k/v bias, optional q/k norms, DeepSeek-style routed + shared
experts), Qwen3-Next (gated attention every full_attention_interval-th layer, Gated
DeltaNet otherwise, MoE with a gated shared expert), DeepSeek-style MLA + MoE with
shared experts and an MTP layer (`num_nextn_predict_layers`, the glm4_moe_lite MTP
layout), Qwen3-Next's MTP layers under `mtp.` (`mtp_num_hidden_layers`, the layout
ExLlamaV3 stores for Qwen3.5 / 3.6), and the DeepSeek-Sparse-Attention family on that
body (DeepSeek-V3.2, GLM-5 `glm_moe_dsa`: `index_topk` in the config), whose indexer
ExLlamaV3 stores as `self_attn.indexer.{wq_b (EXL3), wk, weights_proj (fp16,
unpadded), k_norm (LayerNorm weight + bias)}` on the layers that score a selection.
Anything else raises PlanError. Pure Python: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# All EXL3 dims are padded to the Hadamard block (kept equal to format.HADAMARD_SIZE;
# this module must not import torch, so the value is restated).
PAD = 128
# ExLlamaV3 splits dense MLPs wider than this into slices (constants.py:
# MAX_MLP_INTERMEDIATE).
MAX_MLP_INTERMEDIATE = 55296

# Tensor-parallel roles of a linear in vLLM.
COLUMN, ROW, REPLICATED, VOCAB = "column", "row", "replicated", "vocab"


class PlanError(ValueError):
    """The config describes an architecture (or a feature of one) the plan does not
    know."""


def round_up(x: int, to: int = PAD) -> int:
    return -(-x // to) * to


@dataclass(frozen=True)
class LinearSlot:
    """One linear as vLLM and ExLlamaV3 see it."""

    name: str  # module key, e.g. model.layers.0.self_attn.q_proj
    in_features: int  # real (unpadded) k
    out_features: int  # real (unpadded) n
    tp: str  # COLUMN / ROW / REPLICATED / VOCAB
    fused: str  # the vLLM module it is loaded into (itself when not fused)
    quantized: bool = True  # False: stored as fp16 `.weight` (routers, kv_b_proj, ...)
    bits_key: str = (
        "bits"  # which quantization_config rate applies: bits / head_bits / mtp_bits
    )
    has_bias: bool = False
    heads: int | None = (
        None  # head count a column split must divide (attention projections)
    )
    kv_heads: int | None = None  # for k/v: vLLM replicates kv heads when tp > kv_heads

    @property
    def padded(self) -> tuple[int, int]:
        return round_up(self.in_features), round_up(self.out_features)


@dataclass(frozen=True)
class PlainTensor:
    """A tensor stored as is (embeddings, norms, router biases)."""

    name: str  # full tensor name
    shape: tuple[int, ...]
    module: str  # the leaf module key it belongs to (tensor_storage)
    kind: str  # "embed", "norm", "bias", "router_bias"


@dataclass
class ModelPlan:
    linears: list[LinearSlot] = field(default_factory=list)
    plain: list[PlainTensor] = field(default_factory=list)
    # Leaf module keys in model order (the tensor_storage order of
    # quantization_config.json).
    modules: list[str] = field(default_factory=list)

    def add_linear(self, slot: LinearSlot) -> None:
        self.linears.append(slot)
        self.modules.append(slot.name)

    def add_plain(
        self, name: str, shape: tuple[int, ...], kind: str, module: str | None = None
    ) -> None:
        module = module or name.rpartition(".")[0]
        self.plain.append(PlainTensor(name, tuple(shape), module, kind))
        if module not in self.modules:
            self.modules.append(module)


# Model types whose attention_bias puts a bias on q/k/v only (o_proj has none).
QKV_ONLY_BIAS = ("qwen2", "qwen2_moe", "glm4_moe")
# Models whose q_proj carries an output gate per head (q_proj width 2 * heads *
# head_dim).
GATED_Q_TYPES = ("qwen3_next",)
# Hybrid models: every full_attention_interval-th layer is attention, the others Gated
# DeltaNet linear attention (`linear_attn`, fused in_proj_qkvz and in_proj_ba as in the
# HF checkpoint).
GATED_DELTA_NET_TYPES = ("qwen3_next",)
# Models whose MTP head is stored under `mtp.` (ExLlamaV3's qwen3_5_mtp layout, which
# vLLM's Qwen3NextMTP / Qwen3_5MTP load): pre_fc_norm_hidden and pre_fc_norm_embedding,
# an EXL3 fc (2 * hidden -> hidden), `mtp_num_hidden_layers` full-attention decoder
# layers `mtp.layers.{i}`, and mtp.norm. The DeepSeek layout instead appends
# `num_nextn_predict_layers` layers to model.layers.
MTP_PREFIX_TYPES = ("qwen3_next",)
MTP_PREFIX = "mtp."
# config.json keys counting MTP layers: DeepSeek / GLM layout, `mtp.` layout.
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# Mixtral: experts under block_sparse_moe, projections w1 (gate), w3 (up), w2 (down),
# expert width = intermediate_size.
MIXTRAL_TYPES = ("mixtral",)

_EXPERT = re.compile(
    r"^(?P<mlp>.+)\.experts\.\d+\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$"
)
_FUSED_SIBLINGS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def linear_role(name: str, config: dict | None = None) -> tuple[str, str]:
    """(tensor-parallel role, vLLM fused module) of a linear, from its name alone.

    Used for checkpoints whose architecture the plan does not know; the plan itself
    assigns the same roles.
    """
    m = _EXPERT.match(name)
    if m:
        proj = m.group("proj")
        return (
            ROW if proj in ("down_proj", "w2") else COLUMN
        ), f"{m.group('mlp')}.experts"
    parent, _, leaf = name.rpartition(".")
    if leaf.isdigit() and parent.endswith(
        ".slice"
    ):  # ExLlamaV3 slices of a huge dense MLP
        parent, _, leaf = parent[: -len(".slice")].rpartition(".")
    if name == "lm_head" or leaf == "lm_head":
        return VOCAB, name
    if leaf in _FUSED_SIBLINGS:
        return COLUMN, f"{parent}.{_FUSED_SIBLINGS[leaf]}"
    if leaf in ("o_proj", "down_proj", "dense", "out_proj"):
        return ROW, name
    if leaf in ("q_a_proj", "kv_a_proj_with_mqa"):
        q_lora = (config or {}).get("q_lora_rank")
        fused = f"{parent}.fused_qkv_a_proj" if q_lora else name
        return REPLICATED, fused
    if leaf in ("q_b_proj", "kv_b_proj"):
        return COLUMN, name
    return REPLICATED, name


def _mlp(plan: ModelPlan, prefix: str, hidden: int, inter: int, bits_key: str) -> None:
    slices = -(-inter // MAX_MLP_INTERMEDIATE)
    if slices == 1:
        widths, names = [inter], [""]
    else:
        width = inter // slices // PAD * PAD
        widths = [width] * (slices - 1) + [inter - width * (slices - 1)]
        names = [f".slice.{i}" for i in range(slices)]
    for width, sfx in zip(widths, names):
        for proj in ("gate_proj", "up_proj"):
            name = f"{prefix}.{proj}{sfx}"
            plan.add_linear(
                LinearSlot(
                    name, hidden, width, COLUMN, linear_role(name)[1], bits_key=bits_key
                )
            )
    for width, sfx in zip(widths, names):
        plan.add_linear(
            LinearSlot(
                f"{prefix}.down_proj{sfx}",
                width,
                hidden,
                ROW,
                f"{prefix}.down_proj{sfx}",
                bits_key=bits_key,
            )
        )


def _attention(
    plan: ModelPlan,
    cfg: dict,
    prefix: str,
    hidden: int,
    bits_key: str,
    with_indexer: bool = False,
) -> None:
    heads = cfg["num_attention_heads"]
    model_type = cfg.get("model_type", "")
    if cfg.get("kv_lora_rank"):
        nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        v_dim, kv_rank, q_rank = (
            cfg["v_head_dim"],
            cfg["kv_lora_rank"],
            cfg.get("q_lora_rank"),
        )
        qa_fused = f"{prefix}.fused_qkv_a_proj" if q_rank else None
        if q_rank:
            plan.add_linear(
                LinearSlot(
                    f"{prefix}.q_a_proj",
                    hidden,
                    q_rank,
                    REPLICATED,
                    qa_fused,
                    bits_key=bits_key,
                )
            )
            plan.add_plain(f"{prefix}.q_a_layernorm.weight", (q_rank,), "norm")
            plan.add_linear(
                LinearSlot(
                    f"{prefix}.q_b_proj",
                    q_rank,
                    heads * (nope + rope),
                    COLUMN,
                    f"{prefix}.q_b_proj",
                    bits_key=bits_key,
                    heads=heads,
                )
            )
        else:
            plan.add_linear(
                LinearSlot(
                    f"{prefix}.q_proj",
                    hidden,
                    heads * (nope + rope),
                    COLUMN,
                    f"{prefix}.q_proj",
                    bits_key=bits_key,
                    heads=heads,
                )
            )
        plan.add_linear(
            LinearSlot(
                f"{prefix}.kv_a_proj_with_mqa",
                hidden,
                kv_rank + rope,
                REPLICATED,
                qa_fused or f"{prefix}.kv_a_proj_with_mqa",
                bits_key=bits_key,
            )
        )
        plan.add_plain(f"{prefix}.kv_a_layernorm.weight", (kv_rank,), "norm")
        # ExLlamaV3 keeps kv_b_proj unquantized (it folds it into the attention),
        # stored fp16.
        plan.add_linear(
            LinearSlot(
                f"{prefix}.kv_b_proj",
                kv_rank,
                heads * (nope + v_dim),
                COLUMN,
                f"{prefix}.kv_b_proj",
                quantized=False,
                heads=heads,
            )
        )
        plan.add_linear(
            LinearSlot(
                f"{prefix}.o_proj",
                heads * v_dim,
                hidden,
                ROW,
                f"{prefix}.o_proj",
                bits_key=bits_key,
            )
        )
        if with_indexer:
            _indexer(plan, cfg, f"{prefix}.indexer", hidden, bits_key)
        return
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    # Qwen3-Next's q_proj also produces the output gate, interleaved per head (twice
    # the width).
    q_width = heads * head_dim * (2 if model_type in GATED_Q_TYPES else 1)
    qkv_bias = model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias"))
    o_bias = bool(cfg.get("attention_bias")) and model_type not in QKV_ONLY_BIAS
    fused = f"{prefix}.qkv_proj"
    plan.add_linear(
        LinearSlot(
            f"{prefix}.q_proj",
            hidden,
            q_width,
            COLUMN,
            fused,
            bits_key=bits_key,
            has_bias=qkv_bias,
            heads=heads,
        )
    )
    for proj in ("k_proj", "v_proj"):
        plan.add_linear(
            LinearSlot(
                f"{prefix}.{proj}",
                hidden,
                kv_heads * head_dim,
                COLUMN,
                fused,
                bits_key=bits_key,
                has_bias=qkv_bias,
                heads=kv_heads,
                kv_heads=kv_heads,
            )
        )
    plan.add_linear(
        LinearSlot(
            f"{prefix}.o_proj",
            heads * head_dim,
            hidden,
            ROW,
            f"{prefix}.o_proj",
            bits_key=bits_key,
            has_bias=o_bias,
        )
    )
    if model_type.startswith("qwen3") or cfg.get("use_qk_norm"):
        plan.add_plain(f"{prefix}.q_norm.weight", (head_dim,), "norm")
        plan.add_plain(f"{prefix}.k_norm.weight", (head_dim,), "norm")


def _indexer(
    plan: ModelPlan, cfg: dict, prefix: str, hidden: int, bits_key: str
) -> None:
    """The DSA lightning indexer as ExLlamaV3 stores it: the query projection from the
    q_a latent is EXL3; the key projection and the per-head scoring weights are
    router-like and stay fp16 at their real dims (pad_to=1); k_norm is a LayerNorm with
    a bias."""
    if not cfg.get("q_lora_rank"):
        raise PlanError(
            "config.json: index_topk without q_lora_rank (the DSA indexer projects its "
            "queries from the q_a latent)"
        )
    heads, head_dim = cfg["index_n_heads"], cfg["index_head_dim"]
    plan.add_linear(
        LinearSlot(
            f"{prefix}.wq_b",
            cfg["q_lora_rank"],
            heads * head_dim,
            REPLICATED,
            f"{prefix}.wq_b",
            bits_key=bits_key,
        )
    )
    plan.add_linear(
        LinearSlot(
            f"{prefix}.wk",
            hidden,
            head_dim,
            REPLICATED,
            f"{prefix}.wk_weights_proj",
            quantized=False,
        )
    )
    plan.add_plain(f"{prefix}.k_norm.weight", (head_dim,), "norm")
    plan.add_plain(f"{prefix}.k_norm.bias", (head_dim,), "bias")
    plan.add_linear(
        LinearSlot(
            f"{prefix}.weights_proj",
            hidden,
            heads,
            REPLICATED,
            f"{prefix}.wk_weights_proj",
            quantized=False,
        )
    )


def indexer_layers(cfg: dict) -> list[bool]:
    """Which decoder layers own a DSA indexer (score and publish a top-k selection);
    the others reuse the previous owner's. ExLlamaV3 follows config.json's
    `indexer_types` ("full" / "shared"); without it, the rule transformers and vLLM
    derive from `index_topk_pattern` ("F"/"S" per layer) or `index_topk_freq` and
    `index_skip_topk_offset`. All False for a config without `index_topk`."""
    layers = cfg["num_hidden_layers"]
    if "index_topk" not in cfg:
        return [False] * layers
    types = cfg.get("indexer_types")
    if types is not None:
        if len(types) < layers or any(t not in ("full", "shared") for t in types):
            raise PlanError(
                f"config.json: indexer_types={types!r} (one 'full' or 'shared' per "
                f"layer, {layers} layers)"
            )
        return [t == "full" for t in types[:layers]]
    return vllm_indexer_layers(cfg)


def vllm_indexer_layers(cfg: dict) -> list[bool]:
    """The layers vLLM 0.26's DeepSeek-V2 model builds an indexer for
    (DeepseekV2MLAAttention: `index_topk_pattern`, else `index_topk_freq` counted
    from `index_skip_topk_offset`)."""
    layers = cfg["num_hidden_layers"]
    if "index_topk" not in cfg:
        return [False] * layers
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [i >= len(pattern) or pattern[i] != "S" for i in range(layers)]
    freq = cfg.get("index_topk_freq", 1)
    offset = cfg.get("index_skip_topk_offset", 2)
    return [max(i - offset + 1, 0) % freq == 0 for i in range(layers)]


def _num_experts(cfg: dict) -> int:
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


def _is_moe_layer(cfg: dict, idx: int) -> bool:
    if not _num_experts(cfg):
        return False
    if "first_k_dense_replace" in cfg or "n_routed_experts" in cfg:  # DeepSeek style
        first_moe = cfg.get("first_k_dense_replace", 0)
        return idx >= first_moe and idx % cfg.get("moe_layer_freq", 1) == 0
    if idx in (cfg.get("mlp_only_layers") or []):
        return False
    step = cfg.get("decoder_sparse_step", 1) or 1
    return (idx + 1) % step == 0


def _moe(plan: ModelPlan, cfg: dict, prefix: str, hidden: int, bits_key: str) -> None:
    experts = _num_experts(cfg)
    mixtral = cfg.get("model_type") in MIXTRAL_TYPES
    inter = cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]
    gate, up, down = (
        ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    )
    plan.add_linear(
        LinearSlot(
            f"{prefix}.gate",
            hidden,
            experts,
            REPLICATED,
            f"{prefix}.gate",
            quantized=False,
        )
    )
    if cfg.get("n_routed_experts") and cfg.get("topk_method", "noaux_tc") == "noaux_tc":
        plan.add_plain(
            f"{prefix}.gate.e_score_correction_bias",
            (experts,),
            "router_bias",
            module=f"{prefix}.gate",
        )
    for e in range(experts):
        for proj in (gate, up, down):
            name = f"{prefix}.experts.{e}.{proj}"
            k, n = (inter, hidden) if proj == down else (hidden, inter)
            plan.add_linear(
                LinearSlot(
                    name,
                    k,
                    n,
                    ROW if proj == down else COLUMN,
                    f"{prefix}.experts",
                    bits_key=bits_key,
                )
            )
    if cfg.get("n_shared_experts"):
        _mlp(
            plan,
            f"{prefix}.shared_experts",
            hidden,
            inter * cfg["n_shared_experts"],
            bits_key,
        )
    if cfg.get("shared_expert_intermediate_size"):
        _mlp(
            plan,
            f"{prefix}.shared_expert",
            hidden,
            cfg["shared_expert_intermediate_size"],
            bits_key,
        )
        plan.add_linear(
            LinearSlot(
                f"{prefix}.shared_expert_gate",
                hidden,
                1,
                REPLICATED,
                f"{prefix}.shared_expert_gate",
                quantized=False,
            )
        )


def _gated_delta_net(
    plan: ModelPlan, cfg: dict, prefix: str, hidden: int, bits_key: str
) -> None:
    """Qwen3-Next's linear attention as ExLlamaV3 stores it: in_proj_qkvz and out_proj
    EXL3, in_proj_ba unquantized (pad_to=1), the conv, decay and norm tensors as stored.
    """
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    v_heads = cfg["linear_num_value_heads"]
    plan.add_linear(
        LinearSlot(
            f"{prefix}.in_proj_qkvz",
            hidden,
            2 * key_dim + 2 * value_dim,
            COLUMN,
            f"{prefix}.in_proj_qkvz",
            bits_key=bits_key,
        )
    )
    plan.add_linear(
        LinearSlot(
            f"{prefix}.in_proj_ba",
            hidden,
            2 * v_heads,
            COLUMN,
            f"{prefix}.in_proj_ba",
            quantized=False,
        )
    )
    plan.add_plain(
        f"{prefix}.conv1d.weight",
        (2 * key_dim + value_dim, 1, cfg["linear_conv_kernel_dim"]),
        "conv",
    )
    plan.add_plain(f"{prefix}.A_log", (v_heads,), "decay", module=prefix)
    plan.add_plain(f"{prefix}.dt_bias", (v_heads,), "decay", module=prefix)
    plan.add_plain(f"{prefix}.norm.weight", (cfg["linear_value_head_dim"],), "norm")
    plan.add_linear(
        LinearSlot(
            f"{prefix}.out_proj",
            value_dim,
            hidden,
            ROW,
            f"{prefix}.out_proj",
            bits_key=bits_key,
        )
    )


def _is_linear_attention_layer(cfg: dict, idx: int) -> bool:
    if cfg.get("model_type") not in GATED_DELTA_NET_TYPES:
        return False
    if cfg.get("layer_types"):
        return cfg["layer_types"][idx] == "linear_attention"
    return (idx + 1) % cfg.get("full_attention_interval", 4) != 0


def _decoder_layer(
    plan: ModelPlan,
    cfg: dict,
    idx: int,
    bits_key: str,
    with_indexer: bool = False,
    prefix: str | None = None,
) -> None:
    """Decoder layer `idx` under `prefix` (default model.layers.{idx}); a layer under
    another prefix (an MTP layer of the `mtp.` layout) is always full attention."""
    hidden = cfg["hidden_size"]
    main = prefix is None
    prefix = prefix or f"model.layers.{idx}"
    plan.add_plain(f"{prefix}.input_layernorm.weight", (hidden,), "norm")
    if main and _is_linear_attention_layer(cfg, idx):
        _gated_delta_net(plan, cfg, f"{prefix}.linear_attn", hidden, bits_key)
    else:
        _attention(plan, cfg, f"{prefix}.self_attn", hidden, bits_key, with_indexer)
    plan.add_plain(f"{prefix}.post_attention_layernorm.weight", (hidden,), "norm")
    if _is_moe_layer(cfg, idx):
        block = "block_sparse_moe" if cfg.get("model_type") in MIXTRAL_TYPES else "mlp"
        _moe(plan, cfg, f"{prefix}.{block}", hidden, bits_key)
    else:
        _mlp(plan, f"{prefix}.mlp", hidden, cfg["intermediate_size"], bits_key)


# layer_types entries of the DSA family's every layer (transformers' glm_moe_dsa
# default, and the spelling GLM-5.2's config.json uses).
DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")

# Model types ExLlamaV3 converts but vLLM cannot run with EXL3 weights: the plan says
# so instead of tripping over a key of theirs (the overlay's unsupported_models.py has
# the reasons; vLLM refuses the same checkpoints while building its config).
UNSUPPORTED_MODEL_TYPES = {
    "deepseek_v4": "DeepSeek V4 (DeepseekV4ForCausalLM): vLLM's V4 attention runs wo_a "
    "as an FP8 einsum and the KV compressors as dense weights, both outside the "
    "quantization method",
}

_UNSUPPORTED_KEYS = {
    "layer_types": lambda v: any(
        t not in ("full_attention", "sliding_attention", *DSA_LAYER_TYPES)
        for t in v or []
    ),
    "mtp_num_hidden_layers": bool,
    "vision_config": bool,
}


def mtp_layer_count(cfg: dict) -> int:
    """How many MTP layers config.json declares (either key)."""
    return sum(int(cfg.get(key) or 0) for key in MTP_LAYER_KEYS)


def _prefix_mtp(plan: ModelPlan, cfg: dict, layers: int) -> None:
    """The `mtp.` layout in ExLlamaV3's module order (qwen3_5_mtp: the input layer's
    two norms and fc, the decoder layers, the final norm), every linear at mtp_bits.
    ExLlamaV3 builds fc with pad_to=1; for a hidden size that is a multiple of 128
    (every real one) that is the padded shape too."""
    hidden = cfg["hidden_size"]
    plan.add_plain(f"{MTP_PREFIX}pre_fc_norm_hidden.weight", (hidden,), "norm")
    plan.add_plain(f"{MTP_PREFIX}pre_fc_norm_embedding.weight", (hidden,), "norm")
    # vLLM builds fc as a ColumnParallelLinear gathering its output.
    fc = f"{MTP_PREFIX}fc"
    plan.add_linear(LinearSlot(fc, 2 * hidden, hidden, COLUMN, fc, bits_key="mtp_bits"))
    for i in range(layers):
        # vLLM numbers an MTP layer by its own index (mtp.layers.{i}), and so decides
        # whether it is MoE.
        _decoder_layer(plan, cfg, i, "mtp_bits", prefix=f"{MTP_PREFIX}layers.{i}")
    plan.add_plain(f"{MTP_PREFIX}norm.weight", (hidden,), "norm")


def plan_model(cfg: dict) -> ModelPlan:
    """The plan of a (text-only) decoder config; raises PlanError for what it does not
    know."""
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "vocab_size",
    ):
        if key not in cfg:
            raise PlanError(
                f"config.json: missing {key!r} (not a decoder-only text model?)"
            )
    if cfg.get("model_type") in UNSUPPORTED_MODEL_TYPES:
        raise PlanError(
            f"config.json: {UNSUPPORTED_MODEL_TYPES[cfg['model_type']]}; not supported"
        )
    prefix_mtp = cfg.get("model_type") in MTP_PREFIX_TYPES
    for key, bad in _UNSUPPORTED_KEYS.items():
        if key == "layer_types" and cfg.get("model_type") in GATED_DELTA_NET_TYPES:
            continue  # linear-attention layers, placed by full_attention_interval
        if key == "mtp_num_hidden_layers" and prefix_mtp:
            continue  # the `mtp.` layout
        if key in cfg and bad(cfg[key]):
            raise PlanError(
                f"config.json: {key}={cfg[key]!r} is not supported by the planner"
            )
    if (
        cfg.get("num_local_experts")
        and not cfg.get("moe_intermediate_size")
        and cfg.get("model_type") not in MIXTRAL_TYPES
    ):
        raise PlanError(
            f"config.json: model type {cfg.get('model_type')!r} has "
            f"num_local_experts but no moe_intermediate_size (only Mixtral's w1/w2/w3 "
            f"layout is known)"
        )
    if "index_topk" in cfg and not cfg.get("kv_lora_rank"):
        raise PlanError(
            "config.json: index_topk without kv_lora_rank (DSA runs on MLA attention)"
        )
    if any(t in DSA_LAYER_TYPES for t in cfg.get("layer_types") or []) and (
        "index_topk" not in cfg
    ):
        raise PlanError(
            "config.json: layer_types names DSA layers but there is no index_topk"
        )
    if prefix_mtp and cfg.get("num_nextn_predict_layers"):
        raise PlanError(
            f"config.json: num_nextn_predict_layers for model type "
            f"{cfg.get('model_type')!r}, whose MTP layers are stored under mtp. and "
            "counted by mtp_num_hidden_layers"
        )
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    plan = ModelPlan()
    plan.add_plain("model.embed_tokens.weight", (vocab, hidden), "embed")
    owners = indexer_layers(cfg)
    for idx in range(cfg["num_hidden_layers"]):
        _decoder_layer(plan, cfg, idx, "bits", owners[idx])
    plan.add_plain("model.norm.weight", (hidden,), "norm")
    plan.add_linear(
        LinearSlot("lm_head", hidden, vocab, VOCAB, "lm_head", bits_key="head_bits")
    )
    if prefix_mtp and cfg.get("mtp_num_hidden_layers"):
        _prefix_mtp(plan, cfg, int(cfg["mtp_num_hidden_layers"]))
    n_mtp = cfg.get("num_nextn_predict_layers") or 0
    first = cfg["num_hidden_layers"]
    if n_mtp:
        # ExLlamaV3 reads the input projection of the first MTP layer and the
        # shared_head norm of the last; the MTP layers' own embed_tokens /
        # shared_head.head are not stored.
        prefix = f"model.layers.{first}"
        plan.add_plain(f"{prefix}.enorm.weight", (hidden,), "norm")
        plan.add_plain(f"{prefix}.hnorm.weight", (hidden,), "norm")
        plan.add_linear(
            LinearSlot(
                f"{prefix}.eh_proj",
                2 * hidden,
                hidden,
                REPLICATED,
                f"{prefix}.eh_proj",
                bits_key="mtp_bits",
            )
        )
        for i in range(n_mtp):
            # A DSA model's MTP layers always own an indexer (ExLlamaV3's
            # glm_moe_dsa MTP model and vLLM's alike).
            _decoder_layer(plan, cfg, first + i, "mtp_bits", "index_topk" in cfg)
        plan.add_plain(
            f"model.layers.{first + n_mtp - 1}.shared_head.norm.weight",
            (hidden,),
            "norm",
        )
    return plan
