# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The EXL3 codec (format reader and reference decoder), the loader's placement rules
(tp_rules, layout) and the plan tables' keys (plan_table) for the tools.

The tools read the overlay sources of this repository, not an installed vLLM: the
overlay `exl3` directory is imported as a private package under its own name, so this
works whether or not vLLM (patched or not) is installed, and never imports vLLM itself
(the package's `__init__` is lazy).

Failures raise ImportError, so the CLI lists a subcommand that cannot work here as
unavailable (with this message) instead of failing as a whole.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

# scripts/vllm_exl3/codec.py -> repository root is two directories above this package.
EXL3_DIR = (
    Path(__file__).resolve().parents[2]
    / "overlay"
    / "vllm"
    / "model_executor"
    / "layers"
    / "quantization"
    / "exl3"
)
# A name no real package uses, so the overlay copy never collides with vllm's own
# module.
PRIVATE_PACKAGE = "_vllm_exl3_overlay_codec"


def _load_package() -> ModuleType:
    package = sys.modules.get(PRIVATE_PACKAGE)
    if package is not None:
        return package
    init = EXL3_DIR / "__init__.py"
    if not init.is_file():
        raise ImportError(
            f"EXL3 codec sources not found at {EXL3_DIR} (incomplete checkout?)"
        )
    spec = importlib.util.spec_from_file_location(
        PRIVATE_PACKAGE, init, submodule_search_locations=[str(EXL3_DIR)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_PACKAGE] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[PRIVATE_PACKAGE]
        raise
    return package


def _submodule(name: str) -> ModuleType:
    _load_package()
    try:
        return importlib.import_module(f"{PRIVATE_PACKAGE}.{name}")
    except ImportError as e:
        raise ImportError(
            f"cannot import the EXL3 codec ({name}.py): {e} (is torch installed?)"
        ) from e


exl3_format = _submodule("format")
checkpoint = _submodule("checkpoint")
reference = _submodule("reference")
embedding_reference = _submodule("embedding_reference")
tp_rules = _submodule("tp_rules")
layout = _submodule("layout")
plan_table = _submodule("plan_table")
