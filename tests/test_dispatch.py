"""The qgZ schedule as run: which variant each step takes, chosen on the host.

Choosing a step's variant reads nothing from the device, except the gradient
RMS when a gate is set (so step ``n + 1`` can be dispatched before step ``n``
ends).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp

from _util import mesh_of

# Warm-up steps 0 and 1, then a refresh every third step: steps 2, 3, 5
# compressed, step 4 full precision.
SCHEDULE = dict(qgz_warmup_steps=2, qgz_refresh_every=3)
STEPS = 6


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def tiny(**overrides):
    """A two-layer MLP's trainer on the 2x4 mesh, its parameters and batches."""
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(4, 16)).astype(np.float32),
              "w2": rng.normal(size=(16, 2)).astype(np.float32)}
    batches = [{"x": rng.normal(size=(16, 4)).astype(np.float32),
                "y": rng.normal(size=(16, 2)).astype(np.float32)} for _ in range(STEPS)]
    config = zp.ZeroConfig.from_preset("zeropp", compute_dtype="float32", **overrides)
    opt = zp.onebit_adam(1e-2) if config.qgz_target == "momentum" else optax.adam(1e-2)
    trainer = zp.make_trainer(loss_fn, opt, params, mesh=mesh_of(2, 4), config=config)
    return trainer, params, batches


@pytest.fixture(scope="module")
def run():
    return tiny(**SCHEDULE)


@contextlib.contextmanager
def no_device_reads():
    """Fails any read of an array's value to the host.

    ``jax.transfer_guard_device_to_host`` does it on accelerators; XLA:CPU
    arrays share host memory and are not guarded (jax-ml/jax#16602), so on
    CPU the property ``int``, ``float`` and ``jax.device_get`` read through
    raises too. The probe checks itself, so a JAX that reads otherwise makes
    this test fail rather than pass unchecked.
    """
    array_type = type(jnp.zeros(()))
    value = array_type._value

    def read(self):
        raise AssertionError("an array was read from the device")

    array_type._value = property(read)
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            with pytest.raises(Exception):
                int(jnp.ones((), jnp.int32))
            yield
    finally:
        array_type._value = value


def expected_flags(trainer, steps):
    return [int(trainer.schedule.compress_at(i, float("inf"))) for i in steps]


def test_zeropp_steps_are_chosen_without_reading_the_device(run):
    trainer, params, batches = run
    state = trainer.init(params)
    metrics = []
    with no_device_reads():
        for batch in batches:
            state, m = trainer.step(state, batch)
            metrics.append(m)
    flags = [int(m["compressed"]) for m in metrics]
    # the warm-up boundary and a refresh fall inside the run
    assert flags == [0, 0, 1, 1, 0, 1] == expected_flags(trainer, range(STEPS))
    assert int(state.step) == STEPS


def test_a_state_the_trainer_did_not_return_continues_at_its_step(run):
    """A state rebuilt from host copies (as after a restore) has its step read once."""
    trainer, params, batches = run
    state = trainer.init(params)
    for batch in batches[:4]:
        state, _ = trainer.step(state, batch)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    restored = jax.tree.map(jax.device_put, jax.device_get(state), shardings)
    trainer.init(params)  # the last state the trainer returned is now at step 0
    flags = []
    for batch in batches[4:]:
        restored, m = trainer.step(restored, batch)
        flags.append(int(m["compressed"]))
    assert flags == expected_flags(trainer, range(4, STEPS)) == [0, 1]


@pytest.mark.slow
def test_gradient_qgz_warms_up_then_compresses_and_the_gate_reads_the_rms():
    trainer, params, batches = tiny(qgz_warmup_steps=3, qgz_target="gradient")
    state = trainer.init(params)
    flags = []
    for batch in batches[:5]:
        state, m = trainer.step(state, batch)
        flags.append(int(m["compressed"]))
        carry = sum(float(jnp.abs(c).max()) for c in state.opt_state.qgz.carry.values())
        assert (carry > 0) == bool(flags[-1])  # full precision flushes the carry
    assert flags == [0, 0, 0, 1, 1]

    gated, params, _ = tiny(qgz_min_grad_rms=1e9, qgz_warmup_steps=0, qgz_target="gradient")
    state = gated.init(params)
    for i, batch in enumerate(batches[:3]):
        state, m = gated.step(state, batch)
        assert int(m["compressed"]) == (1 if i == 0 else 0)  # rms unknown at step 0
