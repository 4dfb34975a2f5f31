"""Command-line value checks shared by `bench` and `chat`.

What it is for: every bad flag value becomes one error line that names the
flag as the user typed it (never an internal field such as
`EngineConfig.prefill_chunk`). The argparse types run at parse time and need
no torch; `resolve_device` imports torch and runs before any model loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..argtypes import positive_int

MAX_DRAFT_LEN = 3  # mirrors engine.config.MAX_DRAFT_LEN, which imports torch
BLOCK = 16  # the reference engine's KV block size; prefill chunks are whole blocks
HOST_VARIANT = "carry-host"
"""The bench policy whose warm turns adopt from the carry store's host tier (`replay.py`'s header)."""


def draft_len(text: str) -> int:
    """argparse type: draft tokens per verify step, 1..3 (`--policies off` runs without drafts)."""
    value = positive_int(text)
    if value > MAX_DRAFT_LEN:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_DRAFT_LEN}, got {value}")
    return value


def prefill_chunk(text: str) -> int:
    """argparse type: a positive multiple of the KV block size (snapshots land on block ends)."""
    value = positive_int(text)
    if value % BLOCK:
        raise argparse.ArgumentTypeError(f"must be a multiple of {BLOCK}, got {value}")
    return value


def resolve_device(text: str, flag: str = "--device") -> Any:
    """The torch device `text` names, or a ValueError naming `flag`: only `cpu` and
    `cuda[:N]` are served, and CUDA must be present."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {text!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{flag} {text!r}: only cpu and cuda[:N] are supported")
    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {text!r}: CUDA is not available on this machine "
                         f"(torch {torch.__version__}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{flag} {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def output_path(path: str | None, flag: str) -> None:
    """A file the run will write must have an existing folder (checked before the run, not after)."""
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {parent} does not exist")
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file name")


def weights_dir(path: str | None, flag: str = "--weights") -> None:
    """A `--weights` folder must hold both files the loader reads."""
    if path is None:
        return
    for name in ("reference.json", "reference.safetensors"):
        if not (Path(path) / name).is_file():
            raise ValueError(f"{flag} {path}: no {name} there")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows a flag's default when it has a real one (not None, not a bare switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("%(default)" in text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return action.help
        return f"{text} (default: %(default)s)"
