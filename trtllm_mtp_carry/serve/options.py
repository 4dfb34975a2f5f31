"""The served model's options: one typed record, parsed from Triton's `parameters`.

What it is for: `config.pbtxt` carries every runtime option as a string
parameter; `ServeOptions.from_parameters` turns them into typed values or
raises one ValueError naming the parameter and its value, so a bad repository
fails the model's load with a message an operator can act on. The same record
writes the parameters back (`as_parameters`), so the generator and the model
cannot disagree on names. Pure Python: importing this loads no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..core import settings

POLICIES = ("carry", "rebuild", "blind", "off")
ENGINES = ("reference",)  # the TensorRT-LLM engine registers here (serve/engines.py)
MAX_DRAFT_LEN = 3  # the reference engine's EngineConfig bound


@dataclass(frozen=True)
class ServeOptions:
    """Every option of the served model; `None` means "the engine's own default"."""

    engine: str = "reference"
    drafter_policy: str = "carry"
    draft_len: int = 2
    marconi_min_tokens: int | None = None
    carry_slots: int | None = None
    carry_memory: str | None = None  # "4GiB", "512MiB" or a drafter pool fraction "0.5"
    carry_host_memory: str | None = None  # "8GiB", "512MiB", "0": the carry store's host tier
    carry_eviction: str | None = None  # one of core.settings.EVICTION_POLICIES (returns, incumbent, lrd, slru)
    carry_idle_s: int | None = None  # 0: carried entries never expire
    carry_share: str | None = None  # on/off: carried entries share equal common-prefix blocks
    carry_row_dtype: str | None = None  # bf16/fp8/nvfp4: how carried rows are stored (core/row_format.py)
    max_model_len: int | None = None
    max_tokens: int = 64  # used when a request sends no max_tokens
    max_num_seqs: int = 8
    device: str = "cpu"
    max_turn_s: int = 300  # a turn unfinished this long after it arrived is cancelled (session_server)

    def __post_init__(self) -> None:
        _choice("engine", self.engine, ENGINES)
        _choice("drafter_policy", self.drafter_policy, POLICIES)
        if not 0 <= _int("draft_len", self.draft_len) <= MAX_DRAFT_LEN:
            raise ValueError(f"parameter draft_len must be in [0, {MAX_DRAFT_LEN}], got {self.draft_len!r}")
        if self.carry_memory is not None:
            from ..core.settings import parse_carry_memory

            parse_carry_memory(self.carry_memory, what="parameter carry_memory")
        if self.carry_host_memory is not None:
            from ..core.settings import parse_carry_host_memory

            parse_carry_host_memory(self.carry_host_memory, what="parameter carry_host_memory")
        if self.carry_eviction is not None:
            from ..core.settings import check_eviction_policy

            check_eviction_policy(self.carry_eviction, what="parameter carry_eviction")
        if self.carry_row_dtype is not None:
            from ..core.row_format import check_row_dtype

            check_row_dtype(self.carry_row_dtype, what="parameter carry_row_dtype")
        if self.carry_share is not None:
            from ..core.settings import parse_switch

            parse_switch(self.carry_share, what="parameter carry_share")
        for name in ("marconi_min_tokens", "carry_idle_s"):
            value = getattr(self, name)
            if value is not None and _int(name, value) < 0:
                raise ValueError(f"parameter {name} must be >= 0, got {value!r}")
        for name in ("carry_slots", "max_model_len"):
            value = getattr(self, name)
            if value is not None and _int(name, value) <= 0:
                raise ValueError(f"parameter {name} must be >= 1, got {value!r}")
        for name in ("max_tokens", "max_num_seqs", "max_turn_s"):
            if _int(name, getattr(self, name)) <= 0:
                raise ValueError(f"parameter {name} must be >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"parameter device must be a device name like cpu or cuda, got {self.device!r}")

    @classmethod
    def from_parameters(cls, parameters: dict[str, Any]) -> ServeOptions:
        """Options from Triton's `parameters` (`{key: {"string_value": s}}` or `{key: s}`).

        Unknown keys and malformed values raise ValueError naming the key; an
        empty string means "default", as Triton has no null.
        """
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in parameters.items():
            text = raw.get("string_value", "") if isinstance(raw, dict) else raw
            if key not in known:
                raise ValueError(f"unknown parameter {key!r}; known: {', '.join(known)}")
            if not isinstance(text, str):
                raise ValueError(f"parameter {key} must be a string, got {text!r}")
            text = text.strip()
            if text == "":
                continue
            if known[key].type in ("str", "str | None"):
                values[key] = text
                continue
            try:
                values[key] = int(text)
            except ValueError:
                raise ValueError(f"parameter {key} must be an integer, got {text!r}") from None
        return cls(**values)

    def as_parameters(self) -> dict[str, str]:
        """The options as Triton string parameters (`""` for an engine default)."""
        return {f.name: "" if getattr(self, f.name) is None else str(getattr(self, f.name))
                for f in fields(self)}


CARRY_FLAGS: tuple[tuple[str, str, str], ...] = (
    # (ServeOptions field, the serve flags' dest or "" when serve has no flag, the variable's name)
    ("marconi_min_tokens", "serve_marconi_min_tokens", settings.ENV_MARCONI_MIN_TOKENS),
    ("carry_slots", "serve_carry_slots", settings.ENV_CARRY_SLOTS),
    ("carry_memory", "serve_carry_memory", settings.ENV_CARRY_MEMORY),
    ("carry_host_memory", "serve_carry_host_memory", settings.ENV_CARRY_HOST_MEMORY),
    ("carry_row_dtype", "serve_carry_row_dtype", settings.ENV_CARRY_ROW_DTYPE),
    ("carry_eviction", "", settings.ENV_CARRY_EVICTION),
    ("carry_idle_s", "", settings.ENV_CARRY_IDLE_S),
    ("carry_share", "", settings.ENV_CARRY_SHARE),
)
"""The served model's carry options and where `triton-repo`/`serve` take each from."""


def carry_options(args: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The carry options of `triton-repo`/`serve` (and `serve --dynamo`): each flag given, else
    its `TRTLLM_MTP_CARRY_*` variable (so the written repository records it), else None (the
    engine's default). The command line has checked every variable already
    (`core.settings.check_environment`); a value ServeOptions refuses names the parameter."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for field, dest, var in CARRY_FLAGS:
        value = getattr(args, dest, None) if dest else None
        if value is None and env.get(var) is not None:
            raw = env[var].strip()
            value = int(raw) if field in _INT_FIELDS else raw
        out[field] = value
    return out


_INT_FIELDS = ("marconi_min_tokens", "carry_slots", "carry_idle_s")


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"parameter {name} must be an integer, got {value!r}")
    return value


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"parameter {name} must be one of {', '.join(choices)}, got {value!r}")
