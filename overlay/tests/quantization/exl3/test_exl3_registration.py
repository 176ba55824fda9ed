# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What patches 0001 and 0002 do to vLLM: the exl3 method is registered, and every
VLLM_EXL3_* variable is registered with a getter that works unset and parses set values;
logging and warm-up variables stay out of the torch.compile cache key. Each probe is a
fresh interpreter, since vLLM reads the variables when envs.py is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

NAMES = (
    "VLLM_EXL3_DETERMINISTIC",
    "VLLM_EXL3_PLAN",
    "VLLM_EXL3_TUNE",
    "VLLM_EXL3_LOG_PLANS",
    "VLLM_EXL3_DEBUG_NAMES",
    "VLLM_EXL3_FORCE_REFERENCE",
    "VLLM_EXL3_WARMUP",
)
PROBE = """
import json
import vllm.envs as envs
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
names = [n for n in envs.environment_variables if n.startswith("VLLM_EXL3_")]
print(json.dumps({
    "names": names,
    "values": {n: envs.environment_variables[n]() for n in names},
    "factors": sorted(n for n in envs.compile_factors() if n.startswith("VLLM_EXL3_")),
    "exl3_registered": "exl3" in QUANTIZATION_METHODS,
}))
"""


def _probe(extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if "EXL3_" not in k}
    r = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={**env, **extra_env},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unset() -> dict:
    return _probe({})


def test_registered(unset):
    assert unset["exl3_registered"]
    assert sorted(unset["names"]) == sorted(NAMES)


def test_getters_unset_give_defaults(unset):
    assert unset["values"] == {
        "VLLM_EXL3_DETERMINISTIC": False,
        "VLLM_EXL3_PLAN": None,
        "VLLM_EXL3_TUNE": False,
        "VLLM_EXL3_LOG_PLANS": False,
        "VLLM_EXL3_DEBUG_NAMES": False,
        "VLLM_EXL3_FORCE_REFERENCE": False,
        "VLLM_EXL3_WARMUP": True,
    }


def test_getters_parse_set_values(unset):
    out = _probe(
        {
            "VLLM_EXL3_DETERMINISTIC": "1",
            "VLLM_EXL3_PLAN": "bm=64,split_k=4",
            "VLLM_EXL3_TUNE": "1",
            "VLLM_EXL3_LOG_PLANS": "1",
            "VLLM_EXL3_DEBUG_NAMES": "1",
            "VLLM_EXL3_FORCE_REFERENCE": "1",
            "VLLM_EXL3_WARMUP": "0",
        }
    )
    assert out["values"] == {
        "VLLM_EXL3_DETERMINISTIC": True,
        "VLLM_EXL3_PLAN": "bm=64,split_k=4",
        "VLLM_EXL3_TUNE": True,
        "VLLM_EXL3_LOG_PLANS": True,
        "VLLM_EXL3_DEBUG_NAMES": True,
        "VLLM_EXL3_FORCE_REFERENCE": True,
        "VLLM_EXL3_WARMUP": False,
    }


def test_compile_cache_key(unset):
    assert unset["factors"] == sorted(
        set(NAMES)
        - {"VLLM_EXL3_DEBUG_NAMES", "VLLM_EXL3_LOG_PLANS", "VLLM_EXL3_WARMUP"}
    )
