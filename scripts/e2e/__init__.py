# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The end-to-end runs through vLLM's engine (`vllm_exl3.e2e`), run as scripts or with
`python -m`; README.md here holds their current results."""
