"""``zeropp_jax.distributed`` decisions that need no second process.

A multi-process run is simulated where it matters (``jax.process_count``
patched to 2, JAX's preemption sync point replaced); the real runs are in
``test_multihost.py`` and ``test_launch.py``.
"""

from __future__ import annotations

import signal
import warnings

import jax
import pytest
from jax.experimental import multihost_utils

from zeropp_jax import distributed


@pytest.fixture
def two_processes(monkeypatch):
    """``jax.process_count()`` is 2; JAX's preemption option is restored afterwards."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    before = jax.config.jax_enable_preemption_service
    yield
    jax.config.update("jax_enable_preemption_service", before)


def test_the_option_turned_off_after_initialize_keeps_the_sync(two_processes, monkeypatch):
    """JAX reads ``jax_enable_preemption_service`` at ``jax.distributed.initialize``
    only: turned off later, JAX still catches SIGTERM, so the sync point stays
    in use (nothing warned, the notice reached)."""
    answers = iter([False, True])
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                        lambda step: next(answers))
    jax.config.update("jax_enable_preemption_service", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with distributed.PreemptionNotice() as notice:
            assert not notice.reached(0)
            assert notice.reached(1) and notice.received == signal.SIGTERM


def test_an_error_of_the_sync_point_is_raised_and_the_sync_stays_on(two_processes, monkeypatch):
    """A coordination-service error while a peer is lost is a RuntimeError
    (``JaxRuntimeError``): it used to switch the preemption sync off for the
    rest of the run without a word."""
    answers = iter([jax.errors.JaxRuntimeError("UNAVAILABLE: task /job:jax_worker/task:1 lost"),
                    False, True])

    def sync_point(step):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", sync_point)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with distributed.PreemptionNotice() as notice:
            with pytest.raises(jax.errors.JaxRuntimeError, match="task:1 lost"):
                notice.reached(0)
            assert not notice.reached(1)
            assert notice.reached(2) and notice.received == signal.SIGTERM


def test_a_service_off_at_initialize_is_warned_of_at_the_first_step(two_processes, monkeypatch):
    """The option on now but off when ``jax.distributed`` started: JAX's own
    "not initialized" error turns the sync off, with a warning, once."""
    calls = []

    def sync_point(step):
        calls.append(step)
        raise RuntimeError("Preemption sync manager has not been initialized. Make sure the "
                           "'jax_enable_preemption_service' config is enabled.")

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", sync_point)
    with distributed.PreemptionNotice() as notice:
        with pytest.warns(UserWarning, match=r"off when jax.distributed started.*without a "
                                             r"checkpoint.*jax_enable_preemption_service', True"):
            assert not notice.reached(0)
        assert not notice.reached(1) and calls == [0]


@pytest.mark.parametrize("name", ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"])
def test_a_cluster_size_that_is_not_an_integer_is_an_error_naming_it(monkeypatch, name):
    """Taken for one process, ``srun -n 4`` with a garbled count would have
    started four independent copies of the run."""
    for other in (distributed.ENV_COORDINATOR, "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "4(x2)")
    with pytest.raises(ValueError, match=rf"{name} must be the run's number of processes, an "
                                         r"integer, got '4\(x2\)'.*--num-processes"):
        distributed.initialize()


def test_a_chosen_cpu_collectives_implementation_is_kept():
    """gloo only where none is chosen: a user's ``mpi`` stays."""
    before = jax.config.jax_cpu_collectives_implementation
    try:
        jax.config.update("jax_cpu_collectives_implementation", "mpi")
        distributed._use_gloo_on_cpu(jax)
        assert jax.config.jax_cpu_collectives_implementation == "mpi"
        jax.config.update("jax_cpu_collectives_implementation", None)
        distributed._use_gloo_on_cpu(jax)
        assert jax.config.jax_cpu_collectives_implementation == "gloo"
    finally:
        jax.config.update("jax_cpu_collectives_implementation", before)
