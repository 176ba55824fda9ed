# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One verdict on an EXL3 checkpoint directory, shared by vLLM's loader and the tools.

`assess_checkpoint` reads no weight: the files (checkpoint_files.py), the quantization
method config.json declares (vLLM picks the method from it), the EXL3 modules
(format.py), then config.json against the tensors (hidden size, vocabulary, the dims of
every projection it implies, layer and expert counts, head presence and tying, biases).
It lists every problem, most basic first, each message starting with the tensor or file
it is about; `validate_checkpoint` fails closed on the first (vLLM's loader and
`dequantize`), `inspect` lists them all. What the JSON files *declare* about bitrates
and codebooks is compared too, but the tensors decide: those disagreements come back as
warnings. `value_problems` reads the little data a verdict needs beyond the headers:
the codebook markers, and `suh` / `svh` under `check_scale_values`, the rule applied
wherever their data is read (the vLLM loader, `dequantize`, `inspect --values`).

vLLM builds the model from config.json, so a config that claims more than the checkpoint
holds would leave parameters unwritten (vLLM tracks unloaded parameters only for
unquantized models); a config that claims less would fail inside a model's loader. Both
are named here instead.

Imports only the standard library and torch (through format.py), so the tools load it on
its own.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint_files import (
    Exl3FormatError,
    TensorEntry,
    read_json_object,
    read_safetensors_index,
)
from .format import (
    EXL3_ONLY_SUFFIXES,
    HADAMARD_SIZE,
    Codebook,
    Exl3EmbeddingSpec,
    Exl3ModuleSpec,
    TensorShape,
    check_marker,
    embedding_spec,
    group_shapes,
    group_spec,
    is_embedding_group,
    read_tensor,
    round_up,
    tensor_shapes,
)

CONFIG_FILE = "config.json"
QUANT_CONFIG_FILE = "quantization_config.json"
# config.json's quantization_config.quant_method that makes vLLM pick this method.
EXL3_METHOD = "exl3"
# config.json keys that name the number of routed experts, in the order models use them.
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
# config.json keys for extra (multi-token-prediction) layers stored after the main ones.
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# config.json's `bits` has 2 decimals; a larger gap than the rounding is a mismatch.
BITS_TOLERANCE = 0.0051
CODEBOOK_NAMES = {
    Codebook.THREE_INST: "3inst",
    Codebook.MCG: "mcg",
    Codebook.MUL1: "mul1",
}
# Names listed in a message before "and N more".
LIST_LIMIT = 3
# A linear's bias: its own tensor in every form the linear is stored in.
BIAS_SUFFIX = "bias"
# Model types whose q/k/v projections carry a bias without saying so in config.json
# (their o_proj has none).
IMPLICIT_QKV_BIAS = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl")
# Model types whose o_proj vLLM builds with a bias whatever attention_bias says; every
# other model builds it without one when attention_bias is false (Llama ties it to
# attention_bias, Qwen3 and Mixtral never have one).
O_PROJ_BIAS_ALWAYS = ("gpt_oss", "phimoe")
# Model types built on vLLM's Qwen3NextAttention: q_proj also carries the output gate
# (twice the query width) unless config.json sets attn_output_gate to false.
GATED_ATTENTION = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
# Norms whose length is the hidden size: per decoder layer, and the final one.
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
FINAL_NORMS = ("model.norm", "model.language_model.norm", "language_model.model.norm")

# The `mtp.` MTP layout (Qwen3-Next, Qwen3.5 / 3.6: ExLlamaV3's qwen3_5_mtp, vLLM's
# Qwen3NextMTP / Qwen3_5MTP / Qwen3_5MoeMTP): two input norms, fc (2 * hidden ->
# hidden), full-attention decoder layers mtp.layers.{i} and mtp.norm, nothing else.
# ExLlamaV3 stores them only where its architecture has an MTP model (Qwen3.5 / 3.6
# multimodal, not Qwen3-Next or the text-only classes); such a checkpoint loads without
# its draft.
MTP_PREFIX = "mtp."
MTP_PREFIX_TYPES = GATED_ATTENTION
MTP_FC = "mtp.fc"
MTP_HIDDEN_NORMS = ("mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_embedding", "mtp.norm")
MTP_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
MTP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# The DSA lightning indexer under an MLA layer (DeepSeek-V3.2, GLM-5): vLLM 0.26
# builds wq_b with the quant config and wk + weights_proj as one unquantized GEMM
# (`wk_weights_proj`, quant_config=None), so only wq_b may be EXL3, as ExLlamaV3 stores
# it; k_norm is a LayerNorm with a bias.
INDEXER = "self_attn.indexer"
INDEXER_UNQUANTIZED = ("wk", "weights_proj")
# vLLM's defaults for the indexer schedule (DeepseekV2MLAAttention).
INDEX_TOPK_FREQ = 1
INDEX_SKIP_TOPK_OFFSET = 2

_LAYER = re.compile(r"^(?P<base>(?:.+\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"^(?P<mlp>.+\.experts)\.(?P<index>\d+)\.")


@dataclass
class CheckpointDescription:
    """What a validated checkpoint holds (headers and JSON only)."""

    root: str
    tensors: dict[str, TensorEntry]
    config: dict | None  # config.json
    quant_document: dict | None  # quantization_config.json
    modules: dict[str, Exl3ModuleSpec]  # EXL3 linears by module key
    embeddings: dict[str, Exl3EmbeddingSpec]  # quantized token embeddings (§8)
    warnings: list[str] = field(
        default_factory=list
    )  # declared vs stored; the tensors win
    # Every rule broken, most basic first (validate_checkpoint raises the first).
    problems: list[str] = field(default_factory=list)


def listing(names: list[str], limit: int = LIST_LIMIT) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def more_problems(n: int) -> str:
    return f"{n} more problem{'s' if n > 1 else ''}"


# ---- reading
# --------------------------------------------------------------------------------


def read_documents(root: str) -> tuple[dict | None, dict | None]:
    """config.json and quantization_config.json (None where absent), syntax errors
    and broken links named."""
    docs = []
    for name in (CONFIG_FILE, QUANT_CONFIG_FILE):
        path = os.path.join(root, name)
        docs.append(read_json_object(path) if os.path.lexists(path) else None)
    return docs[0], docs[1]


def find_modules(
    tensors: Mapping[str, TensorShape],
    problems: list[str] | None = None,
) -> tuple[dict[str, Exl3ModuleSpec], dict[str, Exl3EmbeddingSpec]]:
    """EXL3 linears and quantized token embeddings (both validated), by module key, in
    sorted order (so every reader meets the same first error). `tensors`: name ->
    (shape, dtype), from the safetensors headers or from tensor_storage. A module that
    breaks a rule raises, or, given `problems`, is left out and its error appended
    there."""
    specs: dict[str, Exl3ModuleSpec] = {}
    embeddings: dict[str, Exl3EmbeddingSpec] = {}
    for prefix, members in group_shapes(tensors).items():
        try:
            if is_embedding_group(members):
                embeddings[prefix] = embedding_spec(prefix, members)
                continue
            spec = group_spec(prefix, members)
        except Exl3FormatError as e:
            if problems is None:
                raise
            problems.append(str(e))
            continue
        if spec is not None:
            specs[prefix] = spec
    return specs, embeddings


def assess_checkpoint(
    ckpt_dir: str | os.PathLike, *, tied: bool | None = None
) -> CheckpointDescription:
    """Every structural rule, from the headers and JSON files: each problem listed in
    `problems` (a file that cannot be read as what it claims to be raises at once, as
    nothing after it could be described).

    `tied`: whether the model ties its output layer to the token embedding, when the
    caller knows it better than config.json (vLLM resolves the model class's default).
    """
    root = os.fspath(ckpt_dir)
    if not os.path.isdir(root):
        raise Exl3FormatError(f"{root}: not a directory")
    tensors = read_safetensors_index(root)
    config, quant_document = read_documents(root)
    problems: list[str] = []
    specs, embeddings = find_modules(tensor_shapes(tensors), problems)
    declared, warnings = method_declaration(config, quant_document, specs)
    problems[:0] = declared
    if config is not None:
        problems += config_problems(
            config, tensors, specs, tied=tied, embeddings=embeddings
        )
    warnings += declared_disagreements(config, quant_document, specs)
    return CheckpointDescription(
        root, tensors, config, quant_document, specs, embeddings, warnings, problems
    )


def validate_checkpoint(
    ckpt_dir: str | os.PathLike, *, tied: bool | None = None
) -> CheckpointDescription:
    """`assess_checkpoint`, failing closed on its first problem (an Exl3FormatError
    that says how many more there are)."""
    description = assess_checkpoint(ckpt_dir, tied=tied)
    problems = description.problems
    if problems:
        more = f" (and {more_problems(len(problems) - 1)})" if len(problems) > 1 else ""
        raise Exl3FormatError(problems[0] + more)
    return description


# ---- the quantization method config.json declares
# -------------------------------------------


def quant_block(config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """config.json's quantization_config, where vLLM looks for it (the top level, else
    a multimodal model's text_config)."""
    if not config:
        return None
    block = config.get("quantization_config")
    if block is None and isinstance(config.get("text_config"), Mapping):
        block = config["text_config"].get("quantization_config")
    return block if isinstance(block, Mapping) else None


def method_declaration(
    config: Mapping[str, Any] | None,
    quant_document: Mapping[str, Any] | None,
    specs: Mapping[str, Exl3ModuleSpec],
) -> tuple[list[str], list[str]]:
    """(problems, warnings) about the quantization method config.json declares.

    vLLM picks the quantization method from config.json's `quant_method` alone and
    builds the model for it; EXL3 tensors under any other method fail on their first
    tensor (or earlier, for a method vLLM does not know). Without a block, vLLM takes
    quantization_config.json for it when that file names exl3 (ExLlamaV3 writes it
    beside config.json; a local directory only, patch 0010): that loads, with a
    warning.
    """
    if config is None:
        return [], []
    exl3 = sorted(specs)
    held = (
        f"the tensors are EXL3 ({len(exl3)} modules with a .trellis: {listing(exl3)})"
        if exl3
        else "the checkpoint holds no EXL3 tensors (no .trellis)"
    )
    block = quant_block(config)
    if block is not None:
        method = block.get("quant_method")
        if str(method).lower() == EXL3_METHOD:
            return [], []
        return [
            f"{CONFIG_FILE}: quantization_config.quant_method = {method!r}, not "
            f"{EXL3_METHOD!r}, but {held}: vLLM picks the quantization method from "
            f'this field and would not run them as EXL3; set it to "{EXL3_METHOD}" '
            "(ExLlamaV3's converter writes that)"
            if exl3
            else f"{CONFIG_FILE}: quantization_config.quant_method = {method!r}, not "
            f"{EXL3_METHOD!r}, and {held}: not an EXL3 checkpoint"
        ], []
    side = (quant_document or {}).get("quant_method")
    if str(side).lower() == EXL3_METHOD:
        stored = f"{len(exl3)} EXL3 modules stored" if exl3 else held
        return [], [
            f"{CONFIG_FILE}: no quantization_config block; read as EXL3 from "
            f"{QUANT_CONFIG_FILE}, which ExLlamaV3 writes beside it and which declares "
            f"quant_method {EXL3_METHOD!r} ({stored}). Did a tool rewrite "
            f"{CONFIG_FILE}? Restore the block: {QUANT_CONFIG_FILE}'s fields without "
            "tensor_storage"
        ]
    if not exl3:
        return [], []
    found = (
        f"{QUANT_CONFIG_FILE} declares quant_method {side!r}"
        if quant_document is not None
        else f"no {QUANT_CONFIG_FILE} beside it"
    )
    return [
        f"{CONFIG_FILE}: no quantization_config block and {found}, but {held}: vLLM "
        "would build the model unquantized and fail on the first EXL3 tensor; add "
        f'"quantization_config": {{"quant_method": "{EXL3_METHOD}"}} to {CONFIG_FILE} '
        "(ExLlamaV3's converter writes it, with the bitrates)"
    ], []


# ---- config.json against the tensors
# ---------------------------------------------------------


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's config: multimodal wrappers keep it under text_config."""
    inner = config.get("text_config")
    if isinstance(inner, Mapping) and "hidden_size" not in config:
        return inner
    return config


def _int(cfg: Mapping[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    return (
        value
        if isinstance(value, int) and not isinstance(value, bool) and value > 0
        else None
    )


def expert_count(cfg: Mapping[str, Any]) -> int | None:
    """Routed experts per MoE layer as config.json declares them (None for a dense
    model)."""
    for key in EXPERT_COUNT_KEYS:
        if (n := _int(cfg, key)) is not None:
            return n
    return None


def expert_key(cfg: Mapping[str, Any]) -> str:
    return next(
        (k for k in EXPERT_COUNT_KEYS if _int(cfg, k) is not None), EXPERT_COUNT_KEYS[1]
    )


def expert_ids(names: Iterable[str]) -> dict[str, set[int]]:
    """{experts container (e.g. model.layers.3.mlp.experts): expert indices stored}."""
    out: dict[str, set[int]] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            out.setdefault(m.group("mlp"), set()).add(int(m.group("index")))
    return out


def _ranges(indices: Iterable[int]) -> str:
    """0-3, 5, 7-9"""
    parts, run = [], []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(parts) or "none"


def _intermediate(cfg: Mapping[str, Any], name: str) -> tuple[int | None, str]:
    """The real intermediate width of an MLP projection and the config.json keys it
    comes from."""
    if ".slice." in name:
        return None, ""  # ExLlamaV3 slices of a very wide dense MLP; widths are its own
    if ".experts." in name:
        return _int(cfg, "moe_intermediate_size"), "moe_intermediate_size"
    if ".shared_expert." in name:
        return _int(
            cfg, "shared_expert_intermediate_size"
        ), "shared_expert_intermediate_size"
    if ".shared_experts." in name:
        inter, shared = (
            _int(cfg, "moe_intermediate_size"),
            _int(cfg, "n_shared_experts"),
        )
        return (
            (inter * shared if inter and shared else None),
            "moe_intermediate_size x n_shared_experts",
        )
    return _int(cfg, "intermediate_size"), "intermediate_size"


def implied_dims(cfg: Mapping[str, Any], name: str) -> tuple[int, int, str] | None:
    """(real k, real n, which config.json keys say so) of a linear, from its name; None
    when config.json does not determine it."""
    hidden = _int(cfg, "hidden_size")
    if hidden is None:
        return None
    leaf = name.rpartition(".")[2]
    if leaf == "lm_head":
        vocab = _int(cfg, "vocab_size")
        return (hidden, vocab, "hidden_size, vocab_size") if vocab else None
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj") and ".self_attn." in f".{name}":
        if cfg.get("kv_lora_rank"):
            # MLA: projections through the LoRA ranks, checked by the shape rules only.
            return None
        heads = _int(cfg, "num_attention_heads")
        if heads is None:
            return None
        kv_heads = _int(cfg, "num_key_value_heads") or heads
        head_dim = _int(cfg, "head_dim") or hidden // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        keys = "hidden_size, num_attention_heads, num_key_value_heads, head_dim"
        gated = cfg.get("model_type") in GATED_ATTENTION and cfg.get(
            "attn_output_gate", True
        )
        if gated and leaf == "q_proj":
            keys += ", model_type's attn_output_gate"
        return {
            "q_proj": (hidden, 2 * q if gated else q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
        }[leaf] + (keys,)
    if name == MTP_FC:
        return 2 * hidden, hidden, "hidden_size: 2 x hidden_size -> hidden_size"
    if leaf == "wq_b" and ".indexer." in name:
        q_rank, heads = _int(cfg, "q_lora_rank"), _int(cfg, "index_n_heads")
        head_dim = _int(cfg, "index_head_dim")
        if not (q_rank and heads and head_dim):
            return None
        keys = "q_lora_rank, index_n_heads, index_head_dim"
        return q_rank, heads * head_dim, keys
    if leaf in ("gate_proj", "up_proj", "down_proj"):
        inter, key = _intermediate(cfg, name)
        if inter is None:
            return None
        keys = f"hidden_size, {key}"
        return (inter, hidden, keys) if leaf == "down_proj" else (hidden, inter, keys)
    return None


def _dims_problem(
    cfg: Mapping[str, Any],
    module: str,
    stored: tuple[int, int],
    tensor: str,
    exact_padded: bool,
) -> str | None:
    implied = implied_dims(cfg, module)
    if implied is None:
        return None
    k, n, keys = implied
    padded = (round_up(k, HADAMARD_SIZE), round_up(n, HADAMARD_SIZE))
    if stored == padded or (not exact_padded and stored == (k, n)):
        return None
    return (
        f"{tensor}: stored k x n = {stored[0]} x {stored[1]}, but config.json ({keys}) "
        f"implies {k} x {n}, padded to {padded[0]} x {padded[1]} (is config.json from "
        "another model?)"
    )


def _layer_problems(cfg: Mapping[str, Any], names: list[str]) -> list[str]:
    """Decoder layer count, and every layer storing what its peers store."""
    per_base: dict[str, dict[int, set[str]]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            per_base.setdefault(m.group("base"), {}).setdefault(
                int(m.group("index")), set()
            ).add(m.group("rest"))
    layers_total = _int(cfg, "num_hidden_layers")
    if not per_base or layers_total is None:
        return []
    base = max(per_base, key=lambda b: sum(len(v) for v in per_base[b].values()))
    stored = per_base[base]
    extra = sum(_int(cfg, k) or 0 for k in MTP_LAYER_KEYS)
    problems = []
    missing = [i for i in range(layers_total) if i not in stored]
    if missing:
        problems.append(
            f"{base}.{missing[0]}: no tensors stored, but config.json "
            f"num_hidden_layers = {layers_total} (the checkpoint stores layers "
            f"{_ranges(stored)}; the model would be built with layers it cannot load)"
        )
    beyond = [i for i in stored if i >= layers_total + extra]
    if beyond:
        problems.append(
            f"{base}.{min(beyond)}: stored, but config.json num_hidden_layers = "
            f"{layers_total}"
            + (f" (+ {extra} MTP)" if extra else "")
            + f" (the checkpoint stores layers {_ranges(stored)}; is config.json from "
            "another model?)"
        )
    # Layers of one kind (layer_types entry, MoE or dense) store the same modules and
    # other tensors (layer_contents).
    types = cfg.get("layer_types")
    groups: dict[tuple, list[int]] = {}
    for i in range(layers_total):
        if i not in stored:
            continue
        kind = types[i] if isinstance(types, list) and i < len(types) else None
        moe = any(_EXPERT.match(f"x.{r}") for r in stored[i])
        # DSA layers that reuse another layer's selection store no indexer.
        indexer = any(r.startswith(f"{INDEXER}.") for r in stored[i])
        groups.setdefault((kind, moe, indexer), []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        contents = {i: layer_contents(stored[i]) for i in members}
        for i in members:
            others = [set(contents[j]) for j in members if j != i]
            lacking = sorted(set.intersection(*others) - set(contents[i]))
            if lacking:
                module = next(
                    c[lacking[0]] for c in contents.values() if lacking[0] in c
                )
                problems.append(
                    f"{base}.{i}.{module}: missing from the checkpoint "
                    f"({listing(lacking)} absent from {base}.{i}; every other layer of "
                    "its kind stores them)"
                )
    return problems


def layer_contents(rests: Iterable[str]) -> dict[str, str]:
    """What one decoder layer stores, as layers of one kind must all store it: {item:
    the module it belongs to}, relative to the layer, experts' indices as `*`.

    A module's weights are one item, the module's own name, in whichever form they are
    stored: EXL3 (any codebook marker or none, suh/svh or the legacy su/sv bitfields,
    an ignored legacy scale) or an unquantized `.weight`. Layer-mixing tools combine
    modules of different conversions, and each module's tensors describe it completely
    (format.py checks that). Every other tensor (a bias, a norm's bias, a router's
    correction bias) is an item of its own.
    """
    by_module: dict[str, set[str]] = {}
    for rest in rests:
        module, _, suffix = rest.rpartition(".")
        by_module.setdefault(module, set()).add(suffix)
    items: dict[str, str] = {}
    for module, suffixes in by_module.items():
        is_exl3 = any(s in EXL3_ONLY_SUFFIXES for s in suffixes)
        key = _EXPERT.sub(r"\g<mlp>.*.", f"x.{module}.")[2:-1]
        for suffix in suffixes:
            weights = suffix == "weight" or (is_exl3 and suffix != BIAS_SUFFIX)
            items[key if weights else f"{key}.{suffix}"] = key
    return items


def vllm_indexer_layers(cfg: Mapping[str, Any]) -> list[bool]:
    """Which decoder layers vLLM 0.26's DeepSeek-V2 model builds a DSA indexer for:
    `index_topk_pattern` ("F" / "S" per layer) when given, else every
    `index_topk_freq`-th layer counted from `index_skip_topk_offset`."""
    layers = _int(cfg, "num_hidden_layers") or 0
    pattern = cfg.get("index_topk_pattern")
    if isinstance(pattern, (str, list)):
        return [i >= len(pattern) or pattern[i] != "S" for i in range(layers)]
    freq = _int(cfg, "index_topk_freq") or INDEX_TOPK_FREQ
    offset = cfg.get("index_skip_topk_offset", INDEX_SKIP_TOPK_OFFSET)
    return [max(i - offset + 1, 0) % freq == 0 for i in range(layers)]


def _indexer_problems(
    cfg: Mapping[str, Any],
    tensors: Mapping[str, TensorEntry],
    specs: Mapping[str, Exl3ModuleSpec],
) -> list[str]:
    """A DSA model's indexers: on every layer vLLM builds one for (stored MTP layers),
    wq_b (EXL3 or fp16), wk and weights_proj (fp16 at their real dims: vLLM loads them
    unquantized, unpadded) and k_norm's weight and bias, each of its config.json shape;
    config.json's `indexer_types` (ExLlamaV3's schedule) equal to the one vLLM derives.
    """
    if "index_topk" not in cfg:
        return []
    layers = _int(cfg, "num_hidden_layers")
    hidden, q_rank = _int(cfg, "hidden_size"), _int(cfg, "q_lora_rank")
    heads, head_dim = _int(cfg, "index_n_heads"), _int(cfg, "index_head_dim")
    if not (layers and hidden and heads and head_dim):
        return [
            "config.json: index_topk without positive num_hidden_layers, hidden_size, "
            "index_n_heads and index_head_dim (the DSA indexer cannot be built)"
        ]
    problems = []
    owners = vllm_indexer_layers(cfg)
    types = cfg.get("indexer_types")
    if isinstance(types, list):
        derived = "".join("F" if o else "S" for o in owners)
        wanted = "".join("F" if t == "full" else "S" for t in types[:layers])
        if wanted != derived:
            i = next(
                (i for i, (a, b) in enumerate(zip(wanted, derived)) if a != b),
                min(len(wanted), len(derived)),
            )
            problems.append(
                f"config.json: indexer_types[{i}] = "
                f"{types[i] if i < len(types) else None!r}, but vLLM builds the "
                f"indexers from index_topk_pattern / index_topk_freq / "
                f"index_skip_topk_offset, which give {derived!r} (F = full, S = "
                f"shared): layers would score with weights the checkpoint does not "
                f"hold or reuse a selection they should make; add "
                f'"index_topk_pattern": "{wanted}" to config.json'
            )
    extra = sum(_int(cfg, k) or 0 for k in MTP_LAYER_KEYS)
    expected = {
        "wq_b": (heads * head_dim, q_rank),
        "wk": (head_dim, hidden),
        "weights_proj": (heads, hidden),
    }
    # MTP layers always own one; ExLlamaV3 leaves them out of a conversion unless
    # they are added to it, and a model without them runs without its draft.
    stored_mtp = [
        i
        for i in range(layers, layers + extra)
        if any(name.startswith(f"model.layers.{i}.") for name in tensors)
    ]
    for i in [i for i in range(layers) if owners[i]] + stored_mtp:
        prefix = f"model.layers.{i}.{INDEXER}"
        for leaf, shape in expected.items():
            module = f"{prefix}.{leaf}"
            if module in specs:
                if leaf in INDEXER_UNQUANTIZED:
                    problems.append(
                        f"{module}.trellis: EXL3, but vLLM builds the indexer's wk and "
                        "weights_proj as one unquantized GEMM (wk_weights_proj) and "
                        "cannot load a quantized one (ExLlamaV3 stores both fp16)"
                    )
                continue
            entry = tensors.get(f"{module}.weight")
            if entry is None:
                problems.append(
                    f"{module}: missing (no {module}.trellis or {module}.weight), but "
                    f"vLLM builds an indexer on layer {i} (config.json index_topk, "
                    "indexer schedule); its weights would never be loaded"
                )
            elif leaf != "wq_b" and tuple(entry.shape) != shape:
                problems.append(
                    f"{module}.weight: shape {list(entry.shape)}, but config.json "
                    f"(hidden_size, index_n_heads, index_head_dim) implies "
                    f"{list(shape)}; vLLM loads it unquantized at its real dims"
                )
        for suffix in ("weight", "bias"):
            name = f"{prefix}.k_norm.{suffix}"
            entry = tensors.get(name)
            if entry is None:
                problems.append(
                    f"{name}: missing, but vLLM builds an indexer on layer {i} (its "
                    "k_norm is a LayerNorm with weight and bias)"
                )
            elif tuple(entry.shape) != (head_dim,):
                problems.append(
                    f"{name}: shape {list(entry.shape)}, but config.json "
                    f"index_head_dim = {head_dim}"
                )
    return problems


def prefix_mtp_layers(cfg: Mapping[str, Any]) -> int:
    """MTP layers of the `mtp.` layout config.json declares (0 for other models)."""
    if cfg.get("model_type") not in MTP_PREFIX_TYPES:
        return 0
    return sum(_int(cfg, k) or 0 for k in MTP_LAYER_KEYS)


def is_mtp_module(cfg: Mapping[str, Any], name: str) -> bool:
    """Whether a module belongs to the MTP layers: under `mtp.`, or a decoder layer
    past num_hidden_layers (the DeepSeek / GLM layout)."""
    if name.startswith(MTP_PREFIX):
        return True
    layers = _int(cfg, "num_hidden_layers")
    m = _LAYER.match(name)
    return bool(
        m
        and layers
        and m.group("base") != "mtp.layers"
        and int(m.group("index")) >= layers
    )


def _is_moe_mtp_layer(cfg: Mapping[str, Any], index: int) -> bool:
    """Whether vLLM builds MTP layer `index` with routed experts (Qwen3NextDecoderLayer
    numbers it by its own index)."""
    if expert_count(cfg) is None or index in (cfg.get("mlp_only_layers") or []):
        return False
    return (index + 1) % (_int(cfg, "decoder_sparse_step") or 1) == 0


def _prefix_mtp_problems(
    cfg: Mapping[str, Any],
    tensors: Mapping[str, TensorEntry],
    specs: Mapping[str, Exl3ModuleSpec],
) -> list[str]:
    """The `mtp.` layout, when the conversion stores it: every tensor vLLM's MTP draft
    loads present (a linear as EXL3 or as an unquantized .weight), the norms at their
    config.json lengths, no layer beyond the declared count. Projection shapes are the
    dims rules' (implied_dims)."""
    stored = sorted(n for n in tensors if n.startswith(MTP_PREFIX))
    if not stored:
        return []
    layers = prefix_mtp_layers(cfg)
    if layers == 0:
        return [
            f"{stored[0]}: stored, but config.json declares no MTP layers "
            f"({' / '.join(MTP_LAYER_KEYS)}) for model type "
            f"{cfg.get('model_type')!r} (is config.json from another model?)"
        ]
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    head_dim = _int(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    norms = {name: hidden for name in MTP_HIDDEN_NORMS}
    linears = [MTP_FC]
    for i in range(layers):
        layer = f"mtp.layers.{i}"
        norms.update({f"{layer}.{n}": hidden for n in LAYER_NORMS})
        norms.update({f"{layer}.{n}": head_dim for n in MTP_HEAD_NORMS})
        linears += [f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        linears.append(f"{layer}.self_attn.o_proj")
        if not _is_moe_mtp_layer(cfg, i):
            linears += [f"{layer}.mlp.{p}" for p in MTP_PROJECTIONS]
            continue
        linears.append(f"{layer}.mlp.gate")
        for e in range(expert_count(cfg) or 0):
            linears += [f"{layer}.mlp.experts.{e}.{p}" for p in MTP_PROJECTIONS]
        if _int(cfg, "shared_expert_intermediate_size"):
            linears += [f"{layer}.mlp.shared_expert.{p}" for p in MTP_PROJECTIONS]
            linears.append(f"{layer}.mlp.shared_expert_gate")
    problems = []
    declared = f"config.json {' / '.join(k for k in MTP_LAYER_KEYS if k in cfg)}"
    for module in linears:
        if module not in specs and f"{module}.weight" not in tensors:
            problems.append(
                f"{module}: missing (no {module}.trellis or {module}.weight), but the "
                f"checkpoint stores MTP layers ({declared} = {layers}) and vLLM's MTP "
                "draft loads it"
            )
    for name, length in norms.items():
        entry = tensors.get(f"{name}.weight")
        if entry is None:
            problems.append(
                f"{name}.weight: missing, but the checkpoint stores MTP layers "
                f"({declared} = {layers}) and vLLM's MTP draft loads it"
            )
        elif length and tuple(entry.shape) != (length,):
            problems.append(
                f"{name}.weight: shape {list(entry.shape)}, but config.json implies "
                f"[{length}] (hidden_size / head_dim)"
            )
    beyond = sorted(
        {
            int(m.group("index"))
            for n in stored
            if (m := _LAYER.match(n)) and m.group("base") == "mtp.layers"
        }
        - set(range(layers))
    )
    if beyond:
        problems.append(
            f"mtp.layers.{beyond[0]}: stored, but {declared} = {layers} (vLLM's MTP "
            "draft would not load it)"
        )
    return problems


def _expert_problems(cfg: Mapping[str, Any], names: list[str]) -> list[str]:
    count = expert_count(cfg)
    stored = expert_ids(names)
    problems = []
    if count is None:
        if stored:
            container = min(stored)
            problems.append(
                f"{container}.{min(stored[container])}: expert tensors stored, but "
                f"config.json declares no experts ({' / '.join(EXPERT_COUNT_KEYS)}; is "
                "config.json from another model?)"
            )
        return problems
    key = expert_key(cfg)
    if not stored:
        problems.append(
            f"config.json: {key} = {count}, but the checkpoint stores no expert "
            "tensors (is config.json from another model?)"
        )
    for container, ids in sorted(stored.items()):
        missing = sorted(set(range(count)) - ids)
        if missing:
            problems.append(
                f"{container}.{missing[0]}: missing ({len(missing)} of {count} experts "
                f"absent; config.json {key} = {count}, the checkpoint stores experts "
                f"{_ranges(ids)})"
            )
        beyond = sorted(i for i in ids if i >= count)
        if beyond:
            problems.append(
                f"{container}.{beyond[0]}: stored, but config.json {key} = {count} (is "
                "config.json from another model?)"
            )
    return problems


def _head_problems(
    cfg: Mapping[str, Any],
    tensors: Mapping[str, TensorEntry],
    specs: Mapping[str, Exl3ModuleSpec],
    tied: bool | None,
) -> list[str]:
    if tied is None:
        tied = cfg.get("tie_word_embeddings") is True
    heads = sorted(
        {
            n.rpartition(".")[0]
            for n in tensors
            if n.rpartition(".")[0].rpartition(".")[2] == "lm_head"
        }
    )
    if tied and heads:
        head = heads[0]
        stored = f"{head}.trellis" if head in specs else f"{head}.weight"
        return [
            f"{stored}: stored, but config.json tie_word_embeddings = true: vLLM would "
            "tie the output layer to the token embedding and drop the stored head "
            "(ExLlamaV3 writes an untied lm_head and sets tie_word_embeddings to "
            "false); set it to false"
        ]
    if not tied and not heads:
        return [
            "lm_head: missing (no lm_head.trellis or lm_head.weight), and config.json "
            "tie_word_embeddings is not true: the output layer would never be loaded "
            "(ExLlamaV3 always writes an lm_head; incomplete download?)"
        ]
    return []


def _bias_problems(
    cfg: Mapping[str, Any],
    tensors: Mapping[str, TensorEntry],
    specs: Mapping[str, Exl3ModuleSpec],
) -> list[str]:
    """Bias presence against attention_bias / mlp_bias, for the projections they
    govern."""
    model_type = str(cfg.get("model_type", ""))
    # (projections, whether the model builds them with a bias, why)
    rules: list[tuple[tuple[str, ...], bool, str]] = []
    if model_type in IMPLICIT_QKV_BIAS:
        why = f"model_type = {model_type!r}"
        rules.append((("q_proj", "k_proj", "v_proj"), True, why))
        rules.append((("o_proj",), False, why))
    elif isinstance(cfg.get("attention_bias"), bool):
        value = cfg["attention_bias"]
        why = f"attention_bias = {str(value).lower()}"
        rules.append((("q_proj", "k_proj", "v_proj"), value, why))
        if not value and model_type not in O_PROJ_BIAS_ALWAYS:
            rules.append((("o_proj",), False, why))
    if isinstance(cfg.get("mlp_bias"), bool):
        value = cfg["mlp_bias"]
        rules.append(
            (
                ("gate_proj", "up_proj", "down_proj"),
                value,
                f"mlp_bias = {str(value).lower()}",
            )
        )
    problems = []
    for module in sorted(specs):
        leaf = module.rpartition(".")[2]
        for leaves, expected, why in rules:
            if leaf not in leaves or ".experts." in module:
                continue
            has = specs[module].has_bias
            if has and not expected:
                problems.append(
                    f"{module}.bias: stored, but config.json {why}: the model builds "
                    f"{leaf} without a bias"
                )
            elif expected and not has:
                problems.append(
                    f"{module}.bias: missing, but config.json {why}: the model builds "
                    f"{leaf} with a bias"
                )
    return problems


def config_problems(
    config: Mapping[str, Any],
    tensors: Mapping[str, TensorEntry],
    specs: Mapping[str, Exl3ModuleSpec],
    *,
    tied: bool | None = None,
    embeddings: Mapping[str, Exl3EmbeddingSpec] | None = None,
) -> list[str]:
    """Every way config.json disagrees with the stored tensors, most basic first."""
    cfg = text_config(config)
    problems: list[str] = []
    hidden, vocab = _int(cfg, "hidden_size"), _int(cfg, "vocab_size")
    for name in sorted(tensors):
        entry = tensors[name]
        prefix, _, suffix = name.rpartition(".")
        leaf = prefix.rpartition(".")[2]
        if leaf == "embed_tokens" and suffix == "weight" and len(entry.shape) == 2:
            rows, cols = entry.shape
            if hidden and cols != hidden:
                problems.append(
                    f"{name}: shape {list(entry.shape)}, but config.json hidden_size = "
                    f"{hidden} (is config.json from another model?)"
                )
            if vocab and rows != vocab:
                problems.append(
                    f"{name}: shape {list(entry.shape)}, but config.json vocab_size = "
                    f"{vocab} (is config.json from another model?)"
                )
        elif (
            suffix == "weight"
            and hidden
            and entry.shape != (hidden,)
            and (prefix in FINAL_NORMS or (leaf in LAYER_NORMS and _LAYER.match(name)))
        ):
            problems.append(
                f"{name}: shape {list(entry.shape)}, but config.json hidden_size = "
                f"{hidden} (is config.json from another model?)"
            )
    names = sorted(tensors)
    problems += _layer_problems(cfg, names)
    problems += _expert_problems(cfg, names)
    problems += _indexer_problems(cfg, tensors, specs)
    problems += _prefix_mtp_problems(cfg, tensors, specs)
    for module, spec in sorted(specs.items()):
        found = _dims_problem(
            cfg,
            module,
            (spec.in_features, spec.out_features),
            f"{module}.trellis",
            exact_padded=True,
        )
        if found:
            problems.append(found)
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        entry = tensors[name]
        if suffix == "weight" and len(entry.shape) == 2 and prefix not in specs:
            n, k = entry.shape
            found = _dims_problem(cfg, prefix, (k, n), name, exact_padded=False)
            if found:
                problems.append(found)
    problems += _head_problems(cfg, tensors, specs, tied)
    problems += _embedding_problems(cfg, embeddings or {}, tied)
    problems += _bias_problems(cfg, tensors, specs)
    return problems


def _embedding_problems(
    cfg: Mapping[str, Any],
    embeddings: Mapping[str, Exl3EmbeddingSpec],
    tied: bool | None,
) -> list[str]:
    """A quantized token embedding (§8) against config.json: vocab_size rows, groups
    covering hidden_size, and no output layer tied to it (§8.3)."""
    if tied is None:
        tied = cfg.get("tie_word_embeddings") is True
    hidden, vocab = _int(cfg, "hidden_size"), _int(cfg, "vocab_size")
    problems = []
    for prefix, spec in sorted(embeddings.items()):
        if vocab and spec.rows != vocab:
            problems.append(
                f"{prefix}.trellis: {spec.rows} rows, but config.json vocab_size = "
                f"{vocab} (is config.json from another model?)"
            )
        if hidden and (found := spec.hidden_problem(hidden)):
            problems.append(f"{found}; config.json hidden_size = {hidden}")
        if tied:
            problems.append(
                f"{prefix}.trellis: a quantized token embedding, but config.json "
                "tie_word_embeddings = true makes it the output layer too, which EXL3 "
                "cannot run (ExLlamaV3 writes a separate lm_head and sets "
                "tie_word_embeddings to false)"
            )
    return problems


# ---- what the JSON files declare (the tensors decide)
# ----------------------------------------


def storage_claims(storage: Mapping[str, Any]) -> dict[str, tuple[Any, Codebook]]:
    """What tensor_storage says about each EXL3 module: (bits, codebook)."""
    claims = {}
    for key, entry in storage.items():
        if not isinstance(entry, Mapping) or entry.get("quant_format") != "exl3":
            continue
        if "mul1_multiplier" in entry:
            codebook = Codebook.MUL1
        elif "mcg_multiplier" in entry:
            codebook = Codebook.MCG
        else:
            codebook = Codebook.THREE_INST
        claims[key] = (entry.get("bits_per_weight"), codebook)
    return claims


def declared_disagreements(
    config: Mapping[str, Any] | None,
    quant_document: Mapping[str, Any] | None,
    specs: Mapping[str, Exl3ModuleSpec],
) -> list[str]:
    """Where config.json's quantization_config or quantization_config.json's
    tensor_storage describe the EXL3 modules differently from their tensors; each names
    the module."""
    out: list[str] = []
    block = text_config(config or {}).get("quantization_config") or (config or {}).get(
        "quantization_config"
    )
    if isinstance(block, Mapping):
        codebook = block.get("codebook")
        if isinstance(codebook, str):
            other = sorted(
                m for m, s in specs.items() if CODEBOOK_NAMES[s.codebook] != codebook
            )
            if other:
                found = sorted({CODEBOOK_NAMES[specs[m].codebook] for m in other})
                out.append(
                    f"{other[0]}: config.json quantization_config.codebook = "
                    f"{codebook!r}, but its tensors are {'/'.join(found)} "
                    f"({len(other)} modules: {listing(other)}); the tensors decide"
                )
        head = next((m for m in specs if m.rpartition(".")[2] == "lm_head"), None)
        head_bits = block.get("head_bits")
        if (
            head is not None
            and isinstance(head_bits, (int, float))
            and float(head_bits) != float(specs[head].bits)
        ):
            out.append(
                f"{head}: config.json quantization_config.head_bits = {head_bits}, but "
                f"{head}.trellis holds {specs[head].bits} bits; the tensors decide"
            )
        # ExLlamaV3's `bits` averages the main budget: the head and the MTP layers
        # have their own rates outside it.
        body = [
            s
            for m, s in specs.items()
            if m.rpartition(".")[2] != "lm_head"
            and not is_mtp_module(text_config(config or {}), m)
        ]
        bits = block.get("bits")
        if body and isinstance(bits, (int, float)):
            weights = sum(s.in_features * s.out_features for s in body)
            average = (
                sum(s.bits * s.in_features * s.out_features for s in body) / weights
            )
            if abs(average - float(bits)) > BITS_TOLERANCE and not math.isclose(
                average, float(bits)
            ):
                out.append(
                    f"config.json: quantization_config.bits = {bits}, but the EXL3 "
                    f"linears (lm_head excluded) average {average:.4f} bits per "
                    "weight; the tensors decide"
                )
    storage = (quant_document or {}).get("tensor_storage")
    if isinstance(storage, Mapping):
        claims = storage_claims(storage)
        for key in sorted(set(claims) & set(specs)):
            bits, codebook = claims[key]
            spec = specs[key]
            try:
                same_bits = float(bits) == float(spec.bits)
            except (TypeError, ValueError):
                same_bits = False
            if not same_bits or codebook != spec.codebook:
                out.append(
                    f"{key}: {QUANT_CONFIG_FILE} says {bits} bits, codebook "
                    f"{CODEBOOK_NAMES[codebook]}; its tensors say {spec.bits} bits, "
                    f"codebook {CODEBOOK_NAMES[spec.codebook]}; the tensors decide"
                )
        phantom = sorted(k for k in claims if k not in specs)
        if phantom:
            out.append(
                f"{phantom[0]}: {QUANT_CONFIG_FILE} lists it as EXL3 but no trellis is "
                f"stored ({len(phantom)} modules: {listing(phantom)}); the tensors "
                "decide (not EXL3)"
            )
        unlisted = sorted(k for k in specs if k not in storage)
        if unlisted:
            out.append(
                f"{unlisted[0]}: EXL3 in the tensors but missing from "
                f"{QUANT_CONFIG_FILE}'s tensor_storage ({len(unlisted)} modules: "
                f"{listing(unlisted)}); described from its tensors"
            )
    return out


# ---- values
# -----------------------------------------------------------------------------------


def check_scale_values(name: str, values: torch.Tensor, real: int | None) -> str | None:
    """The value rule for a `suh` or `svh` vector (`name` is the full tensor name;
    `real` how many leading entries are real rows/columns, the rest being 128-padding,
    None if unknown).

    Raises for NaN or inf anywhere (one would turn every output of the layer into NaN)
    and for a zero input scale on a real row (the quantizer never writes one: it drops
    that input). Returns a note for zero output scales on real columns: the format
    writes them for output channels whose weights are all zero, so they are legal, but
    such a column always yields 0.
    """
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten()
        first = int(bad[0])
        value = float(values[first])
        more = f" (and {len(bad) - 1} more non-finite values)" if len(bad) > 1 else ""
        raise Exl3FormatError(
            f"{name}: {value} at index {first}{more}: a non-finite scale makes every "
            "output of the layer NaN (damaged checkpoint)"
        )
    span = values if real is None else values[:real]
    zeros = (span == 0).nonzero().flatten()
    if not len(zeros):
        return None
    first = int(zeros[0])
    where = f"at index {first}" + (
        f" and {len(zeros) - 1} more" if len(zeros) > 1 else ""
    )
    if name.endswith(".suh"):
        raise Exl3FormatError(
            f"{name}: 0 {where}, on real input rows (of {len(span)}): a zero input "
            "scale drops that input, which the format never does (zeros belong only "
            "to 128-padding rows; damaged checkpoint)"
        )
    return (
        f"{name}: 0 {where}, on real output columns (of {len(span)}): those outputs "
        "are always 0 (legal only for all-zero output channels)"
    )


def value_problems(
    description: CheckpointDescription,
    real: Mapping[str, tuple[int | None, int | None]],
    *,
    scales: bool = True,
) -> tuple[list[str], list[str]]:
    """(problems, notes) from the data the verdict needs beyond the headers, per EXL3
    module in order: its codebook marker's value (format.check_marker) and, with
    `scales`, its suh and svh under `check_scale_values`. `real` maps a module to its
    real (k, n) where known; the rest of each vector is 128-padding."""
    problems: list[str] = []
    notes: list[str] = []
    root, tensors = description.root, description.tensors
    for prefix, spec in description.modules.items():
        names = []
        if spec.codebook != Codebook.THREE_INST:
            # A marker tensor is named after its codebook (P.mcg, P.mul1).
            names.append(f"{prefix}.{CODEBOOK_NAMES[spec.codebook]}")
        k, n = real.get(prefix, (None, None))
        counts = {f"{prefix}.suh": k, f"{prefix}.svh": n}
        if scales:
            names += [name for name in counts if name in spec.tensor_names]
        try:
            for name in names:
                values = read_tensor(root, name, tensors[name])
                if name in counts:
                    note = check_scale_values(name, values, counts[name])
                    if note:
                        notes.append(note)
                else:
                    check_marker(name, int(values.item()))
        except Exl3FormatError as e:
            problems.append(str(e))
    return problems, notes
