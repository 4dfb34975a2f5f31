"""The one progress bar every long command draws (tqdm), and where it draws it.

Invariant: a bar is drawn only when its stream is a terminal. Output sent to a
pipe or a file (a CI log, `| tee`, `> run.log`) gets no bar at all, so logs hold
the command's lines and nothing else; `--no-progress` turns it off on a terminal
too. Commands validate every option before the bar starts, so an error is the
one `trtllm-mtp-carry: error:` line with nothing before it.
"""

from __future__ import annotations

import sys
from typing import IO, Any


def shows_progress(stream: IO[str] | None = None, off: bool = False) -> bool:
    """Whether a bar would be drawn on `stream` (default stderr): a terminal, and not turned `off`."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not off and callable(isatty) and bool(isatty())


def progress(total: int | None, desc: str, unit: str, off: bool = False, stream: IO[str] | None = None) -> Any:
    """A tqdm bar of `total` `unit`s on `stream` (default stderr), disabled unless
    `shows_progress(stream, off)`; use it as tqdm (`update`, `close`, a context manager)."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not shows_progress(stream, off))


__all__ = ["progress", "shows_progress"]
