"""A function traced once and replayed, whole or cut to some of its outputs.

:meth:`zeropp_jax.Trainer.init_from` runs a model's init function once per
group of units: tracing it once (its Python, and a NumPy draw inside it, run
once) and replaying only the equations a group's leaves need keeps each
group's program as small as its own draws, not the whole model's.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp


def traced_once(fn: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], Any]:
    """``fn`` traced once at ``args`` (``jax.make_jaxpr``), as a function of
    the same arguments that replays the trace (``fn``'s Python does not run
    again), and the shapes ``fn`` returns. The replay's ``keep`` (a set of
    output leaf indices) replays only the work those leaves need, the other
    leaves zeros of their shapes (what a group's program reads none of)."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree, outs = jax.tree.structure(shapes), jax.tree.leaves(shapes)

    def replay(*a, keep=None):
        if keep is None:
            return jax.tree.unflatten(out_tree, jax.extend.core.jaxpr_as_fun(closed)(
                *jax.tree.leaves(a)))
        kept = iter(jax.extend.core.jaxpr_as_fun(_pruned(closed, keep))(*jax.tree.leaves(a)))
        return jax.tree.unflatten(out_tree, [
            next(kept) if i in keep else jnp.zeros(o.shape, o.dtype) for i, o in enumerate(outs)])

    return replay, shapes


def _pruned(closed: Any, keep: frozenset) -> Any:
    """``closed`` (a ``ClosedJaxpr``) with only outputs ``keep`` and the
    equations they need (and every one with effects): a unit's program
    replays its own draws, not the whole model's."""
    jaxpr = closed.jaxpr
    outvars = [v for i, v in enumerate(jaxpr.outvars) if i in keep]
    live = {v for v in outvars if isinstance(v, jax.extend.core.Var)}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            eqns.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, jax.extend.core.Var))
    paths = jaxpr.debug_info.safe_result_paths(len(jaxpr.outvars))
    cut = jax.extend.core.Jaxpr(
        jaxpr.constvars, jaxpr.invars, outvars, eqns[::-1], jaxpr.effects,
        jaxpr.debug_info._replace(result_paths=tuple(p for i, p in enumerate(paths) if i in keep)))
    return jax.extend.core.ClosedJaxpr(cut, closed.consts)
