# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Exl3MoEMethod`: EXL3 routed experts on vLLM's RoutedExperts (legacy route: plain
`apply`).

ExLlamaV3 stores every expert projection as its own EXL3 linear
(`<experts>.<e>.{gate,up,down}_proj.{trellis,suh,svh[,mcg|mul1]}`), and bitrates may
differ between gate, up and down and between experts. The layer's local experts (E,
hidden h, per-rank expert width i_p, all multiples of 128) are held as:

* `w13_trellis` int16 [T13]: the gate and up trellises of every local expert back to
  back; expert e, role r (0 gate, 1 up) is the block [h/16, i_p/16, 16K] at
  `w13_meta[e, r, 0]`;
* `w13_meta` int64 [E, 2, 2]: (offset in elements, k2 = 2 * bits) per expert and role;
* `w13_suh` fp16 [E, 2, h]: input scales per expert and role;
* `w13_svh` fp16 [E, 2 * i_p]: output scales, gate columns then up columns;
* `w2_trellis` int16 [T2]: the down trellises, expert e the block [i_p/16, h/16, 16K] at
  `w2_meta[e, 0]`; `w2_meta` int64 [E, 2]: (offset, k2);
* `w2_suh` fp16 [E, i_p]; `w2_svh` fp16 [E, h].

The meta tables are non-persistent buffers (dummy-weight initialisation must not
randomise them); block offsets are multiples of `TRELLIS_OFFSET_ALIGN` elements. One
codebook per layer.

Tensor parallelism follows the dense rules (tp_rules.py): gate/up are column-parallel
(their n split), down row-parallel (its k split), so every rank's i_p must be a multiple
of 128. Expert parallelism uses vLLM's expert map: a rank allocates and loads only its
local experts.

Loading: every parameter carries this method's own loader (vLLM's
RoutedExperts.weight_loader knows neither the flat trellis nor the per-expert rates). It
maps the global expert id to the local one, checks the tensor against what the
checkpoint headers described, narrows it to this rank and writes its region, recording
the write: a region written twice, and after loading any region never written (a missing
expert), is an error naming the checkpoint tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import vllm.envs as envs
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
    FusedMoEMethodBase,
)
from vllm.model_executor.utils import set_weight_attrs

from .format import (
    DATA_SUFFIXES,
    EXL3_ONLY_SUFFIXES,
    HADAMARD_SIZE,
    IGNORED,
    LEGACY_SIGNS,
    MARKERS,
    TILE,
    Codebook,
    Exl3ModuleSpec,
    round_up,
    unpack_sign_bits,
)
from .layout import Exl3LayoutError
from .moe_kernels import (
    DOWN,
    GATE,
    K2_PER_BIT,
    TRELLIS_OFFSET_ALIGN,
    UP,
    Exl3MoEKernel,
    Exl3MoEKernelConfig,
    Exl3MoEWeights,
    backend_to_kernel_cls,
    block_words,
    select_exl3_moe_backend,
    tile_words,
)
from .names import strip_wrappers
from .tp_rules import row_split_error

logger = init_logger(__name__)

# The roles (GATE, UP, DOWN) for messages, and by vLLM's expert shard ids.
ROLE_NAMES = ("gate", "up", "down")
SHARD_ROLES = {"w1": GATE, "w3": UP, "w2": DOWN}


@dataclass(frozen=True)
class ExpertSpecs:
    """The checkpoint modules of one global expert, by role (gate, up, down)."""

    gate: Exl3ModuleSpec
    up: Exl3ModuleSpec
    down: Exl3ModuleSpec

    def role(self, r: int) -> Exl3ModuleSpec:
        return (self.gate, self.up, self.down)[r]


def _k2(spec: Exl3ModuleSpec) -> int:
    return int(spec.bits * K2_PER_BIT)


def plan_experts(
    prefix: str,
    keys: list[str],
    modules: Mapping[str, Exl3ModuleSpec],
    proj_names: tuple[str, str, str],
    num_experts: int,
    hidden: int,
    intermediate: int,
    claims: Mapping[str, tuple[float, Codebook]] | None = None,
) -> dict[int, ExpertSpecs]:
    """Validate the EXL3 checkpoint modules under a RoutedExperts prefix (`keys`, from
    the name resolver) and index them by global expert id.

    proj_names are the checkpoint's (gate, up, down) projection names
    (gate_proj/up_proj/ down_proj, or Mixtral's w1/w3/w2). Every expert must have all
    three, with ExLlamaV3's padded shapes, one codebook for the layer, no bias, and the
    bitrate `claims` (quantization_config.json tensor_storage) state where they state
    one.
    """
    role_of = {name: r for r, name in enumerate(proj_names)}
    pattern = re.compile(r"^(\d+)\.(" + "|".join(map(re.escape, proj_names)) + r")$")
    stripped = strip_wrappers(prefix) + "."
    found: dict[tuple[int, int], Exl3ModuleSpec] = {}
    for key in keys:
        tail = (
            key[len(prefix) + 1 :]
            if key.startswith(prefix + ".")
            else (strip_wrappers(key)[len(stripped) :])
        )
        m = pattern.match(tail)
        if m is None:
            raise Exl3LayoutError(
                f"EXL3 {key}.trellis: an EXL3 module under the routed experts {prefix} "
                "that is "
                f"not <expert>.{{{','.join(proj_names)}}} (fused-on-disk experts are "
                "not an "
                f"ExLlamaV3 layout)"
            )
        e, role = int(m.group(1)), role_of[m.group(2)]
        if e >= num_experts:
            raise Exl3LayoutError(
                f"EXL3 {key}.trellis: expert {e} does not exist (the model has "
                f"{num_experts} "
                f"routed experts)"
            )
        found[(e, role)] = modules[key]
    h_pad, i_pad = (
        round_up(hidden, HADAMARD_SIZE),
        round_up(intermediate, HADAMARD_SIZE),
    )
    experts: dict[int, ExpertSpecs] = {}
    codebooks: dict[Codebook, str] = {}
    for e in range(num_experts):
        specs = []
        for role, proj in enumerate(proj_names):
            spec = found.get((e, role))
            if spec is None:
                present = next(
                    (s.prefix for (ee, _), s in found.items() if ee == e), None
                )
                example = next(iter(found.values())).prefix.rsplit(".", 2)[0]
                raise Exl3LayoutError(
                    f"EXL3 {example}.{e}.{proj}.trellis: missing tensor (expert {e}'s "
                    f"{ROLE_NAMES[role]} projection is not an EXL3 module in the "
                    "checkpoint"
                    + (f"; {present} is" if present else "; the expert has none")
                    + ")"
                )
            k, n = (i_pad, h_pad) if role == DOWN else (h_pad, i_pad)
            if (spec.in_features, spec.out_features) != (k, n):
                raise Exl3LayoutError(
                    f"EXL3 {spec.prefix}.trellis: expert of shape "
                    f"k={spec.in_features}, "
                    f"n={spec.out_features}; the model's {ROLE_NAMES[role]} projection "
                    "is "
                    f"k={k}, n={n} (hidden {hidden}, expert width {intermediate}, "
                    "padded to "
                    f"{HADAMARD_SIZE})"
                )
            if spec.has_bias:
                raise Exl3LayoutError(
                    f"EXL3 {spec.prefix}.bias: expert projections with a bias are not "
                    f"supported"
                )
            claim = (claims or {}).get(spec.prefix)
            if (
                claim is not None
                and claim[0] is not None
                and float(claim[0]) != spec.bits
            ):
                raise Exl3LayoutError(
                    f"EXL3 {spec.prefix}.trellis: {spec.bits} bits per weight (trellis "
                    "width "
                    f"{int(spec.bits * TILE)}), but quantization_config.json claims "
                    f"{claim[0]} for this module"
                )
            codebooks.setdefault(spec.codebook, spec.prefix)
            specs.append(spec)
        experts[e] = ExpertSpecs(*specs)
    if len(codebooks) > 1:
        listing = ", ".join(f"{p} is {c.name}" for c, p in codebooks.items())
        raise Exl3LayoutError(
            f"EXL3 {prefix}: the experts of one layer mix codebooks ({listing}); one "
            "codebook "
            f"per MoE layer is supported"
        )
    return experts


class Exl3MoEParameter(torch.nn.Parameter):
    """Marks an EXL3 MoE parameter: its checkpoint suffix and role group (w13 / w2)."""


class Exl3MoEMethod(FusedMoEMethodBase):
    """EXL3 routed experts; `experts` are the checkpoint modules by global expert id."""

    # RoutedExperts.load_weights treats a tensor of this rank as all experts stacked; no
    # EXL3 tensor has 4 dims, so every EXL3 expert tensor loads as one expert (the 3-D
    # trellis too).
    fused_expert_weight_ndim = 4

    def __init__(
        self, moe: FusedMoEConfig, prefix: str, experts: dict[int, ExpertSpecs]
    ):
        super().__init__(moe)
        self.prefix = prefix
        self.experts = experts
        self.codebook = next(iter(experts.values())).gate.codebook
        self.kernel: Exl3MoEKernel
        # Set in create_weights: local -> global expert id, and the checkpoint suffixes
        # each (local expert, role) must load.
        self._local: dict[int, int] = {}
        self._expected: dict[tuple[int, int], set[str]] = {}
        self._written: dict[
            tuple[str, int, int], str
        ] = {}  # (target, local, role) -> name
        self._loaded_any = False

    # ---- sizes
    # ---------------------------------------------------------------------------

    def maybe_roundup_sizes(
        self,
        hidden_size,
        intermediate_size_per_partition,
        act_dtype,
        moe_parallel_config,
    ):
        hidden, width = super().maybe_roundup_sizes(
            hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config
        )
        if moe_parallel_config.tp_size == 1:
            # The format pads the expert width to the Hadamard block (svh = 0 on the
            # padding, so the padded columns are exactly zero); vLLM then sees the
            # padded width.
            width = round_up(width, HADAMARD_SIZE)
        return hidden, width

    # ---- weights
    # -------------------------------------------------------------------------

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        h, i_p = hidden_size, intermediate_size_per_partition
        tp_rank, tp_size = layer.moe_config.tp_rank, layer.moe_config.tp_size
        where = f"EXL3 {self.prefix} (rank {tp_rank} of {tp_size})"
        if h % HADAMARD_SIZE:
            raise Exl3LayoutError(
                f"{where}: hidden size {h} is not a multiple of {HADAMARD_SIZE}; EXL3 "
                "MoE "
                f"layers need whole Hadamard blocks on the expert input"
            )
        why = row_split_error(i_p, tp_size)
        if why is None and i_p % HADAMARD_SIZE:
            why = f"expert width {i_p} per rank is not a multiple of {HADAMARD_SIZE}"
        if why is not None:
            raise Exl3LayoutError(
                f"{where}: {why} (the down projections' k); expert parallelism "
                f"(--enable-expert-parallel) keeps every expert whole on one rank"
            )
        if layer.moe_config.activation.value != "silu":
            raise Exl3LayoutError(
                f"{where}: activation {layer.moe_config.activation.value!r}; EXL3 MoE "
                "supports "
                f"gated SiLU"
            )
        self.hidden, self.width, self.num_local = h, i_p, num_experts
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._local = {}
        for g in range(layer.global_num_experts):
            local = layer._map_global_expert_id_to_local_expert_id(g)
            if local >= 0:
                self._local[local] = g
        if sorted(self._local) != list(range(num_experts)):
            raise Exl3LayoutError(
                f"{where}: the expert map gives local experts {sorted(self._local)}, "
                "expected "
                f"0..{num_experts - 1}"
            )

        w13_meta = torch.zeros((num_experts, 2, 2), dtype=torch.int64)
        w2_meta = torch.zeros((num_experts, 2), dtype=torch.int64)
        t13 = t2 = 0
        for local in range(num_experts):
            specs = self.experts[self._local[local]]
            for role in (GATE, UP):
                k2 = _k2(specs.role(role))
                w13_meta[local, role] = torch.tensor([t13, k2])
                t13 += round_up(block_words(h, i_p, k2), TRELLIS_OFFSET_ALIGN)
            k2 = _k2(specs.down)
            w2_meta[local] = torch.tensor([t2, k2])
            t2 += round_up(block_words(i_p, h, k2), TRELLIS_OFFSET_ALIGN)
            for role in (GATE, UP, DOWN):
                self._expected[(local, role)] = set(specs.role(role).suffixes)
        self.w13_meta_cpu, self.w2_meta_cpu = w13_meta, w2_meta

        all_suffixes = (
            set().union(*self._expected.values()) if self._expected else set()
        )
        unknown = all_suffixes - set(EXL3_ONLY_SUFFIXES) - set(IGNORED)
        if unknown:
            raise Exl3LayoutError(
                f"{where}: checkpoint expert tensors with suffixes {sorted(unknown)} "
                "have no "
                f"place in an EXL3 MoE layer"
            )
        shapes = {
            "w13_trellis": ((t13,), torch.int16),
            "w13_suh": ((num_experts, 2, h), torch.float16),
            "w13_svh": ((num_experts, 2 * i_p), torch.float16),
            "w2_trellis": ((t2,), torch.int16),
            "w2_suh": ((num_experts, i_p), torch.float16),
            "w2_svh": ((num_experts, h), torch.float16),
        }
        # Loaded, checked, then dropped: codebook markers (one per expert and role) and
        # placeholders whose loads are consumed (legacy sign bitfields, ignored scales).
        for suffix in (*MARKERS, *LEGACY_SIGNS, *IGNORED):
            if suffix in all_suffixes:
                shapes[f"w13_{suffix}"] = ((0,), torch.int32)
                shapes[f"w2_{suffix}"] = ((0,), torch.int32)
        self._markers: dict[tuple[int, int], int] = {}
        loader = self._weight_loader(layer)
        for name, (shape, dtype) in shapes.items():
            # Zeros, not empty: a region nothing is loaded into must contribute nothing.
            param = Exl3MoEParameter(
                torch.zeros(shape, dtype=dtype), requires_grad=False
            )
            layer.register_parameter(name, param)
            set_weight_attrs(
                param, {"weight_loader": loader, "exl3_suffix": name.partition("_")[2]}
            )
        device = layer.w13_trellis.device
        layer.register_buffer("w13_meta", w13_meta.to(device), persistent=False)
        layer.register_buffer("w2_meta", w2_meta.to(device), persistent=False)

    def _tensor_name(self, local: int, role: int, suffix: str) -> str:
        return f"{self.experts[self._local[local]].role(role).prefix}.{suffix}"

    def _weight_loader(self, layer: torch.nn.Module) -> Callable:
        def load(
            param: torch.nn.Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> bool | None:
            local = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if local < 0:
                return False if return_success else None
            if shard_id not in SHARD_ROLES:
                raise Exl3LayoutError(
                    f"EXL3 {weight_name}: shard id {shard_id!r}, expected w1, w2 or w3"
                )
            self._load(
                layer, param.exl3_suffix, loaded_weight, local, SHARD_ROLES[shard_id]
            )
            return True if return_success else None

        return load

    def _load(
        self,
        layer: torch.nn.Module,
        suffix: str,
        loaded: torch.Tensor,
        local: int,
        role: int,
    ) -> None:
        name = self._tensor_name(local, role, suffix)
        where = f"EXL3 {name} -> {self.prefix} (rank {self.tp_rank})"
        if suffix not in self._expected[(local, role)]:
            raise Exl3LayoutError(
                f"{where}: tensor not listed in the checkpoint's safetensors "
                f"headers for this expert"
            )
        self._loaded_any = True
        spec = self.experts[self._local[local]].role(role)
        if suffix in MARKERS:
            if loaded.numel() != 1 or loaded.dtype != torch.int32:
                raise Exl3LayoutError(
                    f"{where}: marker must be one int32, got shape "
                    f"{list(loaded.shape)} {loaded.dtype}"
                )
            self._claim(where, suffix, local, role, name)
            self._markers[(local, role)] = int(loaded.reshape(()).item())
            return
        if suffix in IGNORED:
            self._claim(where, suffix, local, role, name)
            return
        if suffix in LEGACY_SIGNS:
            full = LEGACY_SIGNS[suffix]
            length = spec.in_features if full == "suh" else spec.out_features
            self._check(where, loaded, torch.int16, (length // TILE,))
            if full in self._expected[(local, role)]:
                # The fp16 tensor is present and takes precedence (format.py warned).
                self._claim(where, suffix, local, role, name)
                return
            suffix, loaded = full, unpack_sign_bits(loaded)
        self._claim(where, suffix, local, role, name)
        i_p, r = self.width, self.tp_rank
        if suffix == "trellis":
            words = tile_words(_k2(spec))
            self._check(
                where,
                loaded,
                torch.int16,
                (spec.in_features // TILE, spec.out_features // TILE, words),
            )
            if role == DOWN:
                src = loaded.narrow(0, r * i_p // TILE, i_p // TILE)
                offset, _ = self.w2_meta_cpu[local].tolist()
                flat = layer.w2_trellis.data
            else:
                src = loaded.narrow(1, r * i_p // TILE, i_p // TILE)
                offset, _ = self.w13_meta_cpu[local, role].tolist()
                flat = layer.w13_trellis.data
            flat[offset : offset + src.numel()].view(src.shape).copy_(src)
            return
        length = spec.in_features if suffix == "suh" else spec.out_features
        self._check(where, loaded, torch.float16, (length,))
        if role == DOWN:
            if suffix == "suh":
                layer.w2_suh.data[local].copy_(loaded.narrow(0, r * i_p, i_p))
            else:
                layer.w2_svh.data[local].copy_(loaded)
        elif suffix == "suh":
            layer.w13_suh.data[local, role].copy_(loaded)
        else:
            layer.w13_svh.data[local, role * i_p : (role + 1) * i_p].copy_(
                loaded.narrow(0, r * i_p, i_p)
            )

    def _claim(self, where: str, target: str, local: int, role: int, name: str) -> None:
        key = (target, local, role)
        if key in self._written:
            raise Exl3LayoutError(
                f"{where}: region already written by {self._written[key]} "
                f"(a checkpoint tensor loaded twice)"
            )
        self._written[key] = name

    @staticmethod
    def _check(
        where: str, loaded: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> None:
        if loaded.dtype != dtype or tuple(loaded.shape) != shape:
            raise Exl3LayoutError(
                f"{where}: got {list(loaded.shape)} {loaded.dtype}, the "
                f"headers describe {list(shape)} {dtype}"
            )

    # ---- after loading
    # -------------------------------------------------------------------

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not self._loaded_any:
            # Nothing came from a checkpoint: load_format="dummy" (random-weight perf
            # runs).
            logger.debug(
                "EXL3 %s: no checkpoint tensors loaded (dummy weights)", self.prefix
            )
        else:
            self._check_complete()
        for name in list(dict(layer.named_parameters(recurse=False))):
            if isinstance(getattr(layer, name), Exl3MoEParameter):
                data = getattr(layer, name).data
                delattr(layer, name)
                if name.partition("_")[2] in DATA_SUFFIXES:
                    layer.register_parameter(
                        name, torch.nn.Parameter(data, requires_grad=False)
                    )
        self._written = {}
        self._markers = {}
        bits = sorted(
            {
                self.experts[g].role(r).bits
                for g in self._local.values()
                for r in (GATE, UP, DOWN)
            }
        )
        backend, reason = select_exl3_moe_backend(
            Exl3MoEKernelConfig(
                self.prefix,
                layer.w13_trellis.device,
                layer.params_dtype,
                layer.moe_config.activation.value,
                int(self.codebook),
                tuple(bits),
            )
        )
        logger.debug("EXL3 %s: %s MoE backend (%s)", self.prefix, backend.value, reason)
        self.kernel = backend_to_kernel_cls(backend)()
        self.kernel.prepare(self.weights(layer), layer.params_dtype)

    def _check_complete(self) -> None:
        missing = []
        for (local, role), expected in sorted(self._expected.items()):
            for suffix in sorted(expected):
                # A legacy bitfield without its fp16 tensor was written as that tensor.
                full = LEGACY_SIGNS.get(suffix)
                target = full if full is not None and full not in expected else suffix
                if (target, local, role) not in self._written:
                    missing.append(self._tensor_name(local, role, suffix))
        if missing:
            shown = ", ".join(missing[:8]) + (
                f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            )
            raise Exl3LayoutError(
                f"EXL3 {self.prefix} (rank {self.tp_rank}): checkpoint tensors never "
                "loaded: "
                f"{shown}"
            )
        for (local, role), value in sorted(self._markers.items()):
            spec = self.experts[self._local[local]].role(role)
            marker = next(s for s in spec.suffixes if s in MARKERS)
            codebook, expected = MARKERS[marker]
            if value != expected or codebook != spec.codebook:
                raise Exl3LayoutError(
                    f"EXL3 {spec.prefix}.{marker} (rank {self.tp_rank}): marker value "
                    f"{value}, "
                    f"expected {expected} for the {codebook.name} codebook"
                )

    # ---- forward
    # -------------------------------------------------------------------------

    def get_fused_moe_quant_config(
        self, layer: torch.nn.Module
    ) -> FusedMoEQuantConfig | None:
        # Plain TP / EP through `apply`; no all-to-all prepare/finalize kernels.
        return None

    def weights(self, layer: torch.nn.Module) -> Exl3MoEWeights:
        return Exl3MoEWeights(
            layer.w13_trellis,
            layer.w13_meta,
            layer.w13_suh,
            layer.w13_svh,
            layer.w2_trellis,
            layer.w2_meta,
            layer.w2_suh,
            layer.w2_svh,
            self.num_local,
            self.hidden,
            self.width,
        )

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts,
        shared_experts_input,
    ) -> torch.Tensor:
        return self.kernel.apply(
            x,
            topk_weights,
            topk_ids,
            self.weights(layer),
            activation=layer.activation.value,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            expert_map=layer.expert_map,
            global_num_experts=layer.global_num_experts,
            codebook=int(self.codebook),
            deterministic=bool(
                envs.VLLM_EXL3_DETERMINISTIC or envs.VLLM_BATCH_INVARIANT
            ),
        )
