# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the test suites and the benchmark and end-to-end scripts share: where the
fixture checkpoints are (`fixtures`), the synthetic checkpoint writer
(`synthetic_checkpoint`), the damaged-checkpoint generator (`damage`), the GPU kernels'
float64 oracle (`exl3_oracle`) and the qwen3-tiny fixture model (`qwen3_tiny`).

Installed with the tool (`pip install -e .` from the repository root; ci/test.sh does
it), so tests in vLLM's tree and scripts import it by name."""
