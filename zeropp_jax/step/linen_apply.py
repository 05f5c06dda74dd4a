"""A Linen module's method applied as a fresh top-level module, its random
streams continued: how the wrap policy (:mod:`zeropp_jax.step.wrap`) runs a
wrapped block on its gathered parameters.

This is the one module that uses flax internals (``flax.core.scope``; the
package pins ``flax<0.13``): flax derives a ``make_rng`` key from the
stream's root key, a static suffix of scope names and per-scope call
counters, and :func:`resume_streams` rebuilds all three around the new
top-level module, so a wrapped block draws exactly the keys it draws
unwrapped.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from zeropp_jax.prng_keys import keys_as_data, keys_from_data


def resume_streams(scope: Any) -> tuple[list, Callable]:
    """A Linen scope's random streams, to continue in another module apply.

    This is the one place that uses flax internals (``flax.core.scope``): a
    stream of ``scope`` is a ``LazyRng`` (a root key and a static suffix of
    scope names, folded in by ``make_rng``), and ``scope.rng_counters``
    (stream name -> calls so far, plus one nested dict per child scope) picks
    the key of each call.

    Returns:
      ``(roots, apply)``: the streams' root keys (sorted by stream name; a
      typed key or ``uint32`` key data each, possibly tracers of ``nn.scan``)
      and ``apply(top, method, variables, roots, *args, **kwargs)``, which is
      ``top.apply(variables, *args, method=method, **kwargs)`` whose module
      scope has ``scope``'s streams (``roots`` as their root keys) and
      counters, and which writes the advanced counters back to ``scope``:
      ``(out, written)``, ``written`` the collections the method created
      (``sow``), the only mutable ones.
    """
    from flax.core import DenyList
    from flax.core.scope import LazyRng

    names = sorted(scope.rngs)
    suffixes = [scope.rngs[n].suffix for n in names]
    counters = _copy_counters(scope.rng_counters)

    def apply(top, method, variables, roots, *args, **kwargs):
        def run(module, *a, **kw):
            module.scope.rng_counters.update(_copy_counters(counters))
            out = getattr(module, method)(*a, **kw)
            scope.rng_counters.clear()
            scope.rng_counters.update(module.scope.rng_counters)
            return out

        rngs = {n: LazyRng(r, s) for n, r, s in zip(names, roots, suffixes, strict=True)}
        # Collections the block's variables do not hold are mutable, so that
        # what it sows shows (it would vanish silently otherwise); the ones
        # it holds are not (an update raises flax's ModifyScopeVariableError).
        return top.apply(variables, *args, rngs=rngs or None, method=run,
                         mutable=DenyList(tuple(variables)), **kwargs)

    return [scope.rngs[n].rng for n in names], apply


def _copy_counters(counters: dict) -> dict:
    """A copy of nested ``rng_counters`` dicts (keys kept: flax's child token
    is compared by identity)."""
    return {k: _copy_counters(v) if isinstance(v, dict) else v for k, v in counters.items()}


def block_apply(module: Any, method: str) -> tuple[Callable, Any]:
    """A Linen ``module``'s ``method`` as ``(apply, state)``:
    ``apply(params, state, *args, **kwargs)`` runs it on ``params`` (the
    block's, gathered) as a fresh top-level module.

    ``state`` holds the block's PRNG root keys (typed keys as raw ``uint32``
    key data, :func:`resume_streams`) and its other variable collections
    (read only, e.g. frozen ``batch_stats``); they enter a layer as its
    inputs, not closed over: under ``nn.scan`` or ``nn.remat`` they are
    tracers of that transform, which the layer's backward (a
    ``custom_vjp``) must not capture.
    """
    top = module.clone(parent=None, name=None)
    roots, resume = resume_streams(module.scope)
    data, impls = keys_as_data(roots)
    others = {c: v for c, v in module.variables.items() if c != "params"}

    def apply(params, state, *a, **kw):
        import flax

        data, variables = state
        roots = keys_from_data(data, impls)

        def impure(what):  # what it writes could not leave the step
            return ValueError(
                f"wrap: {type(module).__name__} at {'/'.join(module.scope.path)} writes "
                f"{what}; a wrapped block must be pure, as what it writes cannot leave the "
                "step: run it in eval mode or take the values out another way, or leave its "
                "class out of wrap=")

        try:
            out, written = resume(top, method, {**variables, "params": params}, roots, *a, **kw)
        except flax.errors.ModifyScopeVariableError as e:
            raise impure(f"a variable ({e})") from None
        sown = sorted(c for c, v in written.items()
                      if jax.tree.leaves(v) and module.is_mutable_collection(c))
        if sown:  # the loss's apply asked for them: they would be lost silently
            raise impure(f"collection(s) {sown} (sow, or a variable it creates), which the "
                         "loss's apply makes mutable")
        return out

    return apply, (data, others)
