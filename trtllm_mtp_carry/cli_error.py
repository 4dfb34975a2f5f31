"""The command line's one error line, shared by every subcommand (torch-free).

Every command reports bad input and failures the same way: one line on
stderr, `trtllm-mtp-carry: error: <message>`, and exit status 2 (no
traceback). The top-level `cli.main` prints it for a ValueError any
subcommand raises; a command that must clean up before it returns (the
`serve` commands stop their servers first) calls `fail` itself. Commands
import this module, never each other, for it.
"""

from __future__ import annotations

import sys

PROG = "trtllm-mtp-carry"
EXIT_ERROR = 2


def fail(message: str) -> int:
    """Print `trtllm-mtp-carry: error: <message>` on stderr; returns the exit status, 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_ERROR
