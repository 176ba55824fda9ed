# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every parameter an EXL3 checkpoint owns is written exactly once, or loading fails.

vLLM checks for unloaded parameters only when a model is not quantized, so a layer the
checkpoint does not cover would keep whatever its allocation held. One ledger per model
(per `Exl3Config`, so per rank) records each checkpoint tensor a layer receives: a
second write of the same tensor to the same layer fails at once, and after loading
every EXL3-owned or padding-owned layer checks that it received all it expects.

A model that received no checkpoint tensor at all was not loaded from a checkpoint
(`load_format="dummy"` fills parameters with random values without loaders); its layers
are not held to the rule.
"""

from collections.abc import Iterable

from .layout import Exl3LayoutError


class LoadLedger:
    """The tensors each layer of one model received. A layer is keyed by its owner
    object (its weights or its module): two layers built under one name stay apart."""

    def __init__(self) -> None:
        self._written: dict[int, set[str]] = {}
        self._owners: dict[int, object] = {}  # keeps each id() valid until checked
        self.started = False  # any checkpoint tensor reached any layer of this model

    def record(self, owner: object, layer: str, tensor: str) -> None:
        written = self._written.setdefault(id(owner), set())
        self._owners[id(owner)] = owner
        if tensor in written:
            raise Exl3LayoutError(
                f"EXL3 {layer}: {tensor} written twice (the checkpoint holds it twice, "
                "or two checkpoint names map to it)"
            )
        written.add(tensor)
        self.started = True

    def written(self, owner: object, tensor: str) -> bool:
        return tensor in self._written.get(id(owner), ())

    def check(
        self,
        owner: object,
        layer: str,
        expected: Iterable[str],
        rank: int | None = None,
    ) -> None:
        """After loading: every expected tensor of the layer was written (unless nothing
        in the model was); the layer's record is dropped."""
        written = self._written.pop(id(owner), set())
        self._owners.pop(id(owner), None)
        if not self.started:
            return
        missing = [t for t in expected if t not in written]
        if missing:
            where = f" (rank {rank})" if rank is not None else ""
            raise Exl3LayoutError(
                f"EXL3 {layer}{where}: checkpoint tensors never loaded: "
                f"{', '.join(missing)} (nothing in the checkpoint reached them; the "
                "layer would run on uninitialised memory)"
            )
