"""The carry's CUDA stream and event calls, in one place.

What it is for: the host tier's copy back runs on a side stream with an event the reader's
stream waits for; the drafter pool imports host rows into fresh blocks on that side stream
(`DrafterKVPool.import_carried`); an arena range a scatter read is reused after an event; TensorRT-LLM's
resource manager queues the carry's copies on the draft pool's stream. Every such call goes
through this module, so CPU tests put one recorder in its place and check the order the
service and the executors issue them in.

Invariant: nothing here is called where the rows are not on a GPU, except through a test's
recorder.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["after_current", "cuda_available", "current_stream", "on_stream", "record_stream", "side_stream",
           "timing_event"]


def cuda_available() -> bool:
    return torch.cuda.is_available()


def current_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def on_stream(stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
    return torch.cuda.stream(stream)


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def record_stream(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator `stream` reads `t` (its memory is not reused before that work)."""
    t.record_stream(stream)


def after_current(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on `device`'s current stream (CUDA), else None."""
    if device.type != "cuda":
        return None
    done = torch.cuda.Event()
    done.record(current_stream(device))
    return done
