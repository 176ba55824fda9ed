# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Entry point: one argparse subcommand per module. Modules written by other parts of
the project (the checkpoint tools) are imported tolerantly, so the tool works while one
is missing, and a module that cannot be imported here (e.g. it needs torch under the
system python) still shows up and explains why when called."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import traceback

from . import ToolError

# Subcommand modules, in --help order.
SUBCOMMAND_MODULES = (
    "fetch",
    "apply",
    "patches",
    "upstream",
    "build",
    "bundle",
    "image",
    "inspect_ckpt",
    "dequantize",
)
DEBUG_FLAG = "--debug"
# Subcommand -> module, so a command imports only its own module (the checkpoint tools
# import torch, which would add seconds to every `apply`). --help and unknown names
# import all.
_MODULE_OF = {
    "dev-tree": "patches",
    "export-patches": "patches",
    "inspect": "inspect_ckpt",
    "series": "upstream",
}


def _unavailable(name: str, error: BaseException):
    def run(_args: argparse.Namespace) -> int:
        raise ToolError(f"subcommand module {name!r} cannot be imported here: {error}")

    return run


def build_parser(
    modules: tuple[str, ...] = SUBCOMMAND_MODULES,
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-exl3",
        description="EXL3 for vLLM 0.26.0: fetch the pinned vLLM, apply or revert the "
        "patch "
        "series and overlay, build a wheel, bundle it for an offline host, inspect "
        "checkpoints.",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an error, show the Python traceback too (anywhere on the line)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in modules:
        qualified = f"{__package__}.{name}"
        if importlib.util.find_spec(qualified) is None:
            continue  # not written yet
        try:
            module = importlib.import_module(qualified)
        except ImportError as e:
            p = sub.add_parser(name.replace("_ckpt", ""), help=f"(unavailable: {e})")
            p.set_defaults(func=_unavailable(name, e))
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Accepted before or after the subcommand's own arguments.
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    if command in _MODULE_OF:
        modules: tuple[str, ...] = (_MODULE_OF[command],)
    elif command in SUBCOMMAND_MODULES and command not in _MODULE_OF.values():
        modules = (command,)
    else:
        modules = SUBCOMMAND_MODULES
    args = build_parser(modules).parse_args(argv)
    try:
        return args.func(args)
    except (ToolError, OSError) as e:
        # A user's error (or the machine's): one line naming what and why; the
        # traceback only on request.
        if debug:
            traceback.print_exc()
        print(f"vllm-exl3 {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"vllm-exl3 {args.command}: interrupted", file=sys.stderr)
        return 130
