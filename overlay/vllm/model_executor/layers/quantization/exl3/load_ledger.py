# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every parameter an EXL3 checkpoint owns is written exactly once, or loading fails.

vLLM checks for unloaded parameters only when a model is not quantized, so a layer the
checkpoint does not cover would keep whatever its allocation held. One ledger per model
(per
`Exl3Config`, so per rank) records each checkpoint tensor a layer receives: a second
write of the same tensor fails at once, and after loading every EXL3-owned or
padding-owned layer checks it received all it expects.

A model that received no checkpoint tensor at all was not loaded from a checkpoint
(`load_format="dummy"` fills parameters with random values without loaders); its layers
are not held to the rule.
"""

from collections.abc import Iterable

from .layout import Exl3LayoutError


class LoadLedger:
    """Which tensors the layers of one model received, by (layer, tensor)."""

    def __init__(self) -> None:
        self._written: set[tuple[str, str]] = set()

    @property
    def started(self) -> bool:
        """Whether any checkpoint tensor reached any layer of this model."""
        return bool(self._written)

    def record(self, layer: str, tensor: str) -> None:
        key = (layer, tensor)
        if key in self._written:
            raise Exl3LayoutError(
                f"EXL3 {layer}: {tensor} written twice (the checkpoint holds it twice, "
                "or two "
                f"checkpoint names map to it)"
            )
        self._written.add(key)

    def written(self, layer: str, tensor: str) -> bool:
        return (layer, tensor) in self._written

    def check(
        self, layer: str, expected: Iterable[str], rank: int | None = None
    ) -> None:
        """After loading: every expected tensor of `layer` was written (unless nothing
        was)."""
        if not self.started:
            return
        missing = [t for t in expected if (layer, t) not in self._written]
        if missing:
            where = f" (rank {rank})" if rank is not None else ""
            raise Exl3LayoutError(
                f"EXL3 {layer}{where}: checkpoint tensors never loaded: "
                f"{', '.join(missing)} "
                f"(nothing in the checkpoint reached them; the layer would run on "
                f"uninitialised memory)"
            )
