"""The train step: geometry, update rules, gradient accumulation, trainer.

* :mod:`~zeropp_jax.step.gather`: per-layer gathering (``Unit``,
  ``gather``, ``layer``).
* :mod:`~zeropp_jax.step.trainer`: ``make_trainer`` and ``Trainer``.
* :mod:`~zeropp_jax.step.onebit_adam`: 1-bit Adam (its hyperparameters and
  Adam's arithmetic: :mod:`~zeropp_jax.step.adam`).
"""
