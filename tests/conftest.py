"""Test set-up: 8 simulated CPU devices and a strict JAX.

The device count must be fixed before JAX is imported anywhere, so this file
sets ``XLA_FLAGS`` at import time (pytest imports conftest first).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Strict dtype promotion is not used: optax itself (bias correction in adam)
# mixes Python floats and int32 step counts, which "strict" rejects.
jax.config.update("jax_numpy_dtype_promotion", "standard")
