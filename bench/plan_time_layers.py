"""Whole ``planner plan`` wall time against the number of layers (issue 24, part 4).

Times ``planner plan models/llama.py --size tiny --set n_layers=N --gpus 64 --gpu-type h100`` (the
roofline estimate on the meta device: no profiling, so the time is the planner's own work) as a
separate process per N, imports included, for this tree and optionally for an earlier commit
(``--before``, exported with ``git archive`` to a temporary folder), and checks that both give the
same plan (JSON without the moment, the host and the file's path). Writes docs/plan_time_layers.md.

    python -m bench.plan_time_layers --before bfd5dc7 --after HEAD --before-up-to 500
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import DOCS, ROOT, execute, host, write_page

PAGE = """# `planner plan` time against the number of layers

Written by `bench/plan_time_layers.py` on {today} ({host}, Python {python}). The machine has
**2 CPU cores shared with other jobs**, so the times are noisy; the load average (1 minute) at the
end of each run is given. Each cell is one run of

    planner plan models/llama.py --size tiny --set n_layers=N --gpus 64 --gpu-type h100 -q

as its own process (imports, trace, roofline estimate, microbatch-scaling fit, search, writing the
plan). "before" is commit `{before}`; "after" is {after}. "same plan": both wrote the same plan
(its JSON with the moment, the host and the model file's path and digest left out).

| N layers | before s | load | after s | load | after / before | same plan |
|---:|---:|---:|---:|---:|---:|---|
{rows}

{notes}
Regenerate: `python -m bench.plan_time_layers --before {before}{after_flag} --before-up-to {up_to}`.
"""


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[125, 250, 500, 1000, 2000])
    parser.add_argument("--before", default=None, help="a commit to time too (exported with git archive)")
    parser.add_argument("--after", default=None, help="the commit to time as 'after' (default: this tree as it is)")
    parser.add_argument("--before-up-to", type=int, default=500, help="time --before only up to this many layers")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=DOCS / "plan_time_layers.md")
    parser.add_argument("--note", default="", help="a paragraph to add under the table")
    return parser.parse_args()


def plan_digest(path: Path) -> str:
    """SHA-256 of a plan's JSON without the fields that name the moment, the host or the file."""
    data = json.loads(path.read_text())
    data["created"] = ""
    data["profile"]["hostname"] = ""
    data["model"]["path"] = ""
    data["model"]["file_digest"] = ""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def time_plan(code: Path, layers: int, work: Path, timeout_s: float) -> tuple[float | None, float, str]:
    """One ``planner plan`` run of the code in ``code``: seconds (None if it failed), load, plan digest."""
    out = work / f"plan_{layers}.json"
    argv = [
        sys.executable,
        "-c",
        # the ``planner`` console script's entry (cli.console; cli.main in trees from before it)
        "import sys, cli; sys.argv[0] = 'planner'; getattr(cli, 'console', cli.main)()",
        "plan",
        str(code / "models" / "llama.py"),
        "--size",
        "tiny",
        "--set",
        f"n_layers={layers}",
        "--gpus",
        "64",
        "--gpu-type",
        "h100",
        "-q",
        "-o",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONDONTWRITEBYTECODE": "1"}
    done = execute(argv, work, timeout_s, env)
    load = os.getloadavg()[0]
    if done.error:
        print(f"  {code}: N={layers}: {done.error}", file=sys.stderr)
        return None, load, ""
    return done.seconds, load, plan_digest(out)


def export(commit: str, into: Path) -> str:
    """Export ``commit`` of this repository into ``into``; its short hash."""
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return subprocess.run(
        ["git", "rev-parse", "--short", commit], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def this_tree() -> str:
    """The working tree as the page names it: its commit, and whether it had uncommitted changes."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, check=True, capture_output=True, text=True)
    return f"the tree of commit `{head}`" + (" with uncommitted changes" if dirty.stdout.strip() else "")


def main() -> None:
    """Time every N, after (and before) the change; write the page."""
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        after_code = ROOT
        after_commit = ""
        if args.after:
            after_code = work / "after"
            after_code.mkdir()
            after_commit = export(args.after, after_code)
            after = f"commit `{after_commit}`"
        else:
            after = this_tree()
        before_code = work / "before"
        before = "-"
        if args.before:
            before_code.mkdir()
            before = export(args.before, before_code)
        for layers in args.layers:
            b_s: float | None = None
            b_load, b_digest = 0.0, ""
            if args.before and layers <= args.before_up_to:
                b_s, b_load, b_digest = time_plan(before_code, layers, work, args.timeout)
            a_s, a_load, a_digest = time_plan(after_code, layers, work, args.timeout)
            same = "yes" if b_digest and b_digest == a_digest else ("NO" if b_digest and a_digest else "-")
            ratio = f"{a_s / b_s:.2f}" if a_s and b_s else "-"
            rows.append(
                f"| {layers} | {f'{b_s:.1f}' if b_s else '-'} | {f'{b_load:.1f}' if b_s else '-'} | "
                f"{f'{a_s:.1f}' if a_s else 'failed'} | {a_load:.1f} | {ratio} | {same} |"
            )
            print(rows[-1], flush=True)
    text = PAGE.format(
        today=dt.date.today().isoformat(),
        host=host(),
        python=platform.python_version(),
        before=before,
        after=after,
        after_flag=f" --after {after_commit}" if after_commit else "",
        rows="\n".join(rows),
        notes=(args.note + "\n") if args.note else "",
        up_to=args.before_up_to,
    )
    write_page(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
