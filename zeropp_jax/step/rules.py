"""Update rules: what a trainer runs each step, and which one a config calls for.

Two rules implement :class:`UpdateRule`:

* :class:`~zeropp_jax.step.gradient_rule.GradientRule`: qgZ on gradients
  (``qgz_target="gradient"``), then any optax optimizer;
* :class:`~zeropp_jax.step.onebit_adam.OneBitAdamRule`: 1-bit Adam, qgZ on
  Adam's momentum (``qgz_target="momentum"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeropp_jax.config import ZeroConfig
from zeropp_jax.layout import ParamLayout
from zeropp_jax.tree_paths import leaf_indices
from zeropp_jax.step.geometry import StepGeometry
from zeropp_jax.step.gradient_rule import GradientRule
from zeropp_jax.step.leaf_masks import UnitLeaves, units_in_view
from zeropp_jax.step.adam import OneBitAdam
from zeropp_jax.step.onebit_adam import OneBitAdamRule
from zeropp_jax.step.state import TrainState, ZeroOptState

# Stand-in steps check_leaf_uniform takes until one moves a parameter: the
# first few run eagerly (most optimizers move at the first), the rest compiled
# (a learning rate held at 0 for some steps, optax.MultiSteps(k) moving only
# every k-th step). An optimizer still at rest after them passes with a
# warning that it was not checked.
_PROBE_EAGER_STEPS = 8
_PROBE_STEPS = 1024
# How near the units' stand-in moves must be to the leaves' (the same
# elements and global norm, summed in another order).
_SAME_MOVE_RTOL = 1e-5


class UpdateRule(Protocol):
    """What a trainer runs each step (``GradientRule``, ``OneBitAdamRule``).

    ``init`` builds the optimizer state of the float32 units,
    ``carried_over`` one from an optax state over the model's parameters (or
    none) at a step, ``update``
    is one whole optimizer step under ``jit`` (it calls ``jax.shard_map``
    itself, since where its exchange happens is the rule's business).
    """

    optimizer: Any

    def init(self, geo: StepGeometry, params: dict) -> ZeroOptState: ...

    def carried_over(self, geo: StepGeometry, opt_state: Any, params: Any,
                     reference: ZeroOptState, step: int) -> ZeroOptState: ...

    def update(
        self, geo: StepGeometry, loss_fn: Callable, state: TrainState, batch: Any, *,
        compress: bool, key: Any = None,
    ) -> tuple[TrainState, dict]: ...

    def extra_memory(self, geo: StepGeometry) -> int: ...


def rule_for(optimizer: Any, config: ZeroConfig) -> UpdateRule:
    """The update rule an optimizer and a config's ``qgz_target`` call for."""
    is_onebit = isinstance(optimizer, OneBitAdam)
    if config.qgz_target == "momentum" and not is_onebit:
        raise ValueError(
            "qgz_target='momentum' compresses Adam's momentum, so the trainer runs the "
            "optimizer itself: pass zeropp_jax.onebit_adam(learning_rate, ...) as the "
            f"optimizer (got {type(optimizer).__name__}), or use qgz_target='gradient' "
            "with any optax optimizer"
        )
    if is_onebit and config.qgz_target != "momentum":
        raise ValueError(
            "zeropp_jax.onebit_adam is the optimizer of qgz_target='momentum' (1-bit Adam); "
            f"the config has qgz_target={config.qgz_target!r}: set qgz_target='momentum' "
            "(with qgz on), or pass an optax optimizer such as optax.adam"
        )
    return OneBitAdamRule(optimizer) if is_onebit else GradientRule(optimizer)


def check_leaf_uniform(
    optimizer: optax.GradientTransformation, params: Any, layout: ParamLayout | None = None,
) -> None:
    """Refuses an optax optimizer that treats the model's leaves differently.

    The trainer runs the optimizer on flat float32 units, not on the model's
    leaves, so a per-leaf mask or label (``optax.adamw(mask=...)``,
    ``optax.masked``, ``optax.multi_transform``) would act on whole units
    instead: silently on all parameters or on none. The check runs the
    optimizer on a stand-in of ``params`` (same tree, each leaf a single 1.0
    of the leaf's rank, gradients 1.0) until a step moves something (a
    learning-rate warm-up from 0 or ``optax.MultiSteps`` moves nothing at
    first; one that moves nothing in ``_PROBE_STEPS`` is passed with a
    warning that nothing was checked); an optimizer that treats every
    element alike moves every leaf by exactly the same amount there. A rule
    by rank (``optax.contrib.muon`` for matrices) differs there too. With
    ``layout``, the optimizer also runs on a stand-in of what the trainer
    gives it (a dict of the units, each ``(k,)``, ``(1, k)`` when stacked, for
    a unit of ``k`` leaves: the same elements, so the same global norm), and
    must move every element as it moves the model's leaves (its update is
    traced in view of the units, each element one leaf, so
    :func:`zeropp_jax.masked` and its kin, which choose per leaf there, pass;
    leaves of one unit moved differently are refused otherwise): a choice by rank that
    is the same for every leaf (``x.ndim >= 2`` on a model of matrices)
    would hold for none of the flat units, per-leaf norms that do not cancel
    there (``optax.novograd``) would be taken per unit, and a mask or labels
    given as a pytree of the parameters do not fit the units' dict. Choices
    the stand-in cannot show pass unseen: masks by a leaf's shape, and
    per-leaf norms whose ratio cancels on it (``optax.lamb``), which act per
    unit in the trainer.

    Args:
      optimizer: an optax ``GradientTransformation``.
      params: the full parameters (arrays or ``jax.ShapeDtypeStruct``).
      layout: the trainer's units (``None``: the model's leaves only).

    Raises:
      ValueError: naming two leaves (or a leaf and the units) the optimizer
        moves differently, or why the stand-in step failed (e.g. an
        optimizer whose ``update`` needs more than gradients, state and
        parameters).
    """
    ones = jax.tree.map(lambda x: jnp.ones((1,) * len(jnp.shape(x)), jnp.float32), params)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(ones)[0]]
    if len(paths) < 2 and layout is None:
        return
    try:
        moves = _stand_in_moves(optimizer, ones)
    except Exception as e:  # re-raised with what was being checked
        raise ValueError(
            "make_trainer checks that the optimizer treats every parameter leaf alike by "
            "running it on a stand-in of the parameters (a 1.0 per leaf), and that failed: "
            f"{type(e).__name__}: {e}. An optimizer whose update needs more than "
            "(gradients, state, parameters) cannot run in the trainer; otherwise pass "
            "check_optimizer=False"
        ) from e
    first = jax.tree_util.keystr(paths[0])
    if moves is None:
        if layout is not None:  # the units may move where the leaves do not
            _check_on_units(*_units_outcome(optimizer, layout, ones),
                            {u.name: (first, None) for u in layout.units})
        warnings.warn(
            "make_trainer could not check that the optimizer treats every parameter leaf "
            f"alike: it moved no leaf in {_PROBE_STEPS} stand-in steps (gradients 1.0): a "
            "learning rate held at 0 that long, optax.MultiSteps accumulating over more "
            "steps, or every leaf frozen. If it has a per-leaf mask or label, the trainer "
            "applies it to whole units once it moves; check_optimizer=False silences this",
            stacklevel=3,
        )
        return
    # Leaf indices of each unit (one group of all leaves without a layout).
    groups = {"": list(range(len(paths)))} if layout is None else leaf_indices(ones, layout)
    odd = next(((name, m[0], i) for name, m in groups.items() for i in m
                if moves[i] != moves[m[0]]), None)
    expected = {name: (jax.tree_util.keystr(paths[m[0]]), float(moves[m[0]])) if m
                else (first, None) for name, m in groups.items()}
    outcome = None  # without a layout: the leaves alone
    if layout is not None:  # the units' stand-in, run once: its moves, or what it raised
        units, outcome = _units_outcome(optimizer, layout, ones)
        order = jax.tree.leaves({name: name for name in units})  # the units' leaf order
        if outcome is not None and not isinstance(outcome, Exception) and np.allclose(
                outcome, np.concatenate([moves[groups[n]] for n in order]),
                rtol=_SAME_MOVE_RTOL, atol=0):
            return  # the same per-leaf moves on the units: alike, or masks that hold there
        if isinstance(outcome, Exception) and not odd:  # said with its cause
            _check_on_units(units, outcome, expected)
    failed = (f" (on the units' stand-in it raised {type(outcome).__name__}: "
              f"{str(outcome).splitlines()[0]})" if isinstance(outcome, Exception) else "")
    if odd:
        name, i, j = odd
        a, b = (jax.tree_util.keystr(paths[k]) for k in (i, j))
        within = f", both in unit {name!r}" if layout is not None else ""
        raise ValueError(
            "the optimizer treats parameter leaves differently (a per-leaf mask or "
            "label, or a rule by a leaf's rank, like optax.contrib.muon's for matrices): "
            f"on a stand-in step it moves {a} by {moves[i]:.6g} and {b} by "
            f"{moves[j]:.6g}{within}{failed}. The trainer runs the optimizer on flat units, "
            "where optax's masks and labels would silently hold for a whole unit: use "
            "zeropp_jax.masked, zeropp_jax.multi_transform or zeropp_jax.adamw (optax's "
            "arguments; they choose per leaf inside the trainer), or one setting for every "
            "leaf of a unit, or train without the trainer (a rule by rank, or per-leaf norms, "
            "inside those is still taken per unit). An optimizer that draws noise per "
            "leaf (optax.add_noise) differs there too: pass check_optimizer=False for it"
        )
    if layout is not None:
        _check_on_units(units, outcome, expected)


def _units_stand_in(layout: ParamLayout, ones: Any) -> tuple[dict, UnitLeaves]:
    """The trainer's units as a stand-in (a dict by unit name, each ``(k,)`` or
    ``(1, k)`` when stacked, ``k`` the unit's leaves) and its view
    (:class:`~zeropp_jax.step.leaf_masks.UnitLeaves`: each leaf one element of
    its unit, the model's stand-in ``ones`` the tree a mask reads)."""
    units = {u.name: jnp.ones((len(u.leaves),) if u.stack is None else (1, len(u.leaves)),
                              jnp.float32) for u in layout.units}
    one_each = dataclasses.replace(layout, units=tuple(dataclasses.replace(
        u, leaves=tuple(dataclasses.replace(s, offset=i, size=1) for i, s in enumerate(u.leaves)),
        padded=len(u.leaves), stack=None if u.stack is None else 1) for u in layout.units))
    return units, UnitLeaves(ones, one_each)


def _units_outcome(optimizer: optax.GradientTransformation, layout: ParamLayout,
                   ones: Any) -> tuple[dict, np.ndarray | None | Exception]:
    """The units' stand-in (:func:`_units_stand_in`) and how its first step
    that moves anything moves each element (``None``: none did), or the
    exception the optimizer raised there (reported by :func:`_check_on_units`)."""
    units, view = _units_stand_in(layout, ones)
    try:
        return units, _stand_in_moves(optimizer, units, view)
    except Exception as e:  # noqa: BLE001 - reported with what was being checked
        return units, e


def _check_on_units(units: dict, moves: np.ndarray | None | Exception,
                    expected: dict) -> None:
    """Refuses an optimizer that moved the trainer's units (``units``, the
    stand-in of :func:`_units_outcome`, and ``moves``, its outcome) otherwise
    than the model's leaves: ``expected`` maps each unit to ``(leaf, move)``,
    a leaf of it and how far the model's stand-in step moved it (``None``: no
    leaf moved in the stand-in's steps)."""
    if isinstance(moves, Exception):
        e = moves
        raise ValueError(
            "the optimizer fails on the trainer's units: the trainer runs it on a dict of "
            f"flat float32 units ({sorted(units)}), not on the model's tree, and a stand-in "
            f"step there raised {type(e).__name__}: {e}. A mask or labels given as a pytree "
            "of the parameters cannot apply to the units: use zeropp_jax.masked, "
            "zeropp_jax.multi_transform or zeropp_jax.adamw (they choose per leaf inside the "
            "trainer), or one setting for every leaf, or train without the trainer") from e
    if moves is None and all(move is None for _, move in expected.values()):
        return
    order = jax.tree.leaves({name: name for name in units})  # the units' leaf order
    wanted = None if any(expected[n][1] is None for n in order) else np.concatenate(
        [np.full(units[n].size, expected[n][1], np.float32) for n in order])
    leaf, move = expected[order[0]]
    alike = "alike" if len({m for _, m in expected.values()}) == 1 else "alike within each unit"
    if moves is None or wanted is None or not np.allclose(moves, wanted, rtol=_SAME_MOVE_RTOL,
                                                          atol=0):
        got = "not at all" if moves is None else f"by {sorted(set(moves.tolist()))[:4]}"
        raise ValueError(
            "the optimizer moves "
            + (f"the model's leaves {alike} ({leaf} by {move:.6g}" if move is not None
               else "none of the model's leaves (")
            + f" on a stand-in step) but the trainer's flat units ({sorted(units)}, rank 1, "
            f"or 2 when stacked) {got}: it depends on a leaf's rank, size or norm (a mask "
            "like x.ndim >= 2 on a model of matrices, optax.contrib.muon there, "
            "optax.centralize, the per-leaf norms of optax.novograd or "
            "scale_by_param_block_norm), which the trainer would apply to whole flat units "
            "instead, silently; use one setting for every leaf, or a mask through "
            "zeropp_jax.masked (decided per leaf), check_optimizer=False to train it per unit knowingly, or train without "
            "the trainer")


def _stand_in_moves(optimizer: optax.GradientTransformation, ones: Any,
                    view: UnitLeaves | None = None) -> np.ndarray | None:
    """How far the first stand-in step that moves anything moves each leaf.

    ``ones``: the stand-in parameters (float32 ones: one element per leaf of
    the model's tree, or per leaf of a unit), also the gradients. Returns
    the update's elements, leaf after leaf, or ``None`` if no step of
    ``_PROBE_STEPS`` moved any.
    """
    def probe(state):  # every element's move in one array: one transfer a step
        with contextlib.nullcontext() if view is None else units_in_view(view):
            updates, state = optimizer.update(ones, state, ones)
        leaves = jax.tree.leaves(updates)
        return jnp.concatenate([u.reshape(-1).astype(jnp.float32) for u in leaves]), state

    state = optimizer.init(ones)
    for _ in range(_PROBE_EAGER_STEPS):  # most move at once: eager (op by op), no loop compiled
        moves, state = probe(state)
        moves = np.asarray(moves)
        if np.any(moves != 0):
            return moves

    def search(state):  # the rest in one compiled loop, to the first step that moves
        def still(carry):
            step, moves, _ = carry
            return (step < _PROBE_STEPS - _PROBE_EAGER_STEPS) & jnp.all(moves == 0)

        def advance(carry):
            step, _, state = carry
            return (step + 1, *probe(state))

        return jax.lax.while_loop(still, advance, (0, jnp.zeros_like(moves), state))[1]

    moves = np.asarray(jax.jit(search)(state))
    return moves if np.any(moves != 0) else None
