# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmarks (`vllm_exl3.bench`), run as scripts or with `python -m`; README.md
here holds their current results."""
