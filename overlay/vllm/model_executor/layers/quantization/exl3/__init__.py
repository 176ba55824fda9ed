# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EXL3 (ExLlamaV3 trellis quantization) for vLLM.

vLLM imports every quantization config whenever it resolves a method name, so this
package must be cheap to import: nothing here touches CUDA, and the config (which
imports vLLM's layer classes) is loaded only when asked for. `format` and `reference`
import only torch, so tools outside vLLM (scripts/vllm-exl3) can load them on their own.
"""

__all__ = ["Exl3Config"]


def __getattr__(name: str):
    if name == "Exl3Config":
        # Lazy: the config imports vLLM's layers, and the tools load this package
        # without vLLM (the module docstring).
        from .config import Exl3Config

        return Exl3Config
    raise AttributeError(name)
