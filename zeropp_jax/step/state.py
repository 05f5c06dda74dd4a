"""The train state: what a step reads and writes (all leaves sharded arrays).

Field names and nesting are the checkpoint format's tree paths
(:mod:`zeropp_jax.checkpoint`): keep them stable.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.step.geometry import StepGeometry
from zeropp_jax.wire.qgz import QgzState


class ZeroOptState(NamedTuple):
    """Optimizer state: the update rule's state plus the qgZ state.

    Attributes:
      inner: the optax optimizer's state over the unit dict (float32 shards;
        the gradient rule), or
        :class:`~zeropp_jax.step.onebit_adam.OneBitAdamState` (1-bit Adam).
      qgz: :class:`~zeropp_jax.wire.qgz.QgzState` (error-feedback carry: of
        the gradient, or the sender carry of the momentum; the last step's
        gradient RMS).
    """

    inner: Any
    qgz: QgzState


class TrainState(NamedTuple):
    """Everything a step reads and writes.

    Attributes:
      step: int32 ``()``, optimizer steps taken.
      params: dict unit name -> float32 ``(U,)`` or ``(L, U)`` master
        weights, sharded ``P([None,] ("local", "node"))``; with
        ``ZeroConfig(node_replicated=True)`` one equal copy per node,
        ``(nodes, [L,] U)`` sharded ``P("node", [None,] "local")``.
      opt_state: :class:`ZeroOptState`.
    """

    step: jax.Array  # int32 ()
    params: dict  # name -> float32 ([L,] U), or (nodes, [L,] U) node-replicated
    opt_state: ZeroOptState


def initial_qgz_state(geo: StepGeometry) -> QgzState:
    """qgZ's state at step 0: zero sender carries (with error feedback), no RMS yet (``inf``)."""
    return QgzState(geo.zeros(geo.carry_specs(), per_node=True), jnp.full((), jnp.inf, jnp.float32))


def check_state(state: Any, form: tuple, method: str, *, placed: bool = True) -> None:
    """Refuses, saying why, what ``trainer.<method>`` cannot take: anything but a
    TrainState, one under a JAX transformation, one an earlier step consumed
    (its arrays donated), another trainer's (``form``: its tree structure, leaf
    shapes and mesh), or, with ``placed``, host copies and another mesh's
    arrays (``gather_params`` takes those: it only reads the values)."""
    compiled_here(f"trainer.{method}")
    if not isinstance(state, TrainState):
        raise TypeError(f"trainer.{method} takes the TrainState that trainer.init (or a "
                        f"step, or a checkpoint's restore) returned, not a {type(state).__name__}")
    leaves, treedef = jax.tree.flatten(state)
    try:
        consumed = any(x.is_deleted() for x in leaves if isinstance(x, jax.Array))
    except jax.errors.ConcretizationTypeError:
        raise TypeError(f"trainer.{method} was called under a JAX transformation (jax.jit, "
                        "jax.grad, ...): it compiles and places its own program; call it "
                        "on concrete arrays") from None
    structure, shapes, mesh = form
    if (treedef, [np.shape(x) for x in leaves]) != (structure, shapes):
        raise ValueError(
            f"this TrainState was not made for this trainer (its units or optimizer state "
            f"differ in structure or shape): trainer.{method} takes the states of the trainer "
            "that made them; move a state to another trainer (mesh, config, optimizer) "
            "through a checkpoint (Checkpointer.restore onto the new trainer)")
    if placed and not all(isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) == mesh
                          for x in leaves):
        raise ValueError(
            f"this TrainState's arrays are not on this trainer's mesh (host copies, or "
            f"another mesh's): trainer.{method} takes the states it makes, placed on "
            "its mesh; a state moves to another mesh through a checkpoint "
            "(Checkpointer.restore onto the new trainer)")
    if consumed:
        raise ValueError("this TrainState was given to an earlier trainer.step, which "
                         "consumed it (its arrays are donated); pass the state it returned")


def compiled_here(what: str) -> None:
    """Raises ``RuntimeError`` under ``jax.disable_jit()``: ``what`` runs its own
    compiled, sharded programs (a ``shard_map`` step, placement by ``out_shardings``),
    which JAX cannot run op by op."""
    if jax.config.jax_disable_jit:
        raise RuntimeError(f"{what} runs its own compiled programs over the mesh and does not "
                           "run under jax.disable_jit(); call it outside that context")


# TrainState.step is int32.
_INT32_STEPS = 2**31


def steps_taken(step: Any) -> int:
    """``step`` (the optimizer steps a state has taken) as an int, or ``ValueError``."""
    try:
        taken = None if isinstance(step, (bool, np.bool_)) else operator.index(step)
    except TypeError:
        taken = None
    if taken is None or not 0 <= taken < _INT32_STEPS:
        raise ValueError(f"step is the number of optimizer steps taken, an int in "
                         f"[0, 2**31); got {step!r}")
    return taken
