"""Joining a multi-process (multi-host) run through ``jax.distributed``.

One process per host; the ``node`` mesh axis is the process boundary.  The
coordinator is given explicitly (``--coordinator HOST:PORT --num-processes N
--process-id I``), by ``zeropp-launch`` through ``ZEROPP_*`` environment
variables, or found by JAX itself from a cluster environment it understands
(SLURM, Open MPI, ...).  On CPU the collectives run over gloo.

A process that dies is noticed by the others through JAX's heartbeats: the
survivors stop with an error after ``heartbeat_timeout_s`` instead of hanging.
"""

from __future__ import annotations

import os

ENV_COORDINATOR = "ZEROPP_COORDINATOR"
ENV_NUM_PROCESSES = "ZEROPP_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROPP_PROCESS_ID"

# Seconds without heartbeats after which a peer counts as dead.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
# Seconds the processes wait for each other at start-up.
DEFAULT_INIT_TIMEOUT_S = 120


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
) -> bool:
    """Initializes ``jax.distributed`` when this is a multi-process run.

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordinator service.
      num_processes: total number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      heartbeat_timeout_s: a peer silent this long is considered dead.
      init_timeout_s: how long to wait for all processes to join.

    Returns:
      ``True`` if a multi-process run was joined, ``False`` for a plain
      single-process run (nothing given, no cluster environment).

    Raises:
      ValueError: if only some of the three explicit values are given, or
        they are inconsistent.
    """
    import jax

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
        _use_gloo_on_cpu(jax)
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
        return True

    if _cluster_environment():
        _use_gloo_on_cpu(jax)
        jax.distributed.initialize(
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
        return True
    return False


def _use_gloo_on_cpu(jax) -> None:
    """CPU devices need a collectives library to talk across processes."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms.split(",")[0] in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
