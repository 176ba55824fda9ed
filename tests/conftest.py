# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tests of the vllm-exl3 tool itself. None of them imports vLLM: the tests of
vLLM's code paths live under overlay/tests/ and run in vLLM's own test tree
(ci/test_vllm_harness.sh), so an import of vLLM here fails at once, naming the
module."""

from __future__ import annotations

import importlib.abc
import sys


class _RefuseVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(
                f"a test of the vllm-exl3 tool imported {name}; tests of vLLM's code "
                "paths belong under overlay/tests/"
            )
        return None


sys.meta_path.insert(0, _RefuseVllm())
