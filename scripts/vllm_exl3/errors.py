# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one error type the CLI turns into a message and non-zero exit (no traceback)."""


class ToolError(Exception):
    """A failure the user can act on; the message says what happened and what to do."""
