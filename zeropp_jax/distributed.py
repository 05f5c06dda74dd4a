"""Joining a multi-process (multi-host) run through ``jax.distributed``.

One process per host; the ``node`` mesh axis is the process boundary.  The
coordinator is given explicitly (``--coordinator HOST:PORT --num-processes N
--process-id I``), by ``zeropp-launch`` through ``ZEROPP_*`` environment
variables, or found by JAX itself from a cluster environment it understands
(SLURM, Open MPI, ...).  On CPU the collectives run over gloo.

When a process is lost the others stop instead of hanging (measured with
gloo on CPU, 2 processes, SIGKILL / SIGSTOP in the middle of training):

- a peer *killed* (its sockets close): the survivors' next collective fails at
  once (``JaxRuntimeError: Gloo ... failed: Connection reset by peer``); the
  process then ends after at most ``heartbeat_timeout_s``, when the
  coordinator has declared the peer dead.
- a peer *hung* (no socket error, e.g. a frozen host): after
  ``heartbeat_timeout_s`` without heartbeats the coordinator propagates the
  error and every survivor aborts (SIGABRT, "Terminating process because the
  JAX distributed service detected fatal errors").
- process 0 (the coordinator) lost: the others abort within about a second.
- a process that raises: without help it would wait for the others at the
  shutdown barrier (up to ``shutdown_timeout_s``) while they wait for it
  inside a collective. :func:`initialize` therefore makes an uncaught
  exception end the process at once (traceback, then exit status 1), which
  turns it into the first case; :func:`exit_now` does the same for a
  deliberate error exit.

SIGTERM is a preemption notice: JAX's notifier catches it in a multi-process
run, and :class:`PreemptionNotice` tells a training loop when to checkpoint
and stop (on one process too, where Ctrl-C does the same; a second Ctrl-C
stops at once).

Under ``zeropp-launch``, :func:`initialize` also starts beating to the
launcher (:mod:`zeropp_jax.heartbeat`): the launcher names a process that
stalls or never gets here, and the process ends if the launcher dies.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import warnings

ENV_COORDINATOR = "ZEROPP_COORDINATOR"
ENV_NUM_PROCESSES = "ZEROPP_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROPP_PROCESS_ID"

# Seconds without heartbeats after which a peer counts as dead.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
# Seconds the processes wait for each other at start-up.
DEFAULT_INIT_TIMEOUT_S = 120
# Seconds a finished process waits at exit for the others to finish too (JAX's
# default is 300). A process with long solo work at the end (e.g. process 0
# writing a file) should make the others wait for it first, e.g. with
# ``jax.experimental.multihost_utils.sync_global_devices``.
DEFAULT_SHUTDOWN_TIMEOUT_S = 60
# Exit status of a run stopped by a preemption notice (PreemptionNotice):
# 128 + SIGTERM, as if the signal had ended it (the run is not finished).
PREEMPTED_EXIT = 128 + int(signal.SIGTERM)
# Exit status of a one-process run stopped by Ctrl-C (checkpointed like a
# preemption): 128 + SIGINT, as a shell reports an interrupted program.
INTERRUPTED_EXIT = 128 + int(signal.SIGINT)


# PreemptionNotice's warning without JAX's preemption service.
_NO_SYNC = (
    "this multi-process run has no preemption sync point (JAX's preemption service was off "
    "when jax.distributed started): JAX catches no SIGTERM, so a preemption notice ends the "
    "processes without a checkpoint; "
    "call jax.config.update('jax_enable_preemption_service', True) before "
    "zeropp_jax.distributed.initialize to checkpoint and stop on one")

# The process counts SLURM and Open MPI set (srun, mpirun).
_CLUSTER_SIZE_VARIABLES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _cluster_environment() -> bool:
    """Whether a multi-process launcher JAX can auto-detect started us; a
    ``ValueError`` names a process count that is set but not an integer."""
    def size(name):
        text = os.environ.get(name, "1")
        try:
            return int(text)
        except ValueError:
            raise ValueError(  # not one process: under srun -n 4, four copies of the run
                f"{name} must be the run's number of processes, an integer, got {text!r}: "
                "fix or unset it, or give --coordinator, --num-processes and --process-id"
            ) from None

    return any(size(name) > 1 for name in _CLUSTER_SIZE_VARIABLES)


def _cluster_variables() -> str:
    """The variables :func:`_cluster_environment` read, as ``NAME=value``."""
    return ", ".join(f"{name}={os.environ[name]}" for name in _CLUSTER_SIZE_VARIABLES
                     if name in os.environ)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S,
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S,
    exit_on_uncaught_exception: bool = True,
) -> bool:
    """Initializes ``jax.distributed`` when this is a multi-process run.

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordinator service.
      num_processes: total number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      heartbeat_timeout_s: a peer silent this long is considered dead.
      init_timeout_s: how long to wait for all processes to join.
      shutdown_timeout_s: how long a finished process waits at exit for the
        others.
      exit_on_uncaught_exception: on a multi-process run, install a
        ``sys.excepthook`` that prints the traceback and ends the process at
        once (:func:`exit_now`), so the other processes see it fail instead
        of waiting on it. Not installed in an interactive interpreter.

    Returns:
      ``True`` if a multi-process run was joined, ``False`` for a plain
      single-process run (nothing given, no cluster environment).

    Raises:
      ValueError: if only some of the three explicit values are given, or
        they are inconsistent (see :func:`resolve`), or ``SLURM_NTASKS`` or
        ``OMPI_COMM_WORLD_SIZE`` is not an integer, or (process 0) the
        coordinator's port is in use on this host, where JAX's coordinator
        would crash and leave the others waiting.
    """
    import jax

    from zeropp_jax import heartbeat

    heartbeat.start()  # first: the launcher learns that this process got here

    settings = resolve(coordinator, num_processes, process_id)
    if settings is not None:
        if settings[1] == 1:
            return False
        where = dict(
            coordinator_address=settings[0], num_processes=settings[1],
            process_id=settings[2],
        )
    elif _cluster_environment():
        where = {}
    else:
        return False

    if where and where["process_id"] == 0:
        _check_port_free(where["coordinator_address"])
    _use_gloo_on_cpu(jax)
    try:
        jax.distributed.initialize(
            **where,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            shutdown_timeout_seconds=shutdown_timeout_s,
        )
    except ValueError as e:
        if where:
            raise
        raise ValueError(
            f"the environment says this is one of several processes ({_cluster_variables()}), "
            f"but JAX could not set the run up from it ({e}): start each process with srun "
            "or mpirun, or give --coordinator HOST:PORT, --num-processes and --process-id"
        ) from e
    if exit_on_uncaught_exception and not _interactive():
        _install_excepthook()
    return True


def _check_port_free(coordinator: str) -> None:
    """Raises ``ValueError`` if process 0 cannot listen on the coordinator's
    port (something else holds it), where JAX's coordinator service would
    crash process 0 without a word (the others still wait out the start-up
    timeout)."""
    port = int(coordinator.rsplit(":", 1)[1])
    error = bind_error("", port, reuse_address=True)  # TIME_WAIT is no user
    if error is not None:
        raise ValueError(
            f"the coordinator's port {port} ({coordinator}) is in use on this host, the "
            f"one of process 0, which runs the coordinator service ({error.strerror}): give "
            "--coordinator another port, or stop what holds it")


def bind_error(host: str, port: int, *, reuse_address: bool = False) -> OSError | None:
    """The error binding a TCP socket to ``host:port`` raises (something
    holds the port), or ``None``; with ``reuse_address``, a port left in
    TIME_WAIT counts as free (``SO_REUSEADDR``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def resolve(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> tuple[str, int, int] | None:
    """The explicit multi-process setting, checked; needs no JAX.

    The arguments (the flags ``--coordinator``, ``--num-processes``,
    ``--process-id``), else the ``ZEROPP_*`` environment of
    ``zeropp-launch`` when none is given.

    Returns:
      ``(coordinator, num_processes, process_id)``, or ``None`` when neither
      the arguments nor the environment give any.

    Raises:
      ValueError: naming the flag (or environment variable) that is missing,
        not an integer, out of range, or not ``HOST:PORT``.
    """
    names = ("--coordinator", "--num-processes", "--process-id")
    if (coordinator, num_processes, process_id) == (None, None, None):
        if not os.environ.get(ENV_COORDINATOR):
            return None
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        coordinator = os.environ[ENV_COORDINATOR]
        num_processes, process_id = _env_int(ENV_NUM_PROCESSES), _env_int(ENV_PROCESS_ID)
    elif os.environ.get(ENV_COORDINATOR):  # flags in a command zeropp-launch started
        launched = (os.environ[ENV_COORDINATOR], _env_int(ENV_NUM_PROCESSES),
                    _env_int(ENV_PROCESS_ID))
        if (coordinator, num_processes, process_id) != launched:
            passed = " ".join(f"{flag} {value}" for flag, value in (
                ("--coordinator", coordinator), ("--num-processes", num_processes),
                ("--process-id", process_id)) if value is not None)
            raise ValueError(
                f"zeropp-launch started this process as process {launched[2]} of "
                f"{launched[1]} (coordinator {launched[0]}), but the command passes "
                f"{passed}, one value for every process alike: leave those flags out "
                "under zeropp-launch, which sets them per process"
            )
    given = dict(zip(names, (coordinator, num_processes, process_id)))
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(
            f"a multi-process run needs all of {names[0]} HOST:PORT, {names[1]} and "
            f"{names[2]}; {' and '.join(missing)} missing (got "
            + ", ".join(f"{k} {v}" for k, v in given.items() if v is not None) + ")"
        )
    if num_processes < 1:
        raise ValueError(f"{names[1]} must be at least 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"{names[2]} must be in [0, {num_processes}) for {names[1]} {num_processes}, "
            f"got {process_id}"
        )
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{names[0]} must be HOST:PORT with a port in 1..65535 (e.g. "
            f"{host or coordinator}:1234), got {coordinator!r}"
        )
    return coordinator, num_processes, process_id


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{ENV_COORDINATOR} is set, so {name} must be an integer, got {text!r}"
        ) from None


def exit_now(status: int = 1) -> None:
    """Ends this process at once, without the exit-time wait for the others.

    On a multi-process run a process that exits normally first waits at
    JAX's shutdown barrier for all others, while they may be blocked in a
    collective waiting for it. Exiting at once closes its connections, so
    their collectives fail and they stop too (or are stopped by
    ``zeropp-launch``). Standard output and error are flushed; other open
    Python files are not, and ``atexit`` handlers do not run.

    On a single-process run this is ``sys.exit(status)``.

    Args:
      status: the exit status.
    """
    import jax

    if not jax.distributed.is_initialized():
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(status)


def _install_excepthook() -> None:
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        import jax

        print(
            f"zeropp_jax: process {jax.process_index()} of {jax.process_count()} "
            "failed; exiting now so that the other processes stop too",
            file=sys.stderr,
        )
        exit_now(INTERRUPTED_EXIT if issubclass(exc_type, KeyboardInterrupt) else 1)

    sys.excepthook = excepthook


def _interactive() -> bool:
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


def _use_gloo_on_cpu(jax) -> None:
    """CPU devices need a collectives library to talk across processes: gloo
    (JAX 0.10's default), unless ``jax_cpu_collectives_implementation`` names
    another (``"mpi"``, by ``jax.config.update`` or the environment)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    chosen = jax.config.jax_cpu_collectives_implementation
    if platforms.split(",")[0] in ("", "cpu") and chosen in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


class PreemptionNotice:
    """Context manager around a training loop: whether a preemption notice
    (SIGTERM), or a Ctrl-C on one process, asks it to checkpoint and stop.

    A scheduler (SLURM, Kubernetes, a spot-instance reclaim, ``zeropp-launch``
    stopping its processes) sends SIGTERM some seconds before it kills a job.

    * multi-process: JAX's preemption notifier catches the SIGTERM of any
      process, and the processes agree on the step to stop at (the step after
      the furthest one any of them reached), which each asks for at every step
      (``jax.experimental.multihost_utils.reached_preemption_sync_point``).
      Ctrl-C (SIGINT) is not caught: it ends the process (and so the run,
      :func:`initialize`);
    * one process: handlers of SIGTERM and SIGINT, installed in the ``with``
      block (main thread only) and put back after it, note the signal. A
      second Ctrl-C raises ``KeyboardInterrupt`` at once (e.g. while the
      checkpoint is written); a second SIGTERM is noted again.

    Every process must call :meth:`reached` at every step, with the same step
    numbers (they start at the same step). ``zeropp-train`` then saves a
    checkpoint and exits with :attr:`exit_status` (:data:`PREEMPTED_EXIT`
    after SIGTERM, :data:`INTERRUPTED_EXIT` after Ctrl-C).

    With JAX's preemption service off when ``jax.distributed`` started
    (``jax_enable_preemption_service``) a multi-process run catches no
    SIGTERM: the first :meth:`reached` warns that a notice ends the processes
    without a checkpoint, and it is ``False`` from then on.

    Attributes:
      received: the first signal noted (``signal.SIGTERM`` or
        ``signal.SIGINT``), else ``None``.
    """

    def __init__(self) -> None:
        self._multi = False
        self._sync = False  # multi-process, with JAX's preemption sync point
        self.received: signal.Signals | None = None
        self._interrupted = False  # a Ctrl-C was noted
        self._previous: dict = {}

    def __enter__(self) -> "PreemptionNotice":
        import jax

        self._multi = jax.process_count() > 1
        self._sync = self._multi  # JAX read its option at initialize: the first step tells
        if not self._multi and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # ignored (nohup, a background job): it stays ignored
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _note(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self._interrupted:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now, no checkpoint
            self._interrupted = True
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def exit_status(self) -> int:
        """:data:`INTERRUPTED_EXIT` after a Ctrl-C, else :data:`PREEMPTED_EXIT`."""
        return INTERRUPTED_EXIT if self.received == signal.SIGINT else PREEMPTED_EXIT

    def reached(self, step: int) -> bool:
        """Whether to checkpoint and stop before step ``step`` (``step``
        steps done): a SIGTERM was received (by any process), or a Ctrl-C
        (one process)."""
        if not self._sync:  # one process, or no preemption service (warned at the first step)
            return not self._multi and self.received is not None
        from jax.experimental import multihost_utils

        try:
            reached = multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError as e:  # only JAX's "not initialized"; a lost peer's error is raised
            if type(e) is not RuntimeError or "sync manager has not been initialized" not in str(e):
                raise
            self._sync = False  # the service was off at jax.distributed.initialize, on now
            warnings.warn(_NO_SYNC, stacklevel=2)
            return False
        if reached:
            self.received = signal.SIGTERM
        return reached

