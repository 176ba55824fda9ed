# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every EXL3 op's refusal path, without a GPU: each op's CUDA kernel is called through
the dispatcher (`redispatch` to the CUDA key) with inputs it refuses, so the error
crosses the stable ABI's boxing back into Python, as a bad input on a GPU does. Twice
per op: with CPU tensors, which its first check refuses, and with fake CUDA tensors
(torch's FakeTensor: the device, shape and dtype of a CUDA tensor, no memory), which
pass the device checks and are refused by a later rule (a dimension or a dtype), so the
error leaves from deeper inside the op, with its earlier checks' temporaries alive. An
op must raise a RuntimeError that names it and its rule after the file and line (or,
where it reads no device memory, return); a crash of the process, or a message cut at
its first number, is the failure this finds. Then exl3_linear's rules
one by one on fake CUDA tensors: the GPU oracle's bad-input cases
(exl3_oracle.check_errors), each of which must raise naming its tensor and rule.

    python -m vllm_exl3.testing.error_path [LIBRARY]

LIBRARY: an extension with the ops (the quick build's _exl3_C.abi3.so, or a vLLM
_C_stable_libtorch built with them); without it, the installed vLLM's
_C_stable_libtorch. Prints one line per op; exit status 0 when every op refused or
returned, 1 when one raised something else, and the signal's when the process died.
"""

from __future__ import annotations

import importlib
import re
import sys

import torch

OP_PREFIX = "_C::exl3"
# A refusal's first line as the ops' checks write it: where (file:line), then the rule,
# e.g. "check_tensor, .../exl3_tensor_checks.h:51, exl3_plan: trellis must have 3
# dimensions, got [2, 256]". A message cut at its first number (a second C++ runtime in
# the process, cxx_runtime.py) has the op's name but no rule.
LOCATED_RULE = re.compile(r"\.(?:cpp|cu|cuh|h):\d+, \S")


def names_its_rule(name: str, first_line: str) -> bool:
    """Whether a refusal's first line names the op and carries a located rule."""
    return name in first_line and LOCATED_RULE.search(first_line) is not None


def placeholder(arg: torch.Argument):
    """A value of the argument's type that no EXL3 kernel accepts as its input: CPU
    tensors, small integers."""
    kind = arg.type
    if isinstance(kind, torch.OptionalType):
        return None
    if isinstance(kind, torch.TensorType):
        return torch.zeros(2, 256, dtype=torch.float16)
    if isinstance(kind, torch.ListType) and isinstance(
        kind.getElementType(), torch.IntType
    ):
        return [1]
    for cls, value in (
        (torch.IntType, 1),
        (torch.FloatType, 1.0),
        (torch.BoolType, False),
    ):
        if isinstance(kind, cls):
            return value
    if str(kind) == "ScalarType":
        return torch.float16
    raise TypeError(f"no placeholder for {arg.name}: {kind}")


def op_names() -> list[str]:
    return sorted(
        n.split("::")[1]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith(OP_PREFIX)
    )


def fake_cuda_args(op) -> list:
    """The placeholders, each tensor a fake CUDA tensor of its shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [
            torch.empty_like(v, device="cuda") if isinstance(v, torch.Tensor) else v
            for v in map(placeholder, op._schema.arguments)
        ]


def refuse(name: str, fake_cuda: bool = False) -> tuple[bool, str]:
    """(whether the op behaved, what happened) for one call of its CUDA kernel on CPU
    tensors, or on fake CUDA tensors."""
    op = getattr(torch.ops._C, name).default
    if fake_cuda:
        args = fake_cuda_args(op)
    else:
        args = [placeholder(a) for a in op._schema.arguments]
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    try:
        op.redispatch(cuda, *args)
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        return names_its_rule(name, first), f"raised: {first}"
    except Exception as e:  # noqa: BLE001 - reported: anything else is wrong
        return False, f"raised {type(e).__name__}: {e}"
    return True, "returned"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        torch.ops.load_library(argv[0])
    else:
        importlib.import_module("vllm._C_stable_libtorch")
    names = op_names()
    if not names:
        print("error_path: no EXL3 op registered", flush=True)
        return 1
    ok = True
    for fake_cuda in (False, True):
        inputs = "fake CUDA tensors" if fake_cuda else "CPU tensors"
        for name in names:
            good, what = refuse(name, fake_cuda)
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {name} ({inputs}): {what}", flush=True)
    if "exl3_linear" in names:
        from .exl3_oracle import Report, check_errors, fake_cuda

        rep = Report()
        with fake_cuda():
            check_errors(rep)
        ok &= not rep.failures and bool(rep.rows)
        good = len(rep.rows) - len(rep.failures)
        print(
            f"{'ok  ' if not rep.failures else 'FAIL'} exl3_linear rules (fake CUDA "
            f"tensors): {good} of {len(rep.rows)} bad inputs refused by name",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
