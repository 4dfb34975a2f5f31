"""The README's sample of `trtllm-mtp-carry bench` is what the command prints (issue 38).

The sample under "What the output means" was printed by a real default run, then cut
where a marker line (one starting with `...`) says so. The default run takes minutes,
so this test runs a small one with the same policies (the same kinds of line, other
numbers) and reads both with every number masked: each line the sample shows must be
the small run's next line, except right after a marker, where the lines the marker
stands for are skipped; a sample that ends without a marker ends where the output
does. So a line the command no longer prints, a changed outcome text or ratio line, or
a part of the output left out without a marker, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from trtllm_mtp_carry.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["bench", "--sessions", "1", "--turns", "2", "--history", "300", "--new-span", "16",
         "--max-new-tokens", "8", "--repeat", "2", "--no-progress"]
"""The default policies, a warm-up replay and one measured one: every kind of line the default prints."""


def readme_sample(text: str | None = None) -> list[str]:
    """The lines of the first ```text block under the README's "## What the output means"."""
    text = (ROOT / "README.md").read_text() if text is None else text
    section = text.split("\n## What the output means\n", 1)[1]
    match = re.search(r"^```text\n(.*?)\n```$", section, re.S | re.M)
    assert match is not None, "no ```text block under 'What the output means'"
    return match.group(1).splitlines()


def masked(line: str) -> str:
    """`line` with every number as N and blanks collapsed; the environment line kept as its label
    (versions, machine, load and time differ from run to run)."""
    if line.startswith("environment:"):
        return "environment:"
    return " ".join(re.sub(r"\d+(?:\.\d+)?", "N", line).split())


def is_marker(line: str) -> bool:
    return line.startswith("...")


def unmatched(sample: list[str], output: list[str]) -> list[str]:
    """What of `sample` the `output` does not bear out, as messages (empty: it does)."""
    problems = []
    at = 0
    skipping = False
    for n, line in enumerate(sample, 1):
        if is_marker(line):
            skipping = True
            continue
        want = masked(line)
        if skipping:
            while at < len(output) and masked(output[at]) != want:
                at += 1
        if at >= len(output) or masked(output[at]) != want:
            got = output[at] if at < len(output) else "<end of output>"
            problems.append(f"sample line {n} {line!r}: the command prints {got!r} there")
            return problems
        at += 1
        skipping = False
    if not skipping and at < len(output):
        problems.append(f"the sample ends, unmarked, before the output's line {output[at]!r}")
    return problems


def test_the_sample_checker_finds_a_changed_line_and_an_unmarked_cut():
    output = ["environment: a", "head", "row 1", "row 2", "row 3", "ratio x1.00", "done (5.0 s)"]
    assert unmatched(["environment: b", "head", "row 7", "... (2 more rows)", "ratio x2.5", "done (1 s)"],
                     output) == []
    assert unmatched(["environment: b", "head", "row 1", "ratio x1.00", "done (1 s)"], output) == [
        "sample line 4 'ratio x1.00': the command prints 'row 2' there"]
    assert unmatched(["environment: b", "head", "row 1", "..."], output) == []
    assert unmatched(["environment: b", "head"], output) == [
        "the sample ends, unmarked, before the output's line 'row 1'"]
    assert unmatched(["environment:", "head", "prefill (no carried state)"], ["environment: x", "head",
                     "prefill (no carried state: never_carried)"]) == [
        "sample line 3 'prefill (no carried state)': the command prints "
        "'prefill (no carried state: never_carried)' there"]


def test_the_readme_sample_is_what_the_bench_prints_with_every_cut_marked(capsys):
    assert main(SMALL) == 0
    output = capsys.readouterr().out.splitlines()
    sample = readme_sample()
    assert sample[0].startswith("environment:") and any(is_marker(line) for line in sample)
    assert unmatched(sample, output) == []


def test_the_readme_explains_the_command_its_sample_ran():
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert first_block.splitlines()[1].endswith("&& trtllm-mtp-carry bench")  # the sample's command, as run
    assert "outputs identical across policies: True" in "\n".join(readme_sample())
