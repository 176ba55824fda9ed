# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vllm-exl3 command-line tool: fetch, apply, build and bundle the pinned vLLM with the
EXL3 series.

One module per subcommand (each exposes `register(subparsers)`), plus modules named by
the role they serve the subcommands: `pins` (what is pinned), `repo` (this repository's
layout), `index` (the package-index client), `patchfile` (format-patch parsing), `tree`
(recognising a vLLM tree), `series` (planning an application), `state` (what an
application recorded), `wheelfile` (wheel archives).
"""
