"""Compiling a trainer's step without running it: lowered, from shapes, or ahead of use.

A trainer has up to two compiled steps, the full-precision and the
compressed variant (:mod:`~zeropp_jax.step.schedule`). Each compiles at its
first use, so a schedule that starts compressing after a warm-up stops the
run there for a whole compile (``benchmarks/compile_stall.py``; measured in
``benchmarks/RESULTS.md``, stop 57).
:meth:`StepCompiling.precompile` compiles them before they are needed, in the
background if asked, while the first steps run: the step's own ``jax.jit``
then finds them in its cache, and a step whose variant is still compiling
waits for it (:class:`CompileAhead`) instead of compiling it a second time;
whatever else the trainer compiles waits until the worker is idle.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from typing import Any, Callable

import jax

from zeropp_jax.step import state_io
from zeropp_jax.step.state import check_state

__all__ = ["CompileAhead", "StepCompiling"]


def _abstract(tree: Any) -> Any:
    """``tree``'s arrays as ``jax.ShapeDtypeStruct`` with their shardings (the same cache key)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False)), tree)


def _seconds(compile_one: Callable[[], Any]) -> float:
    start = time.perf_counter()
    compile_one()
    return time.perf_counter() - start


class CompileAhead:
    """The step variants compiling in the background, one trainer's.

    :meth:`start` hands the compiles to one worker thread, in order;
    :meth:`wait` (called by each step, and by every trainer method that may
    compile on the caller's thread) keeps the trainer's own compiles to one
    at a time beside its worker: a step whose variant the worker compiled
    runs at once from ``jax.jit``'s cache (waiting for it if it is still
    compiling), and anything else waits until the worker is idle. Only the
    trainer's calls wait: another trainer's, or a program's own ``jax.jit``,
    do not (``Trainer.wait_for_precompile`` before them). Two threads
    compiling at once crashed the test suite once (a segmentation fault in
    XLA:CPU's ``deserialize_executable``, the caller loading a program from
    the persistent compilation cache while the worker compiled; jax 0.10.2,
    ``benchmarks/RESULTS.md``, stop 58).
    A compile that failed is not raised here: the caller compiles the
    variant itself and raises its error where it happens.

    The worker is not a daemon (a compile cut off at exit can crash the
    interpreter): a program that ends while it compiles waits for the compile
    running then, and the queued ones are cancelled (``threading``'s exit
    hooks, which run before non-daemon threads are joined).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._one_worker = threading.Lock()  # held by the worker running: one at a time
        self._pending: dict[bool, concurrent.futures.Future] = {}
        self._stop: threading.Event | None = None  # set at exit: queued compiles are cancelled

    def start(self, compiles: dict[bool, Callable[[], Any]]) -> dict[bool, concurrent.futures.Future]:
        """Compiles each variant in a worker thread, in ``compiles``' order.

        Returns ``{compress: Future}``, each resolving to the compile's seconds
        (or cancelled at exit). A variant still compiling from an earlier call
        keeps its future and is not compiled twice.
        """
        with self._lock:
            futures = {c: f for c, f in self._pending.items() if c in compiles and not f.done()}
            queue = [(c, concurrent.futures.Future(), job) for c, job in compiles.items()
                     if c not in futures]
            self._pending.update({c: future for c, future, _ in queue})
        futures.update({c: future for c, future, _ in queue})
        if queue:
            with self._lock:
                if self._stop is None:  # one exit hook a trainer, at its first background compile
                    self._stop = threading.Event()
                    _at_exit(self._stop.set)
            try:
                threading.Thread(target=_compile_all, args=(queue, self._stop, self._one_worker),
                                 name="zeropp-precompile").start()
            except BaseException:  # no thread to be had: nothing may wait on these forever
                for _, future, _ in queue:
                    future.cancel()
                raise
        return {c: futures[c] for c in compiles}

    def wait(self, compress: bool | None = None) -> None:
        """Returns once the caller may go on without compiling beside the worker.

        ``compress``: the step variant about to run. One the worker compiled
        (or is compiling: waited for) runs from jit's cache, so the worker
        may go on compiling the others (a step of other shapes than the
        precompiled ones compiles its own, beside the worker). ``None`` (the
        caller compiles something else), or a variant the worker did not
        compile: waits until the worker is idle. At once on the worker's own
        thread.
        """
        if getattr(_WORKER, "active", False):
            return
        with self._lock:
            future = self._pending.get(compress)
        if future is not None:
            if not future.done():  # a step's wait once its variant is compiled: no waiting
                concurrent.futures.wait([future])
            if _succeeded(future):
                return
        with self._lock:
            running = [f for f in self._pending.values() if not f.done()]
        concurrent.futures.wait(running)


_WORKER = threading.local()  # .active: True on a worker thread


def _succeeded(future: concurrent.futures.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _compile_all(queue: list, stop: threading.Event, one_worker: threading.Lock) -> None:
    """The worker: each ``(compress, future, compile)`` in turn, until ``stop`` is set
    (after any earlier worker of the same trainer: ``one_worker``)."""
    _WORKER.active = True
    with one_worker:
        for _, future, compile_one in queue:
            if stop.is_set() or not future.set_running_or_notify_cancel():
                future.cancel()
                continue
            try:
                future.set_result(_seconds(compile_one))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(e)


def _at_exit(hook: Callable[[], None]) -> None:
    """Runs ``hook`` at interpreter exit before non-daemon threads are joined:
    ``threading._register_atexit``, private to the standard library but there
    since Python 3.9 (``concurrent.futures`` relies on it; ``atexit`` would run
    after the join, too late to cancel anything)."""
    try:
        threading._register_atexit(hook)
    except RuntimeError:  # registered while the interpreter is shutting down: nothing to stop
        pass


class StepCompiling:
    """:class:`~zeropp_jax.step.trainer.Trainer`'s methods that compile its step without running it."""

    def lower(self, state: Any, batch: Any, *, compress: bool | None = None):
        """Lowers the step (for the communication report), without running it.

        ``state`` may be abstract (``jax.ShapeDtypeStruct`` with shardings,
        from :meth:`abstract_state`), the batch too (global shapes): it is
        checked and placed as :meth:`shard_batch` does. ``compress=None`` is
        the compressed variant where qgZ is active; ``compress=True`` raises
        ``ValueError`` where it is not, as in :meth:`step`.
        """
        compress = self.schedule.forced(self.qgz_active if compress is None else compress)
        self._ahead.wait(compress)  # not a second compile of one the worker is at
        return self._lowered(state, batch, compress)

    def _lowered(self, state: Any, batch: Any, compress: bool):
        with jax.set_mesh(self.mesh):
            return self._step_variants[compress].lower(state, self.shard_batch(batch))

    def compile_from_shapes(self, params_shapes: Any, batch: Any, *, compress: bool | None = None):
        """Compiles the step from shapes alone: nothing is allocated or run.

        Args:
          params_shapes: the full parameters' shapes and dtypes (e.g.
            ``jax.eval_shape`` of an init function).
          batch: the global batch's shapes and dtypes (a pytree of anything
            with ``.shape`` and ``.dtype``); placed like :meth:`shard_batch`.
          compress: the qgZ variant, as in :meth:`lower`. Returns the compiled step.
        """
        return self.lower(self.abstract_state(params_shapes), state_io.unsharded(batch),
                          compress=compress).compile()

    def wait_for_precompile(self) -> None:
        """Returns once :meth:`precompile`'s background compiles have ended:
        call it before compiling something else beside them (the trainer's
        own methods do; :class:`CompileAhead`)."""
        self._ahead.wait()

    def precompile(self, state: Any, batch: Any, *, background: bool = False) -> dict:
        """Compiles every step variant ``state``'s schedule can still take, before its first use.

        The variant of ``state``'s own step comes first (read from the state as
        :meth:`step` reads it), then the other where the qgZ schedule switches
        later (warm-up, refresh, gradient-RMS gate: :meth:`QgzSchedule.variants_from
        <zeropp_jax.step.schedule.QgzSchedule.variants_from>`). :meth:`step`
        (and :meth:`lower`) then find them in ``jax.jit``'s cache (each one's
        first run still pays XLA's one-time set-up of the executable). That
        reuse is JAX's own dispatch caching (an ahead-of-time compile and a
        call share the lowered program), checked for the JAX installed by
        ``tests/test_compiling.py``; with PGLE on (``jax_enable_pgle``) a call
        compiles its own, so nothing is compiled here, with a warning.

        Args:
          state: a :class:`~zeropp_jax.step.state.TrainState` of this trainer
            (not consumed; only its shapes and shardings are used).
          batch: a global batch of the shapes the steps will take (as
            :meth:`shard_batch`'s; placed once, its values unused).
          background: compile in a worker thread and return at once. A step
            whose variant is still compiling waits for that compile; the
            trainer's methods that compile something else wait until the
            worker is idle (:meth:`CompileAhead.wait`). The worker
            traces under JAX's global configuration: a step run under a
            thread-local context (``jax.default_matmul_precision``, ...)
            compiles its own variant. At exit the program waits for the
            compile running then; those queued are cancelled.

        Returns:
          ``{compress: seconds}`` (each compile's wall time), or with
          ``background=True`` ``{compress: concurrent.futures.Future}`` of them
          (``.result()`` raises a compile's error).
        """
        check_state(state, self._state_form, "precompile")
        step = self._host_steps.get(state.step)
        step = int(state.step) if step is None else step
        variants = self.schedule.variants_from(step, state.opt_state.qgz.grad_rms)
        shapes, batch_shapes = _abstract(state), _abstract(self.shard_batch(batch))
        if jax.config.jax_enable_pgle:
            warnings.warn("trainer.precompile compiles nothing with PGLE on (jax_enable_pgle): "
                          "a profiled step compiles its own program", stacklevel=2)
            return {}
        self._step_variants  # made here, not in the worker: one jit per variant, one cache
        compiles = {compress: lambda c=compress: self._lowered(shapes, batch_shapes, c).compile()
                    for compress in variants}
        if background:
            return self._ahead.start(compiles)
        self._ahead.wait()
        return {compress: _seconds(compile_one) for compress, compile_one in compiles.items()}
