"""The engine seam of the served model: one small interface, one factory per engine.

What it is for: the Triton model drives whatever `ServingEngine` the
`engine` parameter names. `reference` is the shipped reference engine with
the carry runtime; the TensorRT-LLM engine plugs in later by adding one
factory to `ENGINE_FACTORIES` (and its name to `options.ENGINES`).

Ownership: the factory applies the process-wide settings (restore threshold,
carry slots) before the engine reads them. A Triton model instance is its own
process, so each instance pins its own settings and owns its own engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .options import ServeOptions


class ServingRuntime(Protocol):
    """The carry runtime as the server sees it: counters and session end."""

    def stats(self) -> Any: ...

    def forget_session(self, session_hash: int) -> int: ...


class ServingEngine(Protocol):
    """What the served model needs of an engine (the reference engine's public API).

    `submit` raises ValueError/TypeError naming bad input; `step` advances
    every running request one unit and returns the finished ones (TurnResult);
    `output_so_far` gives a running request's verified tokens, for streaming.
    """

    @property
    def tokenizer(self) -> Any: ...

    @property
    def runtime(self) -> ServingRuntime: ...

    def submit(self, session_id: int, prompt: Sequence[int] | list[dict[str, str]],
               max_new_tokens: int, draft_len: int | None = None,
               policy: str | None = None, cache_salt: bytes | str | None = None) -> int: ...

    def step(self) -> list[Any]: ...

    def cancel(self, request_id: int) -> Any: ...

    def output_so_far(self, request_id: int) -> list[int] | None: ...

    def has_unfinished(self) -> bool: ...


def apply_settings(options: ServeOptions) -> None:
    """Pin the process-wide settings the options name; ValueError naming the parameter
    when one is already pinned to another value or this build lacks it."""
    from .. import core

    if options.marconi_min_tokens is not None:
        if (not core.set_marconi_min_tokens(options.marconi_min_tokens)
                and core.marconi_min_tokens() != options.marconi_min_tokens):
            raise ValueError(
                f"parameter marconi_min_tokens={options.marconi_min_tokens} could not be applied: "
                f"already pinned to {core.marconi_min_tokens()} in this process"
            )
    if options.carry_slots is not None:
        if not core.set_carry_slots(options.carry_slots) and core.carry_slots() != options.carry_slots:
            raise ValueError(
                f"parameter carry_slots={options.carry_slots} could not be applied: "
                f"already pinned to {core.carry_slots() or 'no cap'} in this process"
            )
    _apply_carry_store_settings(options)


def _apply_carry_store_settings(options: ServeOptions) -> None:
    """Pin carry_memory, carry_host_memory, carry_eviction, carry_idle_s, carry_row_dtype and carry_share; ValueError
    naming one that is already pinned to another value in this process."""
    from ..core import settings

    pins: list[tuple[str, object, Any, Any]] = [
        ("carry_memory", options.carry_memory and settings.parse_carry_memory(options.carry_memory),
         settings.set_carry_memory, settings.carry_memory),
        ("carry_host_memory", options.carry_host_memory and settings.parse_carry_host_memory(
            options.carry_host_memory), settings.set_carry_host_memory, settings.carry_host_memory),
        ("carry_eviction", options.carry_eviction, settings.set_carry_eviction, settings.carry_eviction),
        ("carry_idle_s", options.carry_idle_s, settings.set_carry_idle_s, settings.carry_idle_s),
        ("carry_row_dtype", options.carry_row_dtype, settings.set_carry_row_dtype, settings.carry_row_dtype),
        ("carry_share", options.carry_share and settings.parse_switch(options.carry_share, "carry_share"),
         settings.set_carry_share, settings.carry_share),
    ]
    for name, value, setter, getter in pins:
        if value is not None and not setter(value, source=f"parameter {name}") and getter() != value:
            raise ValueError(f"parameter {name}={getattr(options, name)} could not be applied: "
                             f"already pinned to {getter()} in this process")


def reference_engine(options: ServeOptions) -> ServingEngine:
    """The reference engine over the shipped weights, configured by `options`."""
    from ..engine.engine import ReferenceEngine

    apply_settings(options)
    config: dict[str, Any] = {
        "policy": options.drafter_policy, "draft_len": options.draft_len,
        "max_num_seqs": options.max_num_seqs, "device": options.device,
    }
    if options.max_model_len is not None:
        config["max_model_len"] = options.max_model_len
    engine: ServingEngine = ReferenceEngine.from_pretrained(**config)
    return engine


ENGINE_FACTORIES: dict[str, Callable[[ServeOptions], ServingEngine]] = {
    "reference": reference_engine,
}


def build_engine(options: ServeOptions) -> ServingEngine:
    """The engine `options.engine` names (ValueError naming the parameter otherwise)."""
    factory = ENGINE_FACTORIES.get(options.engine)
    if factory is None:
        raise ValueError(f"parameter engine must be one of {', '.join(ENGINE_FACTORIES)}, "
                         f"got {options.engine!r}")
    return factory(options)
