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

Under ``zeropp-launch``, :func:`initialize` also starts beating to the
launcher (:mod:`zeropp_jax.heartbeat`): the launcher names a process that
stalls or never gets here, and the process ends if the launcher dies.
"""

from __future__ import annotations

import os
import sys

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


def _cluster_environment() -> bool:
    """Whether a multi-process launcher JAX can auto-detect started us."""
    def size(name):
        try:
            return int(os.environ.get(name, "1"))
        except ValueError:
            return 1

    return size("SLURM_NTASKS") > 1 or size("OMPI_COMM_WORLD_SIZE") > 1


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
        they are inconsistent.
    """
    import jax

    from zeropp_jax import heartbeat

    heartbeat.start()  # first: the launcher learns that this process got here

    explicit = (coordinator, num_processes, process_id)
    if all(v is None for v in explicit) and os.environ.get(ENV_COORDINATOR):
        try:
            coordinator = os.environ[ENV_COORDINATOR]
            num_processes = int(os.environ[ENV_NUM_PROCESSES])
            process_id = int(os.environ[ENV_PROCESS_ID])
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID} "
                f"are missing or not integers ({e})"
            ) from None
        explicit = (coordinator, num_processes, process_id)

    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ValueError(
                "a multi-process run needs all of --coordinator HOST:PORT, "
                f"--num-processes and --process-id; got coordinator={coordinator!r}, "
                f"num_processes={num_processes!r}, process_id={process_id!r}"
            )
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(
                f"--process-id must be in [0, {num_processes}), got {process_id}"
            )
        if ":" not in coordinator:
            raise ValueError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
        if num_processes == 1:
            return False
        where = dict(
            coordinator_address=coordinator, num_processes=num_processes,
            process_id=process_id,
        )
    elif _cluster_environment():
        where = {}
    else:
        return False

    _use_gloo_on_cpu(jax)
    jax.distributed.initialize(
        **where,
        initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
    )
    if exit_on_uncaught_exception and not _interactive():
        _install_excepthook()
    return True


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
        exit_now(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    sys.excepthook = excepthook


def _interactive() -> bool:
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


def _use_gloo_on_cpu(jax) -> None:
    """CPU devices need a collectives library to talk across processes."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms.split(",")[0] in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
