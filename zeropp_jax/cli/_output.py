"""Relaying a child process's output line by line, each line prefixed.

``zeropp-launch`` copies each process's stdout and stderr to its own with the
prefix ``[i] ``; :class:`_Output` is one such copy, running in a thread.
"""

from __future__ import annotations

import re
import threading
from typing import BinaryIO

_LINE_END = re.compile(rb"[\r\n]")


class _Output:
    """Copies one child pipe to our stream, prefixing every line.

    A carriage return ends a line too (progress bars redraw in place), and is
    kept, so a bar still redraws on a terminal.
    """

    def __init__(self, pipe: BinaryIO, out: BinaryIO, prefix: bytes, lock: threading.Lock):
        self._pipe, self._out, self._prefix, self._lock = pipe, out, prefix, lock
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending = b""
        read = getattr(self._pipe, "read1", self._pipe.read)
        try:
            while chunk := read(65536):
                pending += chunk
                pieces, pending = _split_lines(pending)
                self._write(pieces)
            if pending:
                self._write([pending + b"\n"])
        except (OSError, ValueError):  # pipe closed under us at shutdown
            pass

    def _write(self, pieces: list[bytes]) -> None:
        if not pieces:
            return
        data = b"".join(self._prefix + p for p in pieces)
        with self._lock:
            try:
                self._out.write(data)
                self._out.flush()
            except (OSError, ValueError):
                pass


def _split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """Splits after each ``\\n`` or ``\\r``; returns (complete lines, rest)."""
    pieces, start = [], 0
    for match in _LINE_END.finditer(data):
        pieces.append(data[start:match.end()])
        start = match.end()
    return pieces, data[start:]

