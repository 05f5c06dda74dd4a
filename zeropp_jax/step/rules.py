"""Update rules: what a trainer runs each step, and which one a config calls for.

Two rules implement :class:`UpdateRule`:

* :class:`~zeropp_jax.step.gradient_rule.GradientRule`: qgZ on gradients
  (``qgz_target="gradient"``), then any optax optimizer;
* :class:`~zeropp_jax.step.onebit_adam.OneBitAdamRule`: 1-bit Adam, qgZ on
  Adam's momentum (``qgz_target="momentum"``).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from zeropp_jax.config import ZeroConfig
from zeropp_jax.step.geometry import StepGeometry
from zeropp_jax.step.gradient_rule import GradientRule
from zeropp_jax.step.onebit_adam import OneBitAdam, OneBitAdamRule
from zeropp_jax.step.state import TrainState, ZeroOptState


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
