# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vllm-exl3 command-line tool: fetch, apply, build and bundle the pinned vLLM with the
EXL3 series.

One module per subcommand (each exposes `register(subparsers)`), plus modules named by
the role they serve the subcommands: `repo` (the series: what it is pinned to, where its
files live and land, the vLLM trees it applies onto) and `series` (reading the patches
and planning an application, and the record of what one did to a tree). `fetch` also
holds the package-index client and the progress lines of long steps; `build` reads and
writes wheel archives.
"""


class ToolError(Exception):
    """A failure the user can act on; the message says what happened and what to do.
    The CLI turns it into a message and a non-zero exit (no traceback)."""
