"""Every default is stated once, in docs/CONFIGURATION.md's "Defaults" table, and equal everywhere (issue 32).

Three checks:
- the table's default of each option equals the code's (`core.settings`, the TensorRT-LLM
  adapter's `CarryOptions`, `trace-replay`'s), and its variable is the setting's;
- the table covers every `TRTLLM_MTP_CARRY_*` setting and every `mtp_carry` key;
- wherever the repository's prose or docstrings state a default in one of the three ways it
  does (`` `X` defaults to V ``, ``env `VAR`, else V``, ``default V, env `VAR` ``), V is the
  table's (README.md, DECISIONS.md, BENCHMARKS.md, docs/, the package's sources).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trtllm_mtp_carry.core import settings
from trtllm_mtp_carry.traces.cli import DEFAULT_REPLAY_MEMORY
from trtllm_mtp_carry.trtllm.options import DEFAULT_CARRY_MEMORY as ADAPTER_DEFAULT_CARRY_MEMORY
from trtllm_mtp_carry.trtllm.options import CarryOptions

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\|\s*`([\w.]+)`[^|]*\|\s*`([^`]+)`[^|]*\|([^|]*)\|")


TABLE = ROOT / "docs" / "CONFIGURATION.md"
"""The page that holds the one table of defaults."""


def readme_defaults(text: str | None = None) -> dict[str, tuple[str, str]]:
    """`{option: (default, variable or '')}` from docs/CONFIGURATION.md's "## Defaults" table."""
    text = TABLE.read_text() if text is None else text
    section = text.split("\n## Defaults\n", 1)[1]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        if line.startswith("#"):
            break
        m = ROW.match(line)
        if m:
            var = re.search(r"`(TRTLLM_MTP_CARRY_\w+)`", m.group(3))
            rows[m.group(1)] = (m.group(2), var.group(1) if var else "")
    return rows


def _switch(on: bool) -> str:
    return "on" if on else "off"


def code_defaults() -> dict[str, str]:
    """Each option's default as the code has it, written as the table writes it."""
    options = CarryOptions()
    adapter_memory = settings.format_bytes(ADAPTER_DEFAULT_CARRY_MEMORY)  # options.carry_memory None: this
    assert settings.format_bytes(settings.parse_carry_memory(DEFAULT_REPLAY_MEMORY).nbytes or 0) == adapter_memory
    return {
        "marconi_min_tokens": str(settings.DEFAULT_MARCONI_MIN_TOKENS),
        "mtp_max_seqs": str(settings.DEFAULT_MTP_MAX_SEQS),
        "carry_slots": str(settings.DEFAULT_CARRY_SLOTS or "none"),
        "carry_memory": settings.DEFAULT_CARRY_MEMORY,
        "mtp_carry.carry_memory": adapter_memory,
        "carry_host_memory": str(settings.DEFAULT_CARRY_HOST_MEMORY),
        "carry_row_dtype": settings.DEFAULT_CARRY_ROW_DTYPE,
        "carry_eviction": settings.DEFAULT_CARRY_EVICTION,
        "carry_idle_s": str(settings.DEFAULT_CARRY_IDLE_S),
        "carry_share": _switch(settings.DEFAULT_CARRY_SHARE),
        "mtp_carry.enable": str(options.enable).lower(),
        "mtp_carry.stats_every": str(options.stats_every),
        "mtp_carry.metrics_port": str(options.metrics_port or "none"),
    }


# How prose may write each default (the first words after "else" / "defaults to" / "default").
SPELLINGS = {
    "marconi_min_tokens": {"256"}, "mtp_max_seqs": {"32"}, "carry_slots": {"none", "no", "0"},
    "carry_memory": {"1.0", "whole"}, "carry_host_memory": {"0", "none", "no"},
    "carry_row_dtype": {"bf16"}, "carry_eviction": {"returns"}, "carry_idle_s": {"600"}, "carry_share": {"on"},
}


def test_the_defaults_table_states_the_codes_defaults():
    table = readme_defaults()
    assert {k: v[0] for k, v in table.items()} == code_defaults()


def test_the_defaults_table_names_each_settings_variable_and_every_mtp_carry_key():
    table = readme_defaults()
    for setting in settings.CARRY_VARIABLES:
        assert table[setting.name][1] == setting.env_var, setting.name
    keys = {f.name for f in dataclasses.fields(CarryOptions)}
    assert keys <= {k.removeprefix("mtp_carry.") for k in table}, keys


def test_the_spellings_cover_the_tables_defaults():
    table = readme_defaults()
    for option, spellings in SPELLINGS.items():
        assert table[option][0] in spellings, option


def _texts() -> list[tuple[str, str]]:
    files = [ROOT / "README.md", ROOT / "DECISIONS.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "trtllm_mtp_carry").rglob("*.py"))]
    return [(str(p.relative_to(ROOT)), " ".join(p.read_text().split())) for p in files]


def stated_defaults(text: str) -> list[tuple[str, str]]:
    """`(option, the first words of the stated default)` for each statement of a default in `text`
    (whitespace already collapsed)."""
    by_var = {s.env_var: s.name for s in settings.CARRY_VARIABLES}
    found = []
    for m in re.finditer(r"(TRTLLM_MTP_CARRY_[A-Z_]+)`?\)?,? else `?([^;:)]*)", text):
        if m.group(1) in by_var:
            found.append((by_var[m.group(1)], m.group(2)))
    for m in re.finditer(r"default `?([^`,;)]+)`?, env `?(TRTLLM_MTP_CARRY_[A-Z_]+)", text):
        if m.group(2) in by_var:
            found.append((by_var[m.group(2)], m.group(1)))
    for m in re.finditer(r"`(\w+)(?:\(\))?` defaults to `?([^;:)]*)", text):
        if m.group(1) in SPELLINGS:
            found.append((m.group(1), m.group(2)))
    return found


def test_the_statement_finder_reads_the_three_forms_and_the_old_contradiction_fails():
    old = ("`carry_slots` unset means `carry_slots()` (env `TRTLLM_MTP_CARRY_SLOTS`, else 16), "
           "as before. `carry_slots` defaults to 16. a cap (default none, env `TRTLLM_MTP_CARRY_SLOTS`;")
    assert stated_defaults(old) == [("carry_slots", "16"), ("carry_slots", "none"), ("carry_slots", "16. a cap (default none, env `TRTLLM_MTP_CARRY_SLOTS`")]
    assert [_agrees(o, w) for o, w in stated_defaults(old)] == [False, True, False]


def _agrees(option: str, words: str) -> bool:
    first = re.findall(r"[\w.'-]+", words)[:3]
    return bool(SPELLINGS[option] & {w.strip("`.'") for w in first})


@pytest.mark.parametrize("path,text", _texts(), ids=[p for p, _ in _texts()])
def test_every_stated_default_equals_the_tables(path, text):
    wrong = [(option, words[:60]) for option, words in stated_defaults(text) if not _agrees(option, words)]
    assert wrong == [], f"{path} states a default the table of docs/CONFIGURATION.md does not"
