"""Sharded init, evaluation without an update, and which states a trainer takes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.models import gpt
from zeropp_jax.step.state_io import unit_init_program

from _util import MESH, TINY, gpt_loss, optimizer, tiny_batches

KEY = jax.random.key(7)


def _init(cfg=TINY):
    return functools.partial(gpt.init_params, cfg)


def _trainer(preset="zero3", per_layer=True, cfg=TINY, **overrides):
    config = zp.ZeroConfig.from_preset(preset, **overrides)
    stacked = ("blocks",) if per_layer else ()
    return zp.make_trainer(gpt_loss(cfg, per_layer), optimizer(config),
                           jax.eval_shape(_init(cfg), KEY), mesh=zp.make_mesh(*MESH),
                           config=config, per_layer=per_layer, stacked=stacked)


@pytest.mark.parametrize("preset,per_layer", [
    ("zero3", True), ("zero3", False), ("hpz", True), ("zeropp-max", True)])
def test_init_from_equals_init_of_the_jitted_init_function(preset, per_layer):
    trainer = _trainer(preset, per_layer)
    drawn = trainer.init_from(_init(), KEY)
    whole = trainer.init(jax.jit(_init())(KEY))
    for a, b in zip(jax.tree.leaves(drawn), jax.tree.leaves(whole)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = tiny_batches(batch_size=16).batch_at(0)
    _, m_drawn = trainer.step(drawn, batch)
    _, m_whole = trainer.step(whole, batch)
    assert float(m_drawn["loss"]) == float(m_whole["loss"])


def test_init_from_never_forms_a_stacked_unit_whole():
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=8, n_layers=8, d_model=128, n_heads=2)
    trainer = _trainer(cfg=cfg)
    (blocks,) = [u for u in trainer.layout.units if u.stack is not None]
    memory = unit_init_program(trainer.geometry, _init(cfg), blocks.name).lower(
        KEY).compile().memory_analysis()
    whole = 4 * int(np.prod(blocks.global_shape))
    # One layer of eight per device, and room to put it in place.
    assert memory.temp_size_in_bytes < whole / 2, (memory.temp_size_in_bytes, whole)
    assert memory.output_size_in_bytes == whole // trainer.n_devices


def test_init_from_refuses_another_tree_before_running_it():
    trainer = _trainer()

    def no_final_norm(key):
        params = gpt.init_params(TINY, key)
        return {k: v for k, v in params.items() if k != "ln_f"}

    with pytest.raises(ValueError, match="ln_f"):
        trainer.init_from(no_final_norm, KEY)


@pytest.mark.parametrize("preset", ["zero3", "qwz", "zeropp-max"])
def test_evaluate_gives_the_loss_a_step_sees_and_keeps_the_state(preset):
    trainer = _trainer(preset, grad_accum=2)
    state = trainer.init_from(_init(), KEY)
    batch = tiny_batches(batch_size=16).batch_at(0)
    evaluated = trainer.evaluate(state, batch)
    if preset == "zero3":  # no quantization: the plain model's loss
        plain = jax.jit(gpt_loss(TINY, per_layer=False))(jax.jit(_init())(KEY), batch)
        np.testing.assert_allclose(float(evaluated["loss"]), float(plain), rtol=1e-6)
    state, metrics = trainer.step(state, batch)  # not consumed by evaluate
    assert float(evaluated["loss"]) == float(metrics["loss"])
    assert float(trainer.evaluate(state, batch)["loss"]) < float(metrics["loss"])


def test_evaluate_averages_the_aux_like_a_step():
    def loss(params, batch):
        value = gpt_loss()(params, batch)
        return value, {"twice": 2 * value}

    trainer = zp.make_trainer(loss, optax.adam(1e-3), jax.eval_shape(_init(), KEY),
                              mesh=zp.make_mesh(*MESH), per_layer=True, stacked=("blocks",))
    state = trainer.init_from(_init(), KEY)
    out = trainer.evaluate(state, tiny_batches(batch_size=16).batch_at(0))
    np.testing.assert_allclose(float(out["aux"]["twice"]), 2 * float(out["loss"]), rtol=1e-6)


def test_a_trainer_refuses_states_it_cannot_take():
    trainer = _trainer()
    other = zp.make_trainer(gpt_loss(), optax.sgd(1e-3), jax.eval_shape(_init(), KEY),
                            mesh=zp.make_mesh(*MESH), per_layer=True, stacked=("blocks",))
    state = trainer.init_from(_init(), KEY)
    batch = tiny_batches(batch_size=16).batch_at(0)
    with pytest.raises(ValueError, match="not made for this trainer"):
        other.step(state, batch)
    with pytest.raises(ValueError, match="not made for this trainer"):
        other.gather_params(state)
    with pytest.raises(TypeError, match="not a dict"):
        trainer.step(state.params, batch)
    with pytest.raises(TypeError, match="under a JAX transformation"):
        jax.jit(trainer.step)(state, batch)
    trainer.step(state, batch)
    with pytest.raises(ValueError, match="consumed"):
        trainer.gather_params(state)


def test_make_trainer_says_what_a_config_and_example_batch_must_be():
    shapes = jax.eval_shape(_init(), KEY)
    with pytest.raises(TypeError, match=r"from_preset\(name\)"):
        zp.make_trainer(gpt_loss(), optax.adam(1e-3), shapes, mesh=zp.make_mesh(*MESH),
                        config="hpz", per_layer=True, stacked=("blocks",))
    with pytest.raises(ValueError, match="only read with wrap="):
        zp.make_trainer(gpt_loss(), optax.adam(1e-3), shapes, mesh=zp.make_mesh(*MESH),
                        per_layer=True, stacked=("blocks",), example_batch=np.zeros((8, 17)))


def test_an_integer_loss_is_refused():
    trainer = zp.make_trainer(lambda p, b: jnp.sum(b).astype(jnp.int32), optax.adam(1e-3),
                              {"w": np.ones((8,), np.float32)}, mesh=zp.make_mesh(*MESH))
    state = trainer.init({"w": np.ones((8,), np.float32)})
    with pytest.raises(ValueError, match="floating-point loss"):
        trainer.step(state, np.ones((8, 2), np.int32))


def test_gather_params_reads_adams_moments_in_the_models_structure_in_float32():
    params = {"a": np.linspace(-1, 1, 40, dtype=np.float32).reshape(8, 5).astype(jnp.bfloat16),
              "b": np.ones(3, np.float32)}

    def loss(p, x):
        return jnp.mean((x @ p["a"].astype(jnp.float32)) ** 2) + jnp.sum(p["b"] ** 2)

    opt = optax.adam(1e-2)
    trainer = zp.make_trainer(loss, opt, params, mesh=zp.make_mesh(*MESH))
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    state, _ = trainer.step(trainer.init(params), x)
    nu = trainer.gather_params(state.opt_state.inner[0].nu, dtype=None)
    master = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
    _, ref = opt.update(jax.grad(loss)(master, x), opt.init(master), master)
    for name in params:
        assert nu[name].dtype == np.float32  # not rounded to the bf16 parameter's dtype
        np.testing.assert_allclose(nu[name], ref[0].nu[name], rtol=1e-4)
    with pytest.raises(ValueError, match="placed like the master parameters"):
        trainer.gather_params({"a": np.ones(3)})
