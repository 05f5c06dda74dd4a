"""Processes of a local multi-process job: start, watch, stop, relay output.

:func:`launch` starts one child per simulated host with the environment of
:func:`process_env`, relays each child's output line by line with its index as
prefix (:class:`zeropp_jax.cli._output._Output`), waits for the children
(:func:`_watch`) and, on the first failure, a stalled or never-started
process (:class:`zeropp_jax.heartbeat.Monitor`), a timeout or a stop signal to
the launcher, stops all of them (:func:`_stop`: SIGTERM to each child's
process group, SIGKILL after a grace period). If the launcher itself dies,
its children die too (:func:`_set_parent_death_signal`, and the heartbeat
pipe). ``zeropp_jax.cli.launch`` is the command line around it.
"""

from __future__ import annotations

import functools
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Sequence

from zeropp_jax import distributed
from zeropp_jax.cli._output import _Output
from zeropp_jax.heartbeat import Monitor

HOST = "127.0.0.1"
POLL_S = 0.05
# A process in a jax.distributed job takes SIGTERM as a preemption notice (JAX's
# preemption notifier catches it): zeropp-train then checkpoints at the next
# step and exits (zeropp_jax.distributed.PreemptionNotice); SIGKILL follows
# after this grace (a big model's checkpoint may need a longer --kill-grace).
DEFAULT_KILL_GRACE_S = 5.0
# Exit status when --timeout expires (as timeout(1) does).
TIMEOUT_EXIT = 124
# Seconds without a heartbeat after which a running process counts as stalled:
# shorter than JAX's heartbeat timeout (distributed.DEFAULT_HEARTBEAT_TIMEOUT_S),
# so that the launcher names it before its peers abort with a C++ stack trace.
DEFAULT_STALL_TIMEOUT_S = 20.0
# Seconds after a peer's first heartbeat within which every process must beat.
DEFAULT_START_TIMEOUT_S = 30.0
# Exit status when a process stalled or did not start.
STALL_EXIT = 1
# When a process fails, a peer silent this long is named as the cause: peers
# waiting in a collective keep beating, and a lost peer makes them abort.
STALE_EVIDENCE_S = 10.0
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def with_device_count(xla_flags: str, count: int | None) -> str:
    """``xla_flags`` with its host device count set to ``count`` (removed if
    ``None``); every other flag is kept, in order."""
    flags = _DEVICE_COUNT_FLAG.sub("", xla_flags).split()
    if count:
        flags.append(f"--xla_force_host_platform_device_count={count}")
    return " ".join(flags)


# The coordinator's port is drawn from these, below Linux's default range of
# ephemeral ports (those the kernel hands to outgoing connections).
_COORDINATOR_PORTS = range(20000, 32768)
_LINUX_DEFAULT_EPHEMERAL = (32768, 60999)  # net.ipv4.ip_local_port_range's default


def free_port(host: str = HOST) -> int:
    """A TCP port that is free now, for the coordinator to bind.

    Taken from :data:`_COORDINATOR_PORTS` outside the kernel's ephemeral
    range where possible: the processes need a few seconds to start, and
    meanwhile an ephemeral port could be handed to another connection (gloo
    opens many).
    """
    low, high = _ephemeral_range()
    candidates = [p for p in _COORDINATOR_PORTS if not low <= p <= high]
    for port in random.sample(candidates, min(len(candidates), 50)):
        if distributed.bind_error(host, port) is None:
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, from ``/proc``; where that cannot
    be read (not Linux, a sandbox), :data:`_LINUX_DEFAULT_EPHEMERAL`."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return _LINUX_DEFAULT_EPHEMERAL


def process_env(
    base: dict[str, str], *, coordinator: str, num_processes: int, process_id: int,
    devices_per_process: int,
) -> dict[str, str]:
    """The environment of process ``process_id``."""
    env = dict(base)
    # Another launcher's variables would make JAX look for a cluster that is
    # not there (zeropp's own variables take precedence, but JAX's auto-detect
    # does not know them).
    for name in ("SLURM_NTASKS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        env.pop(name, None)
    env.update({
        distributed.ENV_COORDINATOR: coordinator,
        distributed.ENV_NUM_PROCESSES: str(num_processes),
        distributed.ENV_PROCESS_ID: str(process_id),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": with_device_count(env.get("XLA_FLAGS", ""), devices_per_process),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def describe_status(returncode: int) -> str:
    """``exited with code 3`` / ``was killed by signal 9 (SIGKILL)``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _set_parent_death_signal(parent: int | None = None) -> None:
    """A ``preexec_fn`` (Linux): the child gets SIGKILL when the launcher dies.

    SIGKILL, not SIGTERM: a process in a ``jax.distributed`` job takes SIGTERM
    as a preemption notice and runs on. The signal follows the thread that
    started the child, so :func:`launch` must run in a thread that lives as
    long as the launch (the command line calls it in the main thread). It
    reaches the child only; a zeropp process further down (under a shell, say)
    stops when its heartbeat pipe breaks (:mod:`zeropp_jax.heartbeat`).

    Args:
      parent: the launcher's pid; if the child's parent is already another
        process, the launcher died before the signal was set, and the child
        exits.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)


class _Stop(Exception):
    """Raised in the main thread when the launcher gets SIGTERM / SIGHUP."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int = 1,
    timeout_s: float | None = None,
    kill_grace_s: float = DEFAULT_KILL_GRACE_S,
    port: int | None = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    start_timeout_s: float | None = DEFAULT_START_TIMEOUT_S,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
) -> int:
    """Runs ``command`` as ``num_processes`` local processes; returns an exit status.

    Args:
      command: program and arguments, the same for every process.
      num_processes: how many processes (>= 1).
      devices_per_process: simulated CPU devices in each process.
      timeout_s: stop everything after this many seconds (status 124).
      kill_grace_s: seconds from SIGTERM to SIGKILL when stopping processes.
      port: coordinator port (default: a free one).
      stall_timeout_s: a running process whose heartbeat is this many seconds
        old has stalled: all are stopped and it is named (``None``: never).
      start_timeout_s: a process with no heartbeat this many seconds after a
        peer's first did not start: all are stopped and it is named
        (``None``: never). Only processes that call
        :func:`zeropp_jax.distributed.initialize` beat; while none has, no
        process is judged.
      stdout, stderr: binary streams for the prefixed output (default: ours).

    Raises:
      ValueError: a bad argument, or ``port`` is already in use (checked
        before any process starts).

    Returns:
      0 if every process exited with status 0; otherwise the exit code of the
      first process seen to fail (128 + N if it was killed by signal N), 1
      when a process stalled or did not start (also when a process failed
      while a peer had stalled), 124 on timeout, 128 + N when the launcher
      got signal N (130 on Ctrl-C, 143 on SIGTERM, 129 on SIGHUP).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
    if not command:
        raise ValueError("no command to run")
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock:
            stderr.write(f"zeropp-launch: {message}\n".encode())
            stderr.flush()

    if port is not None and distributed.bind_error(HOST, port) is not None:
        raise ValueError(
            f"coordinator port {port} on {HOST} is in use; pick another --port, or leave "
            "it out for a free one"
        )
    coordinator = f"{HOST}:{port or free_port()}"
    procs: list[subprocess.Popen] = []
    outputs: list[_Output] = []
    received: list[int] = []
    monitor = Monitor(num_processes, stall_timeout_s=stall_timeout_s,
                      start_timeout_s=start_timeout_s, stale_evidence_s=STALE_EVIDENCE_S)
    previous = _install_stop_handlers(received)
    try:
        for i in range(num_processes):
            env = process_env(
                os.environ, coordinator=coordinator, num_processes=num_processes,
                process_id=i, devices_per_process=devices_per_process,
            )
            env.update(monitor.child_env(i))
            try:
                procs.append(subprocess.Popen(
                    list(command), env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    # Own process group: Ctrl-C reaches only the launcher, which
                    # then stops each child's whole tree.
                    start_new_session=True, pass_fds=monitor.child_fds(i),
                    preexec_fn=(functools.partial(_set_parent_death_signal, os.getpid())
                                if sys.platform == "linux" else None),
                ))
            except OSError as e:
                say(f"cannot start {command[0]!r}: {e}")
                _stop(procs, kill_grace_s)
                return 127 if isinstance(e, FileNotFoundError) else 126
        monitor.started()
        # Readers start after every fork (preexec_fn and threads do not mix).
        for i, p in enumerate(procs):
            prefix = f"[{i}] ".encode()
            outputs.append(_Output(p.stdout, stdout, prefix, lock))
            outputs.append(_Output(p.stderr, stderr, prefix, lock))
        say(
            f"{num_processes} process(es) x {devices_per_process} CPU device(s), "
            f"coordinator {coordinator}, pids "
            + " ".join(f"[{i}]={p.pid}" for i, p in enumerate(procs))
        )
        status = _watch(procs, timeout_s, kill_grace_s, say, received, monitor)
    except (KeyboardInterrupt, _Stop) as e:
        signum = signal.SIGINT if isinstance(e, KeyboardInterrupt) else e.signum
        what = ("interrupted (Ctrl-C)" if signum == signal.SIGINT
                else f"got {signal.Signals(signum).name}")
        say(f"{what}; stopping all {len(procs)} process(es)")
        running = [j for j, p in enumerate(procs) if p.poll() is None]
        _stop(procs, kill_grace_s)
        say("stopped: " + _ended(procs, range(len(procs)), running))
        status = 128 + int(signum)
    finally:
        _restore_handlers(previous)
        for p in procs:
            if p.poll() is None:  # only on an unexpected error in the launcher
                _signal(p, signal.SIGKILL)
                p.wait()
        monitor.close()
        for out in outputs:
            out.thread.join(timeout=5)
        for p in procs:
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()
    return status


def _watch(procs, timeout_s, kill_grace_s, say, received=(), monitor=None) -> int:
    """Waits for all processes; on the first failure stops the rest.

    One thread per process waits for its exit, so exits are seen in the order
    they happen: the process that failed first is named, not a peer that
    failed a moment later because of it. A process whose heartbeat went stale
    is named before any that failed after it (peers abort when JAX declares a
    silent process dead).
    """
    exits: queue.Queue[int] = queue.Queue()

    def wait(i: int) -> None:
        procs[i].wait()
        exits.put(i)

    for i in range(len(procs)):
        threading.Thread(target=wait, args=(i,), daemon=True).start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    exited: list[int] = []
    while len(exited) < len(procs):
        try:
            # Short waits keep Ctrl-C and SIGTERM responsive.
            i = exits.get(timeout=0.5 if deadline is None
                          else max(min(0.5, deadline - time.monotonic()), 0.0))
        except queue.Empty:
            if received:
                raise _stop_exception(received[0])
            running = [j for j in range(len(procs)) if j not in exited]
            if deadline is not None and time.monotonic() >= deadline:
                say(f"timed out after {timeout_s:g} s; stopping process(es) "
                    + ", ".join(map(str, running)))
                _stop(procs, kill_grace_s)
                return TIMEOUT_EXIT
            if monitor is not None and (verdict := monitor.verdict(running)):
                return _fail(procs, *verdict, running, kill_grace_s, say, STALL_EXIT)
            continue
        exited.append(i)
        code = procs[i].returncode
        if code == 0:
            continue
        running = [j for j in range(len(procs)) if j not in exited]
        if monitor is not None and (stalled := monitor.stalled_peer(running)):
            say(f"process {i} (pid {procs[i].pid}) {describe_status(code)} after process "
                f"{stalled[0]} {stalled[1]}")
            return _fail(procs, *stalled, running, kill_grace_s, say, STALL_EXIT)
        return _fail(procs, i, describe_status(code), running, kill_grace_s, say,
                     _exit_status(code))
    return 0


def _fail(procs, i: int, cause: str, running, kill_grace_s, say, status: int) -> int:
    """Names process ``i`` and ``cause``, stops every process, sums up; returns ``status``."""
    others = [j for j in running if j != i]
    say(f"process {i} (pid {procs[i].pid}) {cause}"
        + (f"; stopping the other {len(others)} process(es)" if others else ""))
    _stop(procs, kill_grace_s)
    rest = [j for j in range(len(procs)) if j != i]
    say(f"FAILED: process {i} {cause}"
        + (f"; others: {_ended(procs, rest, running)}" if rest else ""))
    return status


def _ended(procs, which, running) -> str:
    """How processes ``which`` ended, ``[j] exited with code 0, ...``; one of
    ``running`` (indices running when the launcher stopped them) that ended
    by the stop is marked so: killed by the signal, or (zeropp-train) stopped
    on it as a preemption notice."""
    stopped = (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM)
    return ", ".join(
        f"[{j}] {describe_status(procs[j].returncode)}"
        + (" (stopped by zeropp-launch)" if j in running and procs[j].returncode in stopped
           else "")
        for j in which)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """Sends ``sig`` to the child's process group (the child and its children)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _stop(procs: Sequence[subprocess.Popen], kill_grace_s: float) -> None:
    """SIGTERM to every running process, SIGKILL after the grace period."""
    for p in procs:
        _signal(p, signal.SIGTERM)
        _signal(p, signal.SIGCONT)  # a stopped process handles SIGTERM only once continued
    deadline = time.monotonic() + kill_grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for p in procs:
        _signal(p, signal.SIGKILL)
    for p in procs:
        p.wait()


def _install_stop_handlers(received: list):
    """Ctrl-C, SIGTERM and SIGHUP to the launcher stop the children.

    The handler raises in the main thread and also records the signal in
    ``received``, which :func:`_watch` checks between waits: an exception
    raised while Python runs a garbage-collection callback (JAX registers
    one) is printed and swallowed, so raising alone can lose the signal.
    SIGINT is handled explicitly even when the launcher was started with it
    ignored (a background job of a non-interactive shell).
    """
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        received.append(signum)
        raise _stop_exception(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _stop_exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else _Stop(signum)


def _restore_handlers(previous) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)
