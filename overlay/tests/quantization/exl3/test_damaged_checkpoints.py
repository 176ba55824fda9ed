# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The damaged-checkpoint corpus (damage.py) through the three readers of a checkpoint,
each run the way a user runs it (`inspect --values`, `dequantize`, vLLM's real loader on
the CPU): the same verdict from each and a message naming the file and the rule; the
tools' messages in a new process (one line on stderr, exit code 1, no traceback unless
`--debug`); and the load ledger (every parameter of every EXL3-owned and padding-owned
layer written exactly once, at TP=1 and TP=2).
"""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from vllm_exl3.testing.damage import (
    BASE,
    CASES,
    ERROR,
    LOADS,
    PATHS,
    WARNING,
    copy_of,
    edit_json,
    save,
    sharded,
    tensors_of,
)

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


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory: pytest.TempPathFactory):
    """vLLM's distributed state on the CPU at TP=1, one world of size 1 over gloo; the
    integration tests' session world is reused when it already exists (vLLM holds one
    per process)."""
    from vllm.distributed import parallel_state

    from .exl3_harness import gloo_world

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    with gloo_world(1, 0, str(tmp_path_factory.mktemp("dist") / "init")):
        yield


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
    import torch
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

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
    from vllm_exl3.testing.damage import CASES

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


# python -m tests.quantization.exl3.test_damaged_checkpoints [OUT.md], from the root of
# a vLLM tree holding these tests, prints the table of every case's messages.
if __name__ == "__main__":
    from .exl3_harness import gloo_world

    with tempfile.TemporaryDirectory() as tmp, gloo_world(1, 0, f"{tmp}/init"):
        text = table()
    # vLLM logs to stdout; the table goes to the named file when one is given.
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    else:
        print(text)


# Every case of damage.py through the three readers of a checkpoint (`inspect --values`,
# `dequantize`, vLLM's real loader on the CPU): the same verdict from each, a message
# that names the file or tensor and the rule, and never a crash (a traceback, a
# MemoryError, a KeyError...). Valid but unusual checkpoints load everywhere without a
# word.

# The bar for the corpus: at least this many cases across every class of damage.
MIN_CASES = 40
CLASSES = (
    "file",
    "json",
    "shards",
    "config",
    "declared",
    "values",
    "module",
    "unusual",
)


def test_the_corpus_covers_every_class():
    kinds = Counter(case.kind for case in CASES)
    assert len(CASES) >= MIN_CASES
    assert set(kinds) == set(CLASSES), kinds
    assert len({case.id for case in CASES}) == len(CASES)
    for (
        case
    ) in CASES:  # every error and warning is checked for what it says, on every path
        if case.expect.verdict != LOADS:
            assert all(case.expect.phrases(path) for path in PATHS), case.id


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_three_paths_give_the_same_named_verdict(case, tmp_path, vllm_world):
    ckpt = case.make(tmp_path)
    outcomes = run_all(ckpt, tmp_path)
    for path in PATHS:
        outcome = outcomes[path]
        where = f"{case.id} through {path}: {outcome.message or outcome.warnings}"
        assert not outcome.crashed, f"{where}\n{outcome.tool_output}"
        if case.expect.verdict == ERROR:
            assert outcome.failed, (
                f"{case.id} through {path}: accepted\n{outcome.tool_output}"
            )
            text = outcome.message
            if (
                path != "vllm"
            ):  # the tools: exactly one line on stderr names the problem
                assert len(text.splitlines()) == 1, where
        else:
            assert not outcome.failed, where
            text = outcome.warnings
        for phrase in case.expect.phrases(path):
            assert phrase in text, f"{where}\n  missing: {phrase!r}"
        if case.expect.verdict == LOADS:
            assert outcome.warnings == "" or path == "inspect", where
        if case.expect.verdict == WARNING:
            assert text, where


def test_gated_attention_q_proj_width():
    """Qwen3-Next's q_proj also carries the output gate (vLLM's default), unless
    config.json turns the gate off; other models' q_proj is the query alone."""
    from vllm.model_executor.layers.quantization.exl3.checkpoint import implied_dims

    cfg = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    q = "model.layers.0.self_attn.q_proj"
    o = "model.layers.0.self_attn.o_proj"
    assert implied_dims({**cfg, "model_type": "qwen3_next"}, q)[:2] == (256, 512)
    assert implied_dims({**cfg, "model_type": "qwen3_next"}, o)[:2] == (256, 256)
    off = {**cfg, "model_type": "qwen3_next", "attn_output_gate": False}
    assert implied_dims(off, q)[:2] == (256, 256)
    assert implied_dims({**cfg, "model_type": "qwen3"}, q)[:2] == (256, 256)


def test_dsa_mtp_layer_left_out_of_the_conversion(tmp_path):
    """ExLlamaV3 converts a DSA model without its MTP layer unless one is added, and
    keeps num_nextn_predict_layers in config.json: that loads (without a draft); a
    stored MTP layer needs its indexer like any layer vLLM builds one for."""
    import json

    from vllm.model_executor.layers.quantization.exl3.checkpoint import (
        Exl3FormatError,
        validate_checkpoint,
    )
    from vllm_exl3.testing import synthetic_checkpoint as synth

    bare = tmp_path / "bare"
    synth.write_checkpoint("deepseek-v32-tiny", bare, bits=3, layers=2, mtp=False)
    edit_json(bare / "config.json", lambda c: c.update(num_nextn_predict_layers=1))
    assert validate_checkpoint(bare).modules
    full = tmp_path / "mtp"
    synth.write_checkpoint("deepseek-v32-tiny", full, bits=3, layers=2)
    assert json.loads((full / "config.json").read_text())["num_nextn_predict_layers"]
    assert "model.layers.2.self_attn.indexer.wq_b" in validate_checkpoint(full).modules
    named = tensors_of(full)
    for name in [n for n in named if n.startswith("model.layers.2.self_attn.indexer.")]:
        del named[name]
    save(full, named)
    with pytest.raises(
        Exl3FormatError, match=r"layers\.2\.self_attn\.indexer\.wq_b: miss"
    ):
        validate_checkpoint(full)


# The tools as a user runs them (a new process): a damaged checkpoint gives one line on
# stderr naming the file and the rule, exit code 1 and no traceback; `--debug` adds the
# traceback.

from vllm_exl3.testing.fixtures import CLI  # noqa: E402

BY_ID = {case.id: case for case in CASES}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CLI), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "command,case",
    [
        ("inspect", "header-length-absurd"),
        ("dequantize", "lfs-pointer"),
        ("inspect", "suh-nan"),
    ],
)
def test_one_line_no_traceback(command, case, tmp_path):
    ckpt = BY_ID[case].make(tmp_path)
    args = [command, str(ckpt)] + (
        [str(tmp_path / "out")] if command == "dequantize" else []
    )
    if case == "suh-nan":
        args.append("--values")
    proc = _run(*args)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vllm-exl3 {command}: error: "), (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr
    for phrase in BY_ID[case].expect.phrases(command):
        assert phrase in lines[0]


def test_inspect_without_values_says_what_it_did_not_read(tmp_path):
    """`inspect` without --values reads no suh/svh: on a checkpoint with a NaN scale it
    finds nothing, and its verdict says that the values were not read; --values names
    the NaN, as vLLM's loader and dequantize do."""
    ckpt = BY_ID["suh-nan"].make(tmp_path)
    rc, out, err = _cli(["inspect", str(ckpt)])
    assert rc == 0, err
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith(
        "verdict: no problems found in the headers, JSON files and codebook markers; "
        "suh/svh values NOT read (--values reads and checks them"
    ), verdict
    rc, out, err = _cli(["inspect", "--values", str(ckpt)])
    assert rc == 1 and f"{BY_ID['suh-nan'].expect.needles[0]}" in err, err
    assert "verdict: 1 format rule broken (checked: headers" in out


def test_layer_contents_one_item_per_module_in_any_form():
    """Layers of one kind are compared module by module: EXL3 under any codebook marker
    or none, with suh/svh or the legacy su/sv (and an ignored scale), or unquantized,
    is one item; a bias or another tensor stays an item of its own."""
    from vllm.model_executor.layers.quantization.exl3.checkpoint import (
        layer_contents,
    )

    q = "self_attn.q_proj"
    mcg = [f"{q}.{s}" for s in ("trellis", "suh", "svh", "mcg", "bias")]
    legacy = [f"{q}.{s}" for s in ("trellis", "su", "sv", "scale", "bias")]
    plain = [f"{q}.weight", f"{q}.bias"]
    for form in (mcg, legacy, plain):
        assert layer_contents(form) == {q: q, f"{q}.bias": q}, form
    assert layer_contents([f"{q}.weight"]) == {q: q}  # the bias is missed
    experts = layer_contents(
        ["mlp.experts.0.up_proj.trellis", "mlp.experts.1.up_proj.weight"]
    )
    assert experts == {"mlp.experts.*.up_proj": "mlp.experts.*.up_proj"}


def test_debug_shows_the_traceback(tmp_path):
    ckpt = BY_ID["html-page"].make(tmp_path)
    proc = _run("inspect", str(ckpt), "--debug")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("vllm-exl3 inspect: error: ")
    assert "an HTML page" in proc.stderr


# After vLLM's loader runs, every parameter of every EXL3-owned and padding-owned layer
# was written exactly once, at TP=1 and TP=2 (two spawned ranks in one gloo world on the
# CPU).
#
# The checkpoint validation names all of these cases before loading; here it is bypassed
# (the directory is described from its headers alone, as for a hub model), so what is
# under test is the last line of defence: the load ledger (weights.LoadLedger) inside
# the real loader.

WORLD = 2
CONFIG_MODULE = "vllm.model_executor.layers.quantization.exl3.config"
O3 = "model.layers.3.self_attn.o_proj"


def _layer_not_in_checkpoint(dst: Path) -> None:
    """config.json claims a fifth layer: its linears (padding-owned) get nothing."""
    copy_of(BASE, dst)
    edit_json(
        dst / "config.json",
        lambda c: c.update(num_hidden_layers=5, layer_types=["full_attention"] * 5),
    )


def _exl3_module_outside_the_index(dst: Path) -> None:
    """o_proj of layer 3 only in a shard the index does not list: its headers describe
    it as EXL3, vLLM's loader reads only indexed shards."""
    named = tensors_of()
    stray = {n: named.pop(n) for n in list(named) if n.startswith(f"{O3}.")}
    sharded(dst, named)
    save(dst, stray, "model-00003-of-00003.safetensors")


def _exl3_tensor_twice(dst: Path) -> None:
    """Two files and no index (vLLM loads every .safetensors): up_proj of layer 0 in
    both."""
    copy_of(BASE, dst)
    named = tensors_of()
    save(
        dst,
        {n: t for n, t in named.items() if n.startswith("model.layers.0.mlp.up_proj.")},
        "extra.safetensors",
    )


def _plain_weight_twice(dst: Path) -> None:
    """o_proj of layer 3 stored unquantized (a padding-owned layer), and its weight
    twice."""
    copy_of(BASE, dst)
    named = tensors_of()
    for n in [n for n in named if n.startswith(f"{O3}.")]:
        del named[n]
    weight = (
        0.02 * torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    ).half()
    named[f"{O3}.weight"] = weight
    save(dst, named)
    save(dst, {f"{O3}.weight": weight}, "extra.safetensors")


# (builder, phrases the error names at every rank; {rank} is filled in)
LEDGER_CASES = {
    "layer-not-in-checkpoint": (
        _layer_not_in_checkpoint,
        (
            "EXL3 model.layers.4.self_attn.qkv_proj (rank {rank}): checkpoint tensors "
            "never loaded: weight[q], weight[k], weight[v]",
        ),
    ),
    "exl3-module-outside-index": (
        _exl3_module_outside_the_index,
        (
            f"EXL3 {O3} (rank {{rank}}): checkpoint tensors never loaded: {O3}.suh, "
            f"{O3}.svh, {O3}.trellis",
        ),
    ),
    "exl3-tensor-twice": (
        _exl3_tensor_twice,
        (
            "EXL3 model.layers.0.mlp.gate_up_proj: model.layers.0.mlp.up_proj.",
            "written twice",
        ),
    ),
    "plain-weight-twice": (_plain_weight_twice, (f"EXL3 {O3}: weight written twice",)),
}


def _headers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setattr(
        importlib.import_module(CONFIG_MODULE),
        "_holds_weights",
        lambda model_name: False,
    )


@pytest.mark.parametrize("case", sorted(LEDGER_CASES))
def test_tp1_every_owned_parameter_written_once(
    case, tmp_path, monkeypatch, vllm_world
):
    build, phrases = LEDGER_CASES[case]
    build(tmp_path / case)
    _headers_only(monkeypatch)
    outcome = run_vllm(tmp_path / case)
    assert outcome.failed and not outcome.crashed, outcome.message
    for phrase in phrases:
        assert phrase.format(rank=0) in outcome.message, outcome.message


def _rank_main(rank: int, init_file: str, root: str) -> None:
    # A spawned process: vLLM is imported here; validation bypassed as at TP=1.
    from .exl3_harness import gloo_world

    with (
        pytest.MonkeyPatch.context() as monkeypatch,
        gloo_world(WORLD, rank, init_file),
    ):
        _headers_only(monkeypatch)
        for case in sorted(LEDGER_CASES):
            outcome = run_vllm(Path(root) / case)
            kind = (
                "crash"
                if outcome.crashed
                else ("failed" if outcome.failed else "loaded")
            )
            Path(root, f"{case}.rank{rank}").write_text(f"{kind}\n{outcome.message}")


def test_tp2_every_owned_parameter_written_once(tmp_path, vllm_world):
    for case, (build, _) in LEDGER_CASES.items():
        build(tmp_path / case)
    mp.spawn(
        _rank_main,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
    )
    for case, (_, phrases) in sorted(LEDGER_CASES.items()):
        for rank in range(WORLD):
            kind, message = (tmp_path / f"{case}.rank{rank}").read_text().split("\n", 1)
            assert kind == "failed", f"{case} rank {rank}: {kind}: {message}"
            for phrase in phrases:
                assert phrase.format(rank=rank) in message, (
                    f"{case} rank {rank}: {message}"
                )


def test_qwen3_next_mtp_layers_in_the_tools(tmp_path):
    """Qwen3-Next's `mtp.` layers: `inspect` plans them (the MTP group at mtp_bits,
    nothing missing or unplanned); a conversion without them, config.json still
    declaring mtp_num_hidden_layers as ExLlamaV3 leaves it, is complete for `inspect`
    and the validator alike (it loads without a draft)."""
    from vllm.model_executor.layers.quantization.exl3.checkpoint import (
        validate_checkpoint,
    )
    from vllm_exl3.inspect_ckpt import inspect_checkpoint
    from vllm_exl3.testing import synthetic_checkpoint as synth

    cfg = {**synth.load_config("qwen3-next-tiny"), "mtp_num_hidden_layers": 1}
    full, bare = tmp_path / "mtp", tmp_path / "bare"
    written = synth.write_checkpoint(cfg, full, bits=3, mtp_bits=5)
    assert written["mtp.fc"] == (5, synth.fmt.Codebook.MUL1)
    report = inspect_checkpoint(full)
    assert report["disagreements"] == [] and report["errors"] == [], report
    assert "mtp.fc" in {m["name"] for m in report["modules"]}
    assert "mtp.fc" in validate_checkpoint(full).modules
    synth.write_checkpoint(cfg, bare, bits=3, mtp=False)
    edit_json(bare / "config.json", lambda c: c.update(mtp_num_hidden_layers=1))
    report = inspect_checkpoint(bare)
    assert report["disagreements"] == [] and report["errors"] == [], report
    assert not any(m.startswith("mtp.") for m in validate_checkpoint(bare).modules)
