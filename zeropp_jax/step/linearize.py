"""A layer's VJP that saves its activations but none of its inputs: ``linearize`` and ``pull_back``.

ZeRO-3 must not keep a layer's gathered parameters from its forward to its
backward, so by default every layer is rematerialized: the backward gathers
the layer again and recomputes its whole forward before taking its VJP
(:func:`~zeropp_jax.layer`, :func:`~zeropp_jax.scan_layers`). With
``ZeroConfig.keep_activations`` the forward instead linearizes the layer
under ``jax.checkpoint`` with :data:`POLICY` (the outputs of matrix products
without batch dimensions are saved, everything else is recomputed from the
layer's inputs) and keeps only what is not one of those inputs:

* :func:`linearize` runs ``fn`` and returns its :class:`Linearized` VJP,
  whose arrays are the saved activations only. The VJP's references to
  ``fn``'s inputs (the gathered parameters, the shards, the layer's input
  activations, closure constants) are recorded as positions, not kept;
* :func:`pull_back` takes those inputs again (the gathered parameters
  gathered anew in the backward, as ZeRO-3 does) and applies the VJP.

The backward then recomputes the element-wise work and batched matrix
products (attention scores and probabilities) of the layer, not its weight
matrix products, and the parameters' all-gathers stay as they were (``2L``
per step; one fewer for a layer whose input needs no gradient). What is
kept is what :data:`POLICY` saves: about
``(3 + 1 + 4 + 1) x batch x length x width`` values per transformer layer
(its projections' and MLP's outputs), against ``1 x`` (the layer's input)
with full recomputation; a step without any recomputation would keep the
element-wise results and attention probabilities as well.

It relies on ``jax.vjp`` holding its inputs by reference in the VJP it
returns (JAX 0.10 and later), which :func:`linearize` checks once. A
product of parameters alone (``W_a @ W_b``) is an activation to the policy
and would be kept; only one shaped like the flat gathered parameters is
recognised (and refused).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
"""What a linearized layer keeps: outputs of matrix products without batch dimensions."""


@jax.tree_util.register_pytree_node_class
class Linearized:
    """A layer's VJP without its inputs.

    Children:
      saved: the VJP's arrays that are not inputs of the layer (its saved
        activations; stacked with a leading layer axis when it comes out of
        a ``lax.scan``).
    Aux data: the VJP's tree structure and, per VJP leaf, the index of the
    input leaf it is (``None``: a saved array).
    """

    def __init__(self, saved: tuple, treedef: Any, slots: tuple):
        self.saved = saved
        self.treedef = treedef
        self.slots = slots

    def tree_flatten(self):
        return (self.saved,), (self.treedef, self.slots)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


def linearize(fn: Callable, *primals: Any, drop: Any = ()) -> tuple[Any, Linearized]:
    """``fn(*primals)`` and its VJP, keeping activations and none of ``primals``.

    Args:
      fn: the layer.
      *primals: its inputs (pytrees of arrays, traced).
      drop: arrays (or ``jax.ShapeDtypeStruct``s) that must not be kept, the
        layer's flat gathered parameters, inputs or computed inside ``fn``;
        checked by shape: no kept array may have one's shape and dtype.

    Returns:
      ``(out, linearized)``: ``fn``'s output and its :class:`Linearized` VJP,
      for :func:`pull_back` with the same ``primals``.

    Raises:
      RuntimeError: if an array shaped like a leaf of ``drop`` would be
        kept, or if this JAX's ``jax.vjp`` copies its inputs.
    """
    if not _vjp_references_inputs():
        raise RuntimeError(
            "keep_activations: this JAX's jax.vjp copies the inputs its VJP needs, so the "
            "gathered parameters would stay alive until the backward pass; run with "
            "keep_activations=False, which recomputes each layer"
        )
    out, vjp = jax.vjp(jax.checkpoint(fn, policy=POLICY), *primals)
    leaves, treedef = jax.tree.flatten(vjp)
    position = {id(x): i for i, x in enumerate(jax.tree.leaves(primals))}
    slots = tuple(position.get(id(x)) for x in leaves)
    saved = tuple(x for x, slot in zip(leaves, slots) if slot is None)
    dropped = {(x.shape, x.dtype) for x in jax.tree.leaves(drop)}
    copies = [x for x in saved if (x.shape, x.dtype) in dropped]
    if copies:
        raise RuntimeError(
            f"keep_activations: the layer's VJP would keep {len(copies)} array(s) shaped like "
            f"its gathered parameters {sorted(dropped, key=str)} until the backward pass; run "
            "with keep_activations=False, which recomputes each layer"
        )
    return out, Linearized(saved, treedef, slots)


def pull_back(linearized: Linearized, primals: tuple, cotangent: Any) -> tuple:
    """The VJP of :func:`linearize` applied to ``cotangent``.

    Args:
      linearized: from :func:`linearize`.
      primals: the same inputs, in the same structure (values may be
        recomputed, e.g. parameters gathered again).
      cotangent: like ``fn``'s output.

    Returns:
      A tuple of cotangents, one per primal, as ``jax.vjp``'s.
    """
    given = jax.tree.leaves(primals)
    saved = iter(linearized.saved)
    leaves = [next(saved) if slot is None else given[slot] for slot in linearized.slots]
    return jax.tree.unflatten(linearized.treedef, leaves)(cotangent)


@functools.cache
def _vjp_references_inputs() -> bool:
    """Whether ``jax.vjp`` under :data:`POLICY` keeps an input it needs as that very object."""
    found = []

    def probe(x):
        _, vjp = jax.vjp(jax.checkpoint(jnp.sin, policy=POLICY), x)
        found.append(any(leaf is x for leaf in jax.tree.leaves(vjp)))
        return x

    jax.make_jaxpr(probe)(jax.ShapeDtypeStruct((2,), jnp.float32))
    return found[0]
