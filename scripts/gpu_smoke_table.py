#!/usr/bin/env python3
"""The one table of `scripts/gpu_smoke.sh`: every step, CHECK and FIGURE of a run, and its verdict.

What it is for: `gpu_smoke.sh` runs each step with its output in its own log in
OUT_DIR and one row per step in `OUT_DIR/steps.tsv`
(`name<TAB>kind<TAB>exit<TAB>seconds<TAB>log`; kind `correctness` or `speed`;
exit an integer or `skip`). This script reads them and prints one table:

- a row per step: exit code (124/137: its time limit), seconds, its log;
- every `CHECK<TAB>name<TAB>PASS|FAIL<TAB>detail` line of every step's log;
- every `FIGURE<TAB>name<TAB>value<TAB>target<TAB>PASS|MISS|INFO` line with its target.

Exit status (what `gpu_smoke.sh` exits with): 1 on any correctness failure (a
correctness step that exited non-zero, a CHECK that is not PASS, or a malformed
CHECK line), else 0. A speed step that fails and a FIGURE that MISSes are
reported, not failures.

Helpers the shell script calls to add derived CHECK lines to a step's log:
    gpu_smoke_table.py step-check NAME EXIT LOG    the step's exit (0: PASS) and pytest's summary
    gpu_smoke_table.py json-check NAME JSON LOG    a bench JSON's `outputs_identical`
    gpu_smoke_table.py accept-check NAME JSON LOG POLICY BASE
                                                   a bench JSON's per warm turn accepted/drafted:
                                                   POLICY's equal BASE's exactly
Each adds its line only if LOG has no CHECK line of its own (a script that prints its own
CHECK lines is not double-counted).
Usage: python3 scripts/gpu_smoke_table.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

CHECK_RE = re.compile(r"^CHECK\t")
FIGURE_RE = re.compile(r"^FIGURE\t")
PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|error|errors|skipped).*?)\s*=*$")


@dataclass
class Step:
    """One row of steps.tsv."""

    name: str
    kind: str  # "correctness" | "speed"
    exit: str  # an integer as text, or "skip"
    seconds: str
    log: str

    @property
    def failed(self) -> bool:
        return self.exit not in ("0", "skip")

    def status(self) -> str:
        if self.exit == "skip":
            return "SKIP"
        if self.exit == "0":
            return "ok"
        return "TIMEOUT" if self.exit in ("124", "137") else "FAILED"


def read_steps(out: Path) -> list[Step]:
    """Rows of `out/steps.tsv` (a malformed row is a failed correctness step)."""
    steps = []
    path = out / "steps.tsv"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 5:
            steps.append(Step(f"malformed steps.tsv row: {line!r}", "correctness", "?", "-", "-"))
        else:
            steps.append(Step(*parts))
    return steps


def collect(out: Path, steps: list[Step]) -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """`(checks, figures)`: (step name, fields) of every CHECK / FIGURE line, in step order."""
    checks, figures = [], []
    for s in steps:
        log = out / s.log
        if s.log == "-" or not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            if CHECK_RE.match(line):
                checks.append((s.name, line.split("\t")[1:]))
            elif FIGURE_RE.match(line):
                figures.append((s.name, line.split("\t")[1:]))
    return checks, figures


def summarize(out: Path) -> int:
    """Print the table of run `out`; return the exit status (1 on a correctness failure)."""
    steps = read_steps(out)
    checks, figures = collect(out, steps)
    failures = 0
    print(f"gpu smoke summary: {out}")
    if not steps:
        print("no steps recorded (steps.tsv missing or empty)")
        failures += 1
    print("\nSTEP                      KIND         EXIT   SECONDS  STATUS   LOG")
    for s in steps:
        print(f"{s.name:25s} {s.kind:12s} {s.exit:>5s} {s.seconds:>8s}  {s.status():8s} {s.log}")
        if s.failed and s.kind != "speed":
            failures += 1
    print("\nCHECK                                                   RESULT  DETAIL (step)")
    for step, f in checks:
        if len(f) != 3 or f[1] not in ("PASS", "FAIL"):
            print(f"{'malformed CHECK line':55s} FAIL    {f!r} ({step})")
            failures += 1
            continue
        name, result, detail = f
        print(f"{name:55s} {result:7s} {detail} ({step})")
        if result != "PASS":
            failures += 1
    if not checks:
        print("(none)")
    print("\nFIGURE                                                  VALUE                              TARGET"
          "               VERDICT (step)")
    for step, f in figures:
        if len(f) != 4:
            print(f"{'malformed FIGURE line':55s} {f!r} ({step})")
            continue
        name, value, target, verdict = f
        print(f"{name:55s} {value:34s} {target:20s} {verdict} ({step})")
    if not figures:
        print("(none)")
    misses = sum(1 for _, f in figures if len(f) == 4 and f[3] == "MISS")
    print(f"\n{len(steps)} steps, {len(checks)} checks, {len(figures)} figures ({misses} MISS); "
          f"{failures} correctness failure(s)")
    return 1 if failures else 0


def step_check(name: str, exit_code: str, log: Path) -> None:
    """Append one CHECK line for a step's exit code (pytest's summary line as the detail),
    unless LOG has a CHECK line of its own."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if any(CHECK_RE.match(line) for line in text.splitlines()):
        return
    summary = ""
    for line in reversed(text.splitlines()):
        m = PYTEST_SUMMARY.match(line.strip())
        if m:
            summary = m.group(1)
            break
    detail = summary or f"exit {exit_code}"
    if exit_code != "0" and summary:
        detail += f" (exit {exit_code})"
    with log.open("a") as f:
        f.write(f"CHECK\t{name}\t{'PASS' if exit_code == '0' else 'FAIL'}\t{detail}\n")


def json_check(name: str, path: Path, log: Path) -> None:
    """Append a CHECK line from a bench JSON's `outputs_identical`, unless LOG has its own CHECK."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if any(CHECK_RE.match(line) for line in text.splitlines()):
        return
    try:
        identical = json.loads(path.read_text())["outputs_identical"]
        ok, detail = identical is True, f"outputs_identical={identical} in {path.name}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        ok, detail = False, f"no outputs_identical in {path.name}: {type(e).__name__}"
    with log.open("a") as f:
        f.write(f"CHECK\t{name}\t{'PASS' if ok else 'FAIL'}\t{detail}\n")


def accept_check(name: str, path: Path, log: Path, policy: str, base: str) -> None:
    """Append a CHECK line: in a bench JSON, `policy`'s accepted and drafted tokens equal `base`'s
    on every warm turn (turn >= 1, paired by replay, session and turn), exactly: identical
    outputs hide corrupt drafter rows (greedy verification repairs any draft); acceptance shows
    them. Unless LOG has its own CHECK line for `name`."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if any(line.startswith(f"CHECK\t{name}\t") for line in text.splitlines()):
        return
    try:
        policies = json.loads(path.read_text())["policies"]
        turns = {p: {(t["replay"], t["session"], t["turn"]): (t["accepted"], t["drafted"])
                     for t in policies[p]["turns"] if t["turn"] >= 1} for p in (policy, base)}
        keys = sorted(turns[policy].keys() & turns[base].keys())
        bad = [k for k in keys if turns[policy][k] != turns[base][k]]
        if not keys:
            ok, detail = False, f"no warm turn of both {policy} and {base} in {path.name}"
        elif bad:
            r, sess, t = bad[0]
            (pa, pd), (ba, bd) = turns[policy][bad[0]], turns[base][bad[0]]
            ok, detail = False, (f"{len(bad)} of {len(keys)} warm turns differ; first replay {r} session {sess} "
                                 f"turn {t}: {policy} {pa}/{pd} accepted/drafted, {base} {ba}/{bd}")
        else:
            ok, detail = True, f"{len(keys)} warm turns: {policy} accepted/drafted equal {base}'s exactly"
    except (OSError, ValueError, KeyError, TypeError) as e:
        ok, detail = False, f"no per-turn accepted/drafted of {policy} and {base} in {path.name}: {type(e).__name__}"
    with log.open("a") as f:
        f.write(f"CHECK\t{name}\t{'PASS' if ok else 'FAIL'}\t{detail}\n")


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "step-check":
        step_check(argv[1], argv[2], Path(argv[3]))
        return 0
    if len(argv) == 6 and argv[0] == "accept-check":
        accept_check(argv[1], Path(argv[2]), Path(argv[3]), argv[4], argv[5])
        return 0
    if len(argv) == 4 and argv[0] == "json-check":
        json_check(argv[1], Path(argv[2]), Path(argv[3]))
        return 0
    if len(argv) == 1 and Path(argv[0]).is_dir():
        return summarize(Path(argv[0]))
    print("gpu_smoke_table: error: usage: gpu_smoke_table.py OUT_DIR | step-check NAME EXIT LOG"
          f" | json-check NAME JSON LOG | accept-check NAME JSON LOG POLICY BASE, got {argv!r}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
