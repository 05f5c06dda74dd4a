"""A loss that needs randomness (dropout) gets a key per step, micro-batch and device."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.checkpoint import Checkpointer

from _util import mesh_of


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.Dense(32)(x)
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        return nn.Dense(4)(x)


MODEL = DropoutMLP()
X = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
PARAMS = MODEL.init(jax.random.key(0), X[:1], train=False)["params"]


def dropout_loss(params, batch, key):
    out = MODEL.apply({"params": params}, batch, train=True, rngs={"dropout": key})
    return jnp.mean(out**2)


def trainer_on(mesh, **kwargs):
    return zp.make_trainer(dropout_loss, optax.sgd(0.1), PARAMS, mesh=mesh,
                           config=zp.ZeroConfig(compute_dtype="float32", **kwargs), rng=7)


def run(trainer, steps, state=None):
    state = trainer.init(PARAMS) if state is None else state
    losses = []
    for _ in range(steps):
        state, metrics = trainer.step(state, X)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_keys_differ_per_step_and_follow_the_seed():
    _, losses = run(trainer_on(mesh_of(2, 4)), 3)
    # the same batch and (nearly) the same parameters, new masks every step
    frozen = zp.make_trainer(dropout_loss, optax.sgd(0.0), PARAMS, mesh=mesh_of(2, 4), rng=7,
                             config=zp.ZeroConfig(compute_dtype="float32"))
    _, same_params = run(frozen, 3)
    assert len(set(same_params)) == 3, same_params
    _, again = run(trainer_on(mesh_of(2, 4)), 3)
    assert again == losses  # reproducible from the seed


@pytest.mark.parametrize("preset", ["zero3", pytest.param("zeropp", marks=pytest.mark.slow)])
def test_a_key_placed_on_the_mesh_draws_what_the_same_seed_does(preset):
    """A key made under ``jax.set_mesh`` (sharded on the mesh's explicit
    axes) is an argument of the step's shard_map, not closed over, which
    JAX refuses; an array the loss closes over there is refused by name."""
    mesh = mesh_of(2, 4)
    with jax.set_mesh(mesh):
        key = jax.random.key(7)
        table = jnp.ones((1, 8))
    opt = zp.onebit_adam(0.1) if preset == "zeropp" else optax.sgd(0.1)
    config = zp.ZeroConfig.from_preset(preset, compute_dtype="float32")
    losses = {}
    for name, rng in (("on the mesh", key), ("a seed", 7)):
        trainer = zp.make_trainer(dropout_loss, opt, PARAMS, mesh=mesh, config=config, rng=rng)
        losses[name] = run(trainer, 2)[1]
    assert losses["on the mesh"] == losses["a seed"]
    closes = zp.make_trainer(lambda p, b: dropout_loss(p, b * table, jax.random.key(0)), opt,
                             PARAMS, mesh=mesh, config=config)
    with pytest.raises(ValueError, match="the loss closes over an array placed on the trainer's "
                       r"mesh .* pass it in the batch, or close over a NumPy"):
        run(closes, 1)


def test_each_device_and_micro_batch_draws_its_own_key():
    from zeropp_jax.step.accumulate import micro_batch_key

    def loss(params, batch, key):
        return jnp.mean(batch @ params["w"]) * jax.random.uniform(key)

    params = {"w": jnp.ones((3,))}
    trainer = zp.make_trainer(loss, optax.sgd(0.1), params, mesh=mesh_of(2, 4), rng=1,
                              config=zp.ZeroConfig(grad_accum=2))
    batch = np.random.default_rng(1).normal(size=(32, 3)).astype(np.float32)
    _, metrics = trainer.step(trainer.init(params), batch)
    # By hand: device d holds rows [4d, 4d + 4), micro-batch m rows [4d + 2m, 4d + 2m + 2).
    expected, keys = [], set()
    for first in range(0, 32, 2):
        key = micro_batch_key(trainer.key, jnp.int32(0), first)
        keys.add(tuple(np.asarray(jax.random.key_data(key))))
        expected.append(float(loss(params, batch[first:first + 2], key)))
    assert len(keys) == 16
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(expected), rtol=1e-6)


@pytest.mark.slow
def test_keys_do_not_depend_on_the_mesh_shape():
    _, a = run(trainer_on(mesh_of(2, 4)), 3)
    _, b = run(trainer_on(mesh_of(1, 8)), 3)
    _, c = run(trainer_on(mesh_of(4, 2)), 3)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(a, c, rtol=1e-6)


def test_resume_with_dropout_is_bit_exact(tmp_path):
    trainer = trainer_on(mesh_of(2, 4))
    _, whole = run(trainer, 6)
    state, first = run(trainer, 3)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(3, state, trainer)
        ckpt.wait()
        restored = ckpt.restore(trainer)
    _, rest = run(trainer, 3, restored)
    assert first + rest == whole


def test_bad_rng():
    with pytest.raises(ValueError, match="rng must be an integer seed or a PRNG key"):
        zp.make_trainer(dropout_loss, optax.sgd(0.1), PARAMS, mesh=mesh_of(2, 4), rng="seven")



def test_a_loss_and_rng_that_do_not_fit_are_refused_at_make_trainer():
    """rng= means a third argument, the key: a loss without one (or one that
    needs it, without rng=) is named with the fix before anything is traced."""
    def keyless(params, batch):
        return dropout_loss(params, batch, jax.random.key(0))

    with pytest.raises(TypeError, match=r"calls loss_fn\(params, batch, key\), which this "
                       r"loss_fn does not accept .* add one, or leave out rng="):
        zp.make_trainer(keyless, optax.sgd(0.1), PARAMS, mesh=mesh_of(2, 4), rng=0)
    with pytest.raises(TypeError, match=r"calls loss_fn\(params, batch\), which .*'key'.* "
                       r"make_trainer is given rng="):
        zp.make_trainer(dropout_loss, optax.sgd(0.1), PARAMS, mesh=mesh_of(2, 4))


class NnxDropoutMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def test_nnx_module_with_rngs_and_dropout_trains_with_fresh_masks(tmp_path):
    model = NnxDropoutMLP(nnx.Rngs(0, dropout=1))
    params, loss_fn = zp.nnx_loss(model, lambda m, b: jnp.mean(m(b) ** 2))

    def make(lr):
        return zp.make_trainer(loss_fn, optax.sgd(lr), params, mesh=mesh_of(2, 4), rng=3,
                               config=zp.ZeroConfig(compute_dtype="float32"))

    frozen, trainer = make(0.0), make(0.1)
    state = frozen.init(params)
    masks = []
    for _ in range(3):
        state, metrics = frozen.step(state, X)
        masks.append(float(metrics["loss"]))
    assert len(set(masks)) == 3, masks  # same parameters, a new mask every step

    state, losses = trainer.init(params), []
    for step in range(6):
        state, metrics = trainer.step(state, X)
        losses.append(float(metrics["loss"]))
        if step == 2:
            with Checkpointer(str(tmp_path)) as ckpt:
                ckpt.save(3, state, trainer)
                ckpt.wait()
    assert np.mean(losses[3:]) < np.mean(losses[:3])
    with Checkpointer(str(tmp_path)) as ckpt:
        resumed = ckpt.restore(trainer)
    for step in range(3):
        resumed, metrics = trainer.step(resumed, X)
        assert float(metrics["loss"]) == losses[3 + step]
    nnx.update(model, trainer.gather_params(state))  # trained weights back in the module
    assert np.allclose(model.l1.kernel[...], trainer.gather_params(state)["l1"]["kernel"])


def test_a_trainer_of_an_nnx_loss_with_streams_but_no_rng_warns():
    """Without ``rng=`` the streams ``nnx_loss`` would reseed stay fixed: the
    same dropout mask every step and device."""
    criterion = lambda m, b: jnp.mean(m(b) ** 2)  # noqa: E731
    params, loss_fn = zp.nnx_loss(NnxDropoutMLP(nnx.Rngs(0, dropout=1)), criterion)
    with pytest.warns(UserWarning, match=r"reseeds the model's random streams \['dropout'\] from a key, "
                                         r"but make_trainer has no rng=.*same dropout mask"):
        zp.make_trainer(functools.partial(loss_fn), optax.sgd(0.1), params, mesh=mesh_of(2, 4))
    params, fixed = zp.nnx_loss(NnxDropoutMLP(nnx.Rngs(0, dropout=1)), criterion, streams=())
    quiet_model = NnxDropoutMLP(nnx.Rngs(0, dropout=1))
    quiet_model.drop.rate = 0.0  # nothing drawn, nothing to warn about
    _, quiet = zp.nnx_loss(quiet_model, criterion)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        zp.make_trainer(fixed, optax.sgd(0.1), params, mesh=mesh_of(2, 4))
        zp.make_trainer(quiet, optax.sgd(0.1), params, mesh=mesh_of(2, 4))
        zp.make_trainer(loss_fn, optax.sgd(0.1), params, mesh=mesh_of(2, 4), rng=0)
