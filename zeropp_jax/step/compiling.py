"""Compiling a trainer's step without running it: lowered, from shapes, or ahead of use.

A trainer has up to two compiled steps, the full-precision and the
compressed variant (:mod:`~zeropp_jax.step.schedule`). Each compiles at its
first use, so a schedule that starts compressing after a warm-up stops the
run there for a whole compile (53 s at 48 Hugging Face GPT-2 layers on a
2-core CPU). :meth:`StepCompiling.precompile` compiles them before they are
needed, in the background if asked, while the first steps run: the step's
own ``jax.jit`` then finds them in its cache, and a step whose variant is
still compiling waits for it (:class:`CompileAhead`) instead of compiling it
a second time.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
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
    :meth:`wait` (called by each step before it runs its variant) blocks until
    that variant's compile is done, so the step finds it in ``jax.jit``'s
    cache. A compile that failed is not raised here: the step compiles the
    variant itself and raises its error where it happens.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[bool, concurrent.futures.Future] = {}

    def start(self, compiles: dict[bool, Callable[[], Any]]) -> dict[bool, concurrent.futures.Future]:
        """Compiles each variant in a worker thread, in ``compiles``' order.

        Returns ``{compress: Future}``, each resolving to the compile's seconds.
        The worker is not a daemon: a program that ends while it compiles waits
        for it (a compile cut off at exit can crash the interpreter).
        """
        worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zeropp-precompile")
        futures = {compress: worker.submit(_seconds, compile_one)
                   for compress, compile_one in compiles.items()}
        worker.shutdown(wait=False)
        with self._lock:
            self._pending.update(futures)
        return futures

    def wait(self, compress: bool) -> None:
        """Returns once the background compile of this variant (if any) has ended."""
        with self._lock:
            future = self._pending.get(compress)
        if future is None:
            return
        concurrent.futures.wait([future])
        with self._lock:
            if self._pending.get(compress) is future:
                del self._pending[compress]


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

    def precompile(self, state: Any, batch: Any, *, background: bool = False) -> dict:
        """Compiles every step variant ``state``'s schedule can still take, before its first use.

        The variant of ``state``'s own step comes first, then the other where
        the qgZ schedule switches later (warm-up, refresh, gradient-RMS gate:
        :meth:`QgzSchedule.variants_from
        <zeropp_jax.step.schedule.QgzSchedule.variants_from>`). :meth:`step`
        then runs them from ``jax.jit``'s cache, as if each had run once.

        Args:
          state: a :class:`~zeropp_jax.step.state.TrainState` of this trainer
            (not consumed; only its shapes and shardings are used).
          batch: a global batch of the shapes the steps will take (as
            :meth:`shard_batch`'s; only its shapes are used).
          background: compile in a worker thread and return at once. A step
            whose variant is still compiling waits for that compile. The worker
            traces under JAX's global configuration: a step run under a
            thread-local context (``jax.default_matmul_precision``, ...)
            compiles its own variant.

        Returns:
          ``{compress: seconds}`` (each compile's wall time), or with
          ``background=True`` ``{compress: concurrent.futures.Future}`` of them
          (``.result()`` raises a compile's error).
        """
        check_state(state, self._state_form, "precompile")
        step = self._host_steps.get(state.step)
        variants = self.schedule.variants_from(int(state.step) if step is None else step)
        shapes, batch_shapes = _abstract(state), _abstract(self.shard_batch(batch))
        self._step_variants  # made here, not in the worker: one jit per variant, one cache
        compiles = {compress: lambda c=compress: self.lower(shapes, batch_shapes, compress=c).compile()
                    for compress in variants}
        if background:
            return self._ahead.start(compiles)
        return {compress: _seconds(compile_one) for compress, compile_one in compiles.items()}
