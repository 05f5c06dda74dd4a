"""Heartbeats from the processes of a ``zeropp-launch`` job to the launcher.

``zeropp-launch`` gives each process the write end of a pipe of its own and
names it in the environment as ``ZEROPP_HEARTBEAT=FD:INODE`` (the inode tells
a process that the descriptor really is that pipe, not something else that
reuses the number). :func:`start`, called by
:func:`zeropp_jax.distributed.initialize`, runs a daemon thread that writes
:data:`BEAT` to it every :data:`INTERVAL_S` seconds, and :data:`DONE` when
the interpreter exits normally (the process has finished its work).

The thread beats while the main thread waits in a collective or compiles
(XLA releases the GIL then), so peers that wait for a lost process keep
beating; a process that is stopped (SIGSTOP, a frozen host) or hung before it
reaches ``initialize`` does not. :class:`Monitor` is the launcher's end: it
reads the pipes and names the process whose heartbeat went stale, or that
never beat while its peers did.

The pipe also tells a process that its launcher is gone: when the launcher
dies, even by SIGKILL, the read end closes and the next beat fails with
``EPIPE``; the thread then kills the process's group (the launcher starts
each process in a group of its own), so no process of the job runs on with
nobody reading its output.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

ENV_HEARTBEAT = "ZEROPP_HEARTBEAT"
# Seconds between beats.
INTERVAL_S = 1.0
BEAT = b"."
DONE = b"!"

_started = threading.Event()


def start() -> bool:
    """Starts beating to the launcher's pipe named by ``ZEROPP_HEARTBEAT``.

    Does nothing (returns ``False``) outside ``zeropp-launch``, when the
    variable names no open pipe of that inode, or when already started.

    Raises:
      ValueError: ``ZEROPP_HEARTBEAT`` is set but is not ``FD:INODE``.
    """
    text = os.environ.get(ENV_HEARTBEAT)
    if not text or _started.is_set():
        return False
    try:
        fd, inode = map(int, text.split(":"))
    except ValueError:
        raise ValueError(f"{ENV_HEARTBEAT} must be FD:INODE (two integers), got {text!r}") from None
    try:
        if os.fstat(fd).st_ino != inode:
            return False  # the launcher's pipe was not inherited; the number is reused
        os.set_blocking(fd, False)  # a launcher that does not read must not block us
    except OSError:
        return False
    _started.set()
    stop = threading.Event()
    _beat_once(fd)  # at once: the launcher learns that this process got here
    threading.Thread(target=_beat, args=(fd, stop), name="zeropp-heartbeat", daemon=True).start()
    atexit.register(_finish, fd, stop)
    return True


def _beat(fd: int, stop: threading.Event) -> None:
    while not stop.wait(INTERVAL_S):
        _beat_once(fd)


def _beat_once(fd: int) -> None:
    if not _write(fd, BEAT):
        _launcher_gone()


def _write(fd: int, data: bytes) -> bool:
    """Writes ``data``; ``False`` once nobody can read the pipe any more."""
    try:
        os.write(fd, data)
    except BlockingIOError:  # the launcher is slow to read (or paused): skip a beat
        pass
    except OSError:  # EPIPE, or the descriptor was closed under us
        return False
    return True


def _finish(fd: int, stop: threading.Event) -> None:
    stop.set()
    _write(fd, DONE)


def _launcher_gone() -> None:
    try:
        sys.stderr.write("zeropp_jax: zeropp-launch is gone; stopping this process\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


class Monitor:
    """The launcher's end of ``num_processes`` heartbeat pipes, and its verdicts.

    A beat counts when the launcher reads it, just before a verdict, so a
    launcher that was itself paused reads the beats it missed before it
    judges. Only processes that call :func:`start` beat; while none has, no
    process is judged.

    Usage: :meth:`child_env` and :meth:`child_fds` when starting process
    ``i``, :meth:`started` once all are started, then :meth:`verdict` and
    :meth:`stalled_peer` in the watch loop, :meth:`close` at the end.

    Args:
      num_processes: how many processes.
      stall_timeout_s: a running process whose latest beat is older than
        this has stalled (``None``: never judged so).
      start_timeout_s: a running process that has not beaten this long after
        a peer's first beat did not start (``None``: never judged so).
      stale_evidence_s: when a process fails, a running peer silent this long
        is named as the cause instead (:meth:`stalled_peer`).
    """

    def __init__(self, num_processes: int, *, stall_timeout_s: float | None = None,
                 start_timeout_s: float | None = None, stale_evidence_s: float = 10.0):
        self.stall_s, self.start_s, self.evidence_s = stall_timeout_s, start_timeout_s, stale_evidence_s
        self._read: list[int | None] = []
        self._write: list[int | None] = []
        for _ in range(num_processes):
            r, w = os.pipe()
            os.set_blocking(r, False)
            self._read.append(r)
            self._write.append(w)
        self.first: list[float | None] = [None] * num_processes  # time of the first beat
        self.last: list[float | None] = [None] * num_processes  # time of the latest beat
        self.done = [False] * num_processes  # finished its work: no longer watched

    def child_env(self, i: int) -> dict[str, str]:
        w = self._write[i]
        return {ENV_HEARTBEAT: f"{w}:{os.fstat(w).st_ino}"}

    def child_fds(self, i: int) -> tuple[int, ...]:
        return (self._write[i],)

    def started(self) -> None:
        """Closes the launcher's copies of the write ends (the children hold theirs)."""
        for i, w in enumerate(self._write):
            if w is not None:
                os.close(w)
                self._write[i] = None

    def verdict(self, running: list[int]) -> tuple[int, str] | None:
        """``(process, cause)`` for a process in ``running`` that stalled or did not
        start, else ``None``."""
        now = self._poll()
        if self.stall_s is not None and (late := self._silent(running, self.stall_s, now)):
            return late[0], self._stalled(late[0], now)
        beaten = [j for j, t in enumerate(self.first) if t is not None]
        if self.start_s is None or not beaten:
            return None
        earliest = min(beaten, key=lambda j: self.first[j])
        waited = now - self.first[earliest]
        absent = [i for i in running if self.first[i] is None]
        if waited > self.start_s and absent:
            return absent[0], (
                f"did not start: no heartbeat {waited:.0f} s after process {earliest}'s "
                "first (it has not reached zeropp_jax.distributed.initialize)"
            )
        return None

    def stalled_peer(self, running: list[int]) -> tuple[int, str] | None:
        """``(process, cause)`` for the process in ``running`` whose heartbeat is the
        stalest if over ``stale_evidence_s`` old, else ``None``."""
        now = self._poll()
        late = self._silent(running, self.evidence_s, now)
        return (late[0], self._stalled(late[0], now)) if late else None

    def _poll(self) -> float:
        """Reads every beat that has arrived; returns the time they count at."""
        now = time.monotonic()
        for i, r in enumerate(self._read):
            if r is None:
                continue
            data = b""
            try:
                while chunk := os.read(r, 4096):
                    data += chunk
                else:  # end of file: the process and all holders of its pipe exited
                    os.close(r)
                    self._read[i] = None
            except BlockingIOError:
                pass
            if data:
                self.first[i] = self.first[i] or now
                self.last[i] = now
                self.done[i] = self.done[i] or DONE in data
        return now

    def _silent(self, running: list[int], seconds: float, now: float) -> list[int]:
        """Processes in ``running`` whose latest beat is over ``seconds`` old, stalest first."""
        late = [i for i in running
                if self.last[i] is not None and not self.done[i] and now - self.last[i] > seconds]
        return sorted(late, key=lambda i: self.last[i])

    def _stalled(self, i: int, now: float) -> str:
        return f"stalled (no heartbeat for {now - self.last[i]:.0f} s)"

    def close(self) -> None:
        self.started()
        for i, r in enumerate(self._read):
            if r is not None:
                os.close(r)
                self._read[i] = None
