# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The three readers of a checkpoint, each run the way a user runs it, reduced to an
outcome.

* `inspect --values` and `dequantize` through the CLI entry point (`vllm_exl3.cli.main`,
in this
  process: the exit code, stdout and stderr are what the command prints);
* vLLM: `ModelConfig` + `VllmConfig` (which calls `Exl3Config.maybe_update_config`) and
the real
  `DefaultModelLoader.load_model` on the CPU, which builds the model, streams the
  safetensors through the model's `load_weights` and runs
  `process_weights_after_loading`. Nothing is run forward: loading is the path under
  test.

As a script (`python tests/validation/three_paths.py [OUT.md]`), writes the table of
every case in damage.py and the message each path gives.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CPU_ATTENTION_BACKEND = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
EXL3_LOGGER = "vllm.model_executor.layers.quantization.exl3"
CLI_ERROR = "error: "
CLI_WARNING = "warning: "


@dataclass
class Outcome:
    failed: bool
    message: str  # the error (one line for the tools), or "" when it succeeded
    warnings: str  # what it warned about (tool stderr / stdout notes, vLLM's EXL3 log)
    crashed: bool = False  # an exception type no user error should produce
    tool_output: str = ""  # everything the tool printed

    def text(self) -> str:
        return self.message or self.warnings


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from vllm_exl3.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


def _tool_outcome(rc: int, out: str, err: str) -> Outcome:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [
        line for line in lines if CLI_ERROR in line and line.startswith("vllm-exl3 ")
    ]
    warnings = [line for line in lines if line.startswith(CLI_WARNING)]
    crashed = "Traceback" in err or (rc != 0 and not errors)
    return Outcome(
        rc != 0, errors[-1] if errors else "", "\n".join(warnings), crashed, out + err
    )


def run_inspect(ckpt: Path) -> Outcome:
    rc, out, err = _cli(["inspect", "--values", str(ckpt)])
    outcome = _tool_outcome(rc, out, err)
    # inspect reports disagreements and notes in its report, not as warnings on stderr.
    report = (
        out.split("\ndisagreements:\n", 1)[-1] if "\ndisagreements:\n" in out else ""
    )
    notes = out.split("\nnotes:\n", 1)[-1] if "\nnotes:\n" in out else ""
    outcome.warnings = "\n".join(x for x in (outcome.warnings, report, notes) if x)
    return outcome


def run_dequantize(ckpt: Path, out_dir: Path) -> Outcome:
    rc, out, err = _cli(["dequantize", "--quiet", str(ckpt), str(out_dir)])
    return _tool_outcome(rc, out, err)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_vllm(ckpt: Path) -> Outcome:
    """vLLM's loader on the CPU, in the current vLLM world (TP from the distributed
    state)."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    import torch

    # vLLM's set_default_torch_dtype does not restore the default when loading raises.
    default_dtype = torch.get_default_dtype()
    records, logger = _Records(), logging.getLogger(EXL3_LOGGER)
    logger.addHandler(records)
    backend = current_platform.get_attn_backend_cls
    # vLLM's attention kernels do not exist without a GPU; the backend class is only
    # needed to construct the layers.
    current_platform.get_attn_backend_cls = lambda *args, **kwargs: (
        CPU_ATTENTION_BACKEND
    )
    try:
        model_config = ModelConfig(model=str(ckpt), dtype="bfloat16")
        vllm_config = VllmConfig(
            model_config=model_config, device_config=DeviceConfig("cpu")
        )
        get_model_loader(vllm_config.load_config).load_model(
            vllm_config=vllm_config, model_config=model_config
        )
    except (
        MemoryError,
        RecursionError,
        AssertionError,
        KeyError,
        IndexError,
        TypeError,
        AttributeError,
        UnicodeDecodeError,
    ) as e:
        return Outcome(True, f"{type(e).__name__}: {e}", "\n".join(records.lines), True)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return Outcome(True, f"{type(e).__name__}: {e}", "\n".join(records.lines))
    finally:
        torch.set_default_dtype(default_dtype)
        current_platform.get_attn_backend_cls = backend
        logger.removeHandler(records)
    return Outcome(False, "", "\n".join(records.lines))


def run_all(ckpt: Path, scratch: Path) -> dict[str, Outcome]:
    return {
        "inspect": run_inspect(ckpt),
        "dequantize": run_dequantize(ckpt, scratch / f"{ckpt.name}-dequantized"),
        "vllm": run_vllm(ckpt),
    }


def _cell(outcome: Outcome, root: str) -> str:
    """The message as a table cell: first line, the tool's prefix, pydantic's wrapper
    around VllmConfig's ValueError, the exception type and the temporary directory taken
    off."""
    text = outcome.text()
    if not text:
        return "loads"
    if "Value error, " in text:
        text = text.split("Value error, ", 1)[1].split(" [type=value_error", 1)[0]
    text = text.splitlines()[0].strip().removeprefix("- ")
    for prefix in (
        "vllm-exl3 inspect: error: ",
        "vllm-exl3 dequantize: error: ",
        "warning: ",
    ):
        text = text.removeprefix(prefix)
    head, sep, rest = text.partition(": ")
    if sep and head.isidentifier() and head[0].isupper():  # "Exl3LayoutError: ..."
        text = rest
    text = text.replace(f"EXL3 checkpoint {root}/", "EXL3 checkpoint ").replace(
        f"{root}/", ""
    )
    return text.replace("|", "\\|")


def table() -> str:
    """Markdown: case -> the message of each path (one message where the three
    agree)."""
    from damage import CASES

    lines = ["| case | class | verdict | message |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            ckpt = case.make(Path(tmp))
            cells = {
                path: _cell(o, tmp) for path, o in run_all(ckpt, Path(tmp)).items()
            }
            if len(set(cells.values())) == 1:
                shown = cells["inspect"]
            else:
                shown = "<br>".join(f"{path}: {cell}" for path, cell in cells.items())
            lines.append(
                f"| {case.id} | {case.kind} | {case.expect.verdict} | {shown} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    repo = here.parents[1]
    for path in (
        here,
        repo / "scripts",
        repo / "tests",
        repo / "tests" / "integration",
    ):
        sys.path.insert(0, str(path))
    from exl3_harness import gloo_world

    with tempfile.TemporaryDirectory() as tmp, gloo_world(1, 0, f"{tmp}/init"):
        text = table()
    # vLLM logs to stdout; the table goes to the named file when one is given.
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    else:
        print(text)
