#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The device-call sequence that stages the offline bundle on the GPU host and runs the e2e
scripts, sized to the run tool's per-call limit (scripts/e2e/README.md).

Every call sends the working tree (tracked and untracked-not-ignored files) plus the paths it
carries, 64 MiB at most in all; the host keeps /tmp while the machine stays warm (~30 s between
calls). So each call carries one bundle part into /tmp/vx/bundle, the last one installs it and
runs the fixture e2e, and later calls run the rest.

    device_calls.py budget [--margin-mib M]        part size in bytes for `vllm-exl3 bundle`
    device_calls.py layout --bundle DIR            link parts into .e2e/xfer/cN, write the plan
    device_calls.py check                          re-measure the tree + each call's carry
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from vllm_exl3.index import sha256_file  # noqa: E402
E2E = REPO / ".e2e"
XFER = E2E / "xfer"
PLAN_JSON = E2E / "calls.json"
PLAN_MD = E2E / "calls.md"
# The run tool's limit on what one call sends (working tree + carried paths).
CALL_LIMIT = 64 * 2**20
# Room for the tree to grow (other commits) between preparing and running the calls.
DEFAULT_MARGIN_MIB = 2
# Room for install.sh, which travels with the first part.
INSTALLER_ALLOWANCE = 64 * 2**10
PART_STEM = "vllm-exl3-bundle.part"
HOST_DIR = "/tmp/vx"
COMMAND_LIMIT = 2000  # characters, the run tool's limit
# Per-call wall-clock limits (the run tool allows 600 s): the e2e scripts get budgets that leave
# room for the install before them and for engine shutdown after their last stage.
INSTALL_AND_FIXTURE_BUDGET_S = 450
THROUGHPUT_BUDGET_S = 520
# x2_session.sh phases: seconds from the command's start to its deadline (the tool allows 600).
X2_CALL_S = 570


def tree_bytes(root: Path = REPO) -> int:
    """Bytes the run tool sends besides carried paths: tracked + untracked-not-ignored files."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], capture_output=True, check=True).stdout
    total = 0
    for name in {n for n in out.decode().split("\0") if n}:
        p = root / name
        if p.is_symlink() or p.is_file():
            total += p.lstat().st_size
    return total


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def x2_extra_bytes() -> int:
    """What the x2 sequence's last staging call carries beside its part (ExLlamaV3's wheels)."""
    wheels = REPO / ".whl"
    return path_bytes(wheels) if wheels.exists() else 0


def part_budget(tree: int, margin: int) -> int:
    # Every part must fit beside the largest extra carry of either sequence: the part size is
    # one for all calls, and the last part is not always the small remainder.
    budget = CALL_LIMIT - tree - margin - INSTALLER_ALLOWANCE - x2_extra_bytes()
    if budget < 1 << 20:
        raise SystemExit(f"the working tree ({tree / 2**20:.1f} MiB) leaves no room for bundle "
                         f"parts under the {CALL_LIMIT / 2**20:.0f} MiB per-call limit")
    return budget


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stage_command(call: int, parts: list[tuple[str, str]], first: bool) -> str:
    """Copy call `call`'s carried parts into the host's bundle directory and check them."""
    rel = f".e2e/xfer/c{call}"
    checks = " && ".join(f"echo '{sha}  {name}' | sha256sum -c -" for name, sha in parts)
    cmd = ""
    if first:
        # The synthetic 8B checkpoint needs only torch: write it in the background (its own
        # session survives the call) while the parts travel.
        cmd += (f"mkdir -p {HOST_DIR} && (setsid nohup python3 scripts/e2e/throughput.py "
                f"--write-only > {HOST_DIR}/synth.log 2>&1 < /dev/null &); ")
    return cmd + (f"mkdir -p {HOST_DIR}/bundle && cp {rel}/* {HOST_DIR}/bundle/ && "
                  f"(cd {HOST_DIR}/bundle && {checks}) && df -h /tmp | tail -1")


def env_command() -> str:
    """The environment install.sh wrote (PYTHONPATH, PATH, VLLM_USE_FLASHINFER_SAMPLER=0)."""
    return f". {HOST_DIR}/site/vllm-exl3-env.sh && export PYTHONUNBUFFERED=1"


def install_command() -> str:
    return (f"{{ bash {HOST_DIR}/bundle/install.sh {HOST_DIR}/site > $OUT/install.log 2>&1 "
            f"|| {{ tail -40 $OUT/install.log; false; }}; }} && {env_command()}")


def run_commands() -> dict[str, str]:
    env = env_command()
    return {
        "fixture": (f"python3 scripts/e2e/run_fixture_e2e.py --budget-s "
                    f"{INSTALL_AND_FIXTURE_BUDGET_S} 2>&1 | tee $OUT/fixture_e2e.log"),
        # Two repeats per concurrency: a one-time cost of the first batch of a size shows apart
        # from the steady state (session 10's TTFT at concurrency 4, NEXT_SESSION.md).
        "throughput": (f"set -o pipefail; {env} && python3 scripts/e2e/throughput.py "
                       f"--budget-s {THROUGHPUT_BUDGET_S} --repeat 2 2>&1 | "
                       f"tee $OUT/throughput.log"),
    }


def x2_calls(stage_calls: list[dict], last_stage: str, tree: int) -> list[dict]:
    """The same staging on nvidia-h200-x2, then scripts/e2e/x2_session.sh's three phases: the
    two GPUs run the e2e record and the kernels' record side by side (issues 3 and 4 in one
    lease). The last staging call also carries ExLlamaV3's wheels (.whl, see
    scripts/bench/NEXT_SESSION.md)."""
    calls = [dict(c) for c in stage_calls[:-1]]
    last = stage_calls[-1]
    session = "bash scripts/e2e/x2_session.sh"
    # The deadline is taken when the command starts, so the install's time counts against it.
    deadline = f"export DEADLINE=$(( $(date +%s) + {X2_CALL_S} )); set -o pipefail; "
    calls.append({**last, "carry": [*last["carry"], ".whl"],
                  "bytes": last["bytes"] + x2_extra_bytes(),
                  "command": (deadline + last_stage + " && " + install_command() + " && "
                              + session + " tp1"),
                  "does": last["does"].split(";")[0] + "; install; x2_session tp1 (fixture "
                          "e2e on GPU 0, kernel verification + benchmark on GPU 1)"})
    env = env_command()
    calls.append({"call": len(calls) + 1, "carry": [], "bytes": tree, "timeout_s": 600,
                  "command": f"{deadline}{env} && {session} tp2",
                  "does": "x2_session tp2 (TP=2 vs TP=1)"})
    calls.append({"call": len(calls) + 1, "carry": [], "timeout_s": 600, "bytes": tree,
                  "command": f"{deadline}{env} && {session} final",
                  "does": "x2_session final (throughput on GPU 0, same-run ExLlamaV3 anchor "
                          "on GPU 1)"})
    for i, c in enumerate(calls, 1):
        c["call"] = i
    return calls


def layout(bundle: Path, margin: int) -> dict:
    parts = sorted(bundle.glob(PART_STEM + "*"))
    installer = bundle / "install.sh"
    if not parts or not installer.is_file():
        raise SystemExit(f"{bundle}: no bundle (install.sh + {PART_STEM}NN) here")
    listed = re.findall(rf"'({re.escape(PART_STEM)}\d+) ([0-9a-f]{{64}}) (\d+)'",
                        installer.read_text())
    if [n for n, _, _ in listed] != [p.name for p in parts]:
        raise SystemExit(f"{bundle}: the parts present differ from those install.sh lists")
    shas = {n: s for n, s, _ in listed}
    for p in parts:
        if sha256_file(p) != shas[p.name]:
            raise SystemExit(f"{p}: sha256 differs from install.sh's; rebuild the bundle")
    tree = tree_bytes()
    shutil.rmtree(XFER, ignore_errors=True)
    calls = []
    for i, part in enumerate(parts, 1):
        d = XFER / f"c{i}"
        d.mkdir(parents=True)
        _link(part, d / part.name)
        if i == 1:
            _link(installer, d / installer.name)
        first, last = i == 1, i == len(parts)
        stage = command = stage_command(i, [(part.name, shas[part.name])], first)
        if last:
            command = ("set -o pipefail; " + stage + " && " + install_command() + " && "
                       + run_commands()["fixture"])
        calls.append({"call": i, "carry": [f".e2e/xfer/c{i}"], "command": command,
                      "bytes": tree + path_bytes(d), "timeout_s": 600 if last else 120,
                      "does": ("stage " + part.name + (" + install.sh" if first else "")
                               + (" + synthetic 8B writer (background)" if first else "")
                               + ("; install; fixture e2e (TP=1)" if last else ""))})
    n = len(calls)
    cmds = run_commands()
    calls.append({"call": n + 1, "carry": [], "command": cmds["throughput"],
                  "bytes": tree, "timeout_s": 600, "does": "throughput (exl3 vs bf16)"})
    plan = {"tree_bytes": tree, "limit_bytes": CALL_LIMIT, "margin_bytes": margin,
            "calls": calls, "x2_calls": x2_calls(calls[:n], stage, tree)}
    for c in [*calls, *plan["x2_calls"]]:
        if len(c["command"]) > COMMAND_LIMIT:
            raise SystemExit(f"call {c['call']}: command is {len(c['command'])} "
                             f"characters, over the run tool's {COMMAND_LIMIT}")
    for c in [*calls, *plan["x2_calls"]]:
        if c["bytes"] + margin > CALL_LIMIT:
            raise SystemExit(f"call {c['call']}: {c['bytes'] / 2**20:.2f} MiB + margin exceeds "
                             f"{CALL_LIMIT / 2**20:.0f} MiB")
    return plan


def _render_calls(calls: list[dict], kind: str) -> list[str]:
    lines = []
    for c in calls:
        lines += [f"## {kind} call {c['call']}: {c['does']}",
                  f"- carry: {json.dumps(c['carry'])}",
                  f"- timeout_s: {c['timeout_s']}",
                  f"- sends: {c['bytes'] / 2**20:.2f} MiB",
                  "- command:", "", "```", c["command"], "```", ""]
    return lines


def render(plan: dict) -> str:
    lines = [
        "# Device calls for the GPU record (generated by scripts/e2e/device_calls.py)",
        "",
        f"Working tree: {plan['tree_bytes'] / 2**20:.2f} MiB per call (limit "
        f"{plan['limit_bytes'] / 2**20:.0f} MiB incl. carried paths). Make the calls back to "
        "back: the machine goes back ~30 s after a call, and /tmp/vx with it.",
        f"Either the single-H200 sequence (`nvidia-h200`, {len(plan['calls'])} calls: issue 4 "
        f"without TP=2) or the x2 sequence (`nvidia-h200-x2`, {len(plan['x2_calls'])} calls: "
        "issue 4 with TP=2 and issue 3's kernel record, the two GPUs side by side; "
        "scripts/e2e/x2_session.sh).",
        "Before the calls, `python3 scripts/e2e/device_calls.py check` re-measures the sizes.",
        "",
    ]
    lines += _render_calls(plan["calls"], "nvidia-h200")
    lines += _render_calls(plan["x2_calls"], "nvidia-h200-x2")
    return "\n".join(lines)


def check() -> int:
    if not PLAN_JSON.is_file():
        raise SystemExit(f"no plan at {PLAN_JSON}; run scripts/e2e/prepare.sh")
    plan = json.loads(PLAN_JSON.read_text())
    tree = tree_bytes()
    ok = True
    print(f"working tree now {tree / 2**20:.2f} MiB (was {plan['tree_bytes'] / 2**20:.2f})")
    for c in [*plan["calls"], *plan.get("x2_calls", [])]:
        carried = 0
        for p in c["carry"]:
            if not (REPO / p).exists():
                print(f"call {c['call']}: {p} is missing")
                ok = False
                continue
            carried += path_bytes(REPO / p)
        total = tree + carried
        fits = total <= CALL_LIMIT
        ok &= fits
        print(f"call {c['call']}: {total / 2**20:6.2f} MiB {'ok' if fits else 'OVER THE LIMIT'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("budget", help="print the bundle part size (bytes) that fits one call")
    b.add_argument("--margin-mib", type=float, default=DEFAULT_MARGIN_MIB)
    lay = sub.add_parser("layout", help="link the parts into .e2e/xfer/cN and write the plan")
    lay.add_argument("--bundle", type=Path, required=True)
    lay.add_argument("--margin-mib", type=float, default=DEFAULT_MARGIN_MIB)
    sub.add_parser("check", help="re-measure the tree and every call's carry")
    args = ap.parse_args(argv)
    if args.cmd == "budget":
        print(part_budget(tree_bytes(), int(args.margin_mib * 2**20)))
        return 0
    if args.cmd == "check":
        return check()
    plan = layout(args.bundle, int(args.margin_mib * 2**20))
    E2E.mkdir(exist_ok=True)
    PLAN_JSON.write_text(json.dumps(plan, indent=1))
    PLAN_MD.write_text(render(plan))
    print(render(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
