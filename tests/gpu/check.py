"""The GPU check: distsync's CUDA path on one GPU, every part reported with its numbers, in under 8 minutes.

    bash tests/gpu/run.sh [OUT_DIR]              # on the GPU machine: installs the carried wheels, then this
    python tests/gpu/check.py --plan             # the parts, what each needs, its time limit
    python tests/gpu/check.py --out DIR [--only NAME ...]

Each part runs in a process of its own under a time limit, so that a failure, a crash or a hang is reported
and the next part still runs. Without CUDA (the dry run) a part that needs it is skipped with a line saying
so; the others run a smaller version of themselves on the CPU, which exercises their code, under limits
that grow with the machine's load as the tests' do. Writes ``report.md`` and ``report.json`` to the output
folder (``$OUT`` when set). See ``tests/gpu/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TOTAL_LIMIT_S = 450  # all parts together; the install before them takes seconds, the report less


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the check: ``module.function(findings, device)`` in a process of its own."""

    name: str
    title: str
    target: str  # "module:function", a module of this folder
    limit_s: int  # killed (and reported as failed) after this long
    needs_cuda: bool  # skipped without a GPU; else it runs on the CPU there, smaller
    default: bool = True  # run without --only; else only when --only names it (a run of its own)


PARTS = (
    Part("exactness", "1. Exactness on the device", "part_exactness:run", 60, False),
    Part("host_sync", "2. No host sync in a training step", "part_runtime:host_sync", 30, True),
    Part("cuda_graph", "3. CUDA graph capture and replay", "part_runtime:cuda_graph", 30, True),
    Part("compile", "4. torch.compile(fullgraph=True)", "part_compile:run", 75, False),
    Part("errors", "5. Errors raised on every rank", "part_errors:run", 40, False),
    Part("speed", "6. Speed, side by side", "part_speed:run", 130, False),
    Part("job", "7. The packaged job and the Hydra plugin", "part_job:run", 85, False),
    Part("step", "8. ResNet-50 step, eager and compiled", "part_step:run", 420, False, default=False),
)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def limit_scale(cuda: bool) -> float:
    """What the time limits are multiplied by here: 1 on a GPU; in the dry run, the test suite's factor for
    a busy machine (``common.limit_scale``)."""
    import common

    return common.limit_scale("cuda" if cuda else "cpu")


def plan(cuda: bool) -> list[dict[str, Any]]:
    """What a run on this machine would do, part by part, under which time limit."""
    scale = limit_scale(cuda)
    rows = []
    for part in PARTS:
        runs = (
            "skipped: needs CUDA"
            if part.needs_cuda and not cuda
            else ("on the GPU" if cuda else "on the CPU")
        )
        if not part.default:
            runs = f"--only {part.name}: {runs}"
        limit_s = round(part.limit_s * scale)
        rows.append({"name": part.name, "title": part.title, "limit_s": limit_s, "runs": runs})
    return rows


def run_part(name: str, result_path: Path) -> None:
    """In the part's own process: run it, write its findings (and any exception) as JSON."""
    import common  # tests/gpu/common.py: sets up sys.path for the parts

    part = next(p for p in PARTS if p.name == name)
    module, function = part.target.split(":")
    findings = common.Findings()
    error = None
    try:
        device = "cuda" if _cuda_available() else "cpu"
        getattr(importlib.import_module(module), function)(findings, device)
    except BaseException:  # reported, whatever it is: the next part runs anyway
        error = traceback.format_exc()
    result_path.write_text(json.dumps({**findings.to_json(), "error": error}, default=str))


def _child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    return env


def _run_in_process(part: Part, limit: float, scratch: Path) -> dict[str, Any]:
    result_path = scratch / f"{part.name}.json"
    command = [sys.executable, str(HERE / "check.py"), "--run-part", part.name, "--result", str(result_path)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: the ranks and jobs it starts go with it
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=limit)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a hang, or strays of a finished part
    if code is None:
        output, _ = proc.communicate()
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {"checks": [], "figures": {}, "tables": [], "notes": [], "error": None}
    if result_path.exists():
        result.update(json.loads(result_path.read_text()))
    if code is None:
        result["error"] = f"killed after its time limit of {limit:.0f} s"
    elif code != 0 and not result["error"]:
        result["error"] = f"its process exited with code {code}"
    failed = result["error"] or not result["checks"] or not all(c["passed"] for c in result["checks"])
    result.update(seconds=round(seconds, 1), status="FAIL" if failed else "PASS")
    if failed:
        result["output_tail"] = output[-3000:]
    return result


def run_all(only: list[str] | None, out: Path) -> int:
    import common

    cuda = _cuda_available()
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / ".parts"
    scratch.mkdir(exist_ok=True)
    report: dict[str, Any] = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": common.environment(),
        "parts": {},
    }
    scale = limit_scale(cuda)
    deadline = time.monotonic() + TOTAL_LIMIT_S * scale
    print(f"distsync GPU check on {report['environment']['device']}, torch {report['environment']['torch']}")
    for part in PARTS:
        if (only and part.name not in only) or (not only and not part.default):
            continue
        if part.needs_cuda and not cuda:
            result = {"status": "SKIP", "why": "needs CUDA: no CUDA device here", "seconds": 0.0}
        else:
            limit = min(part.limit_s * scale, deadline - time.monotonic())
            if limit < 5:
                result = {"status": "FAIL", "error": "not run: the check's total time limit was reached"}
            else:
                result = _run_in_process(part, limit, scratch)
        report["parts"][part.name] = {"title": part.title, **result}
        print(f"{result['status']:4}  {part.title} ({result.get('seconds', 0):.0f} s)", flush=True)
        for check in result.get("checks", []):
            if not check["passed"]:
                print(f"      failed: {check['name']}: {check['detail'][:300]}", flush=True)
        if result.get("error"):
            print(f"      error: {result['error'].strip().splitlines()[-1]}", flush=True)
    for path in scratch.iterdir():
        path.unlink()
    scratch.rmdir()
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(_markdown(report))
    statuses = [p["status"] for p in report["parts"].values()]
    counts = ", ".join(
        f"{statuses.count(s)} {w}" for s, w in (("PASS", "passed"), ("FAIL", "failed"), ("SKIP", "skipped"))
    )
    print(f"{counts}; report: {out / 'report.md'}")
    return 1 if "FAIL" in statuses else 0


def _markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# distsync GPU check",
        "",
        f"{report['when']}: {env['device']}, torch {env['torch']}, CUDA {env.get('cuda')}, "
        f"cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')}, Python {env['python']}, {env['cpu_count']} cores",
        "",
        "| part | status | seconds |",
        "| --- | --- | --- |",
    ]
    for part in report["parts"].values():
        lines.append(f"| {part['title']} | {part['status']} | {part.get('seconds', 0):.0f} |")
    for part in report["parts"].values():
        lines += ["", f"## {part['title']}: {part['status']}", ""]
        if part.get("why"):
            lines.append(f"Skipped: {part['why']}.")
        for check in part.get("checks", []):
            mark = "pass" if check["passed"] else "**FAIL**"
            detail = f": {check['detail']}" if check["detail"] else ""
            lines.append(f"- {mark} {check['name']}{detail}")
        for name, value in part.get("figures", {}).items():
            lines.append(f"- {name}: {value}")
        for table in part.get("tables", []):
            lines += ["", table["title"], "", "| " + " | ".join(table["header"]) + " |"]
            lines.append("|" + " --- |" * len(table["header"]))
            lines += ["| " + " | ".join(map(str, row)) + " |" for row in table["rows"]]
        for note in part.get("notes", []):
            lines += ["", note]
        if part.get("error"):
            lines += ["", "Error:", "", "```", part["error"].strip(), "```"]
        if part.get("output_tail"):
            lines += ["", "Output (tail):", "", "```", part["output_tail"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--plan", action="store_true", help="print the parts and how each would run; run none"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")), help="report folder"
    )
    parser.add_argument("--only", nargs="+", choices=[p.name for p in PARTS], help="run these parts only")
    parser.add_argument("--run-part", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_part:
        run_part(args.run_part, args.result)
        return 0
    if args.plan:
        cuda = _cuda_available()
        rows = plan(cuda)
        for row in rows:
            print(f"{row['name']:11} {row['limit_s']:4d} s  {row['runs']:20}  {row['title']}")
        scale = limit_scale(cuda)
        print(
            f"total limit {TOTAL_LIMIT_S * scale:.0f} s (the parts' limits add up to "
            f"{sum(part.limit_s for part in PARTS if part.default) * scale:.0f} s; --only runs others)"
        )
        return 0
    return run_all(args.only, args.out)


if __name__ == "__main__":
    sys.exit(main())
