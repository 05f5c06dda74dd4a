"""Update rules: what a trainer runs each step, and which one a config calls for.

Two rules implement :class:`UpdateRule`:

* :class:`~zeropp_jax.step.gradient_rule.GradientRule`: qgZ on gradients
  (``qgz_target="gradient"``), then any optax optimizer;
* :class:`~zeropp_jax.step.onebit_adam.OneBitAdamRule`: 1-bit Adam, qgZ on
  Adam's momentum (``qgz_target="momentum"``).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeropp_jax.config import ZeroConfig
from zeropp_jax.step.geometry import StepGeometry
from zeropp_jax.step.gradient_rule import GradientRule
from zeropp_jax.step.onebit_adam import OneBitAdam, OneBitAdamRule
from zeropp_jax.step.state import TrainState, ZeroOptState

# How far apart two leaves' stand-in updates may be and still count as the
# same (float32 rounding of one Adam step of 1.0).
_UNIFORM_RTOL = 1e-5


class UpdateRule(Protocol):
    """What a trainer runs each step (``GradientRule``, ``OneBitAdamRule``).

    ``init`` builds the optimizer state of the float32 units, ``update``
    is one whole optimizer step under ``jit`` (it calls ``jax.shard_map``
    itself, since where its exchange happens is the rule's business).
    """

    optimizer: Any

    def init(self, geo: StepGeometry, params: dict) -> ZeroOptState: ...

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


def check_leaf_uniform(optimizer: optax.GradientTransformation, params: Any) -> None:
    """Refuses an optax optimizer that treats the model's leaves differently.

    The trainer runs the optimizer on flat float32 units, not on the model's
    leaves, so a per-leaf mask or label (``optax.adamw(mask=...)``,
    ``optax.masked``, ``optax.multi_transform``) or a transform of each
    matrix as a matrix would act on whole units instead: silently on all
    parameters or on none. The check runs one step of the optimizer on a
    stand-in of ``params`` (same tree, each leaf a single 1.0 of the leaf's
    rank, gradients 1.0), where an optimizer that treats every element alike
    moves every leaf by the same amount.

    Args:
      optimizer: an optax ``GradientTransformation``.
      params: the full parameters (arrays or ``jax.ShapeDtypeStruct``).

    Raises:
      ValueError: naming two leaves the optimizer moves differently.
    """
    ones = jax.tree.map(lambda x: jnp.ones((1,) * len(jnp.shape(x)), jnp.float32), params)
    updates, _ = optimizer.update(ones, optimizer.init(ones), ones)
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(updates)[0]) or ((), ())
    moves = np.array([float(np.asarray(u).reshape(-1)[0]) for u in leaves])
    if moves.size and not np.allclose(moves, moves[0], rtol=_UNIFORM_RTOL, atol=0.0):
        other = int(np.argmax(~np.isclose(moves, moves[0], rtol=_UNIFORM_RTOL, atol=0.0)))
        raise ValueError(
            "the optimizer treats parameter leaves differently (a per-leaf mask or label, "
            "or a transform of each matrix): on a stand-in step it moves "
            f"{jax.tree_util.keystr(paths[0])} by {moves[0]:.3g} and "
            f"{jax.tree_util.keystr(paths[other])} by {moves[other]:.3g}. The trainer runs "
            "the optimizer on flat units, where such a choice would silently hold for all "
            "leaves or none: use one setting for every leaf (e.g. optax.adamw without "
            "mask), or train without the trainer"
        )
