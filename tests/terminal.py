"""A pseudo-terminal for a child's stderr: what a user sees when a command runs on a terminal.

`Terminal()` opens a 100-column pty and drains what is written to it on a thread;
give `terminal.fd` to the child as its stderr, then `terminal.close()` (once the child
is done) returns everything it wrote there.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import termios
import threading


class Terminal:
    def __init__(self, columns: int = 100) -> None:
        self._master, self.fd = pty.openpty()
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._master, 4096)
            except OSError:  # the other end closed
                return
            if not data:
                return
            self._chunks.append(data)

    def close(self) -> str:
        """Close the child's end, wait for the last bytes; what was written, decoded."""
        os.close(self.fd)
        self._reader.join(timeout=10)
        os.close(self._master)
        return b"".join(self._chunks).decode(errors="replace")
