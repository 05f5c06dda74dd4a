"""Sharded init, evaluation without an update, and which states a trainer takes."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.checkpoint import Checkpointer
from zeropp_jax.models import gpt
from zeropp_jax.step import state_io
from zeropp_jax.step.state_io import init_groups, init_program

from _util import MESH, TINY, gpt_loss, optimizer, tiny_batches

KEY = jax.random.key(7)


def _init(cfg=TINY):
    return functools.partial(gpt.init_params, cfg)


def _trainer(preset="zero3", per_layer=True, cfg=TINY, stacked=None, **overrides):
    config = zp.ZeroConfig.from_preset(preset, **overrides)
    stacked = (("blocks",) if per_layer else ()) if stacked is None else stacked
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
    memory = init_program(trainer.geometry, _init(cfg), (blocks,)).lower(
        KEY).compile().memory_analysis()
    whole = 4 * int(np.prod(blocks.global_shape))
    # One layer of eight per device, and room to put it in place.
    assert memory.temp_size_in_bytes < whole / 2, (memory.temp_size_in_bytes, whole)
    assert memory.output_size_in_bytes == whole // trainer.n_devices


def test_init_from_draws_small_units_together_with_the_same_values(monkeypatch):
    trainer = _trainer(per_layer=True, stacked=())
    names = lambda groups: [[u.name for u in g] for g in groups]  # noqa: E731
    assert names(init_groups(trainer.layout)) == [["blocks", "embed", "ln_f"]]
    assert names(init_groups(_trainer().layout)) == [["blocks"], ["embed", "ln_f"]]  # a stack alone
    together = trainer.init_from(_init(), KEY)
    monkeypatch.setattr(state_io, "_GROUP_BYTES", 0)  # no more than the largest unit, blocks
    assert names(init_groups(trainer.layout)) == [["blocks"], ["embed", "ln_f"]]
    # a stack (split over the devices) sets no budget: embed, the largest unstacked, alone
    assert names(init_groups(_trainer().layout)) == [["blocks"], ["embed"], ["ln_f"]]
    apart = trainer.init_from(_init(), KEY)
    for a, b in zip(jax.tree.leaves(together), jax.tree.leaves(apart)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _own_loop(optimizer, params, steps, start=0, opt_state=None):
    """``steps`` plain optax steps on the whole model (a user's own loop)."""
    loss = gpt_loss(TINY, per_layer=False)

    @jax.jit
    def step(p, s, batch):
        updates, s = optimizer.update(jax.grad(loss)(p, batch), s, p)
        return optax.apply_updates(p, updates), s

    opt_state = optimizer.init(params) if opt_state is None else opt_state
    data = tiny_batches(batch_size=16)
    for i in range(start, start + steps):
        params, opt_state = step(params, opt_state, data.batch_at(i))
    return params, opt_state


@pytest.mark.parametrize("preset", ["zero3", "hpz", "zeropp-max"])
def test_init_goes_on_from_an_optax_loops_state(preset):
    config = zp.ZeroConfig.from_preset(preset)
    optimizer = zp.onebit_adam(1e-2) if preset == "zeropp-max" else optax.adam(1e-2)
    trainer = zp.make_trainer(gpt_loss(TINY, True), optimizer, jax.eval_shape(_init(), KEY),
                              mesh=zp.make_mesh(*MESH), config=config, per_layer=True,
                              stacked=("blocks",))
    params, opt_state = _own_loop(optax.adam(1e-2), gpt.init_params(TINY, KEY), 3)
    carried = trainer.init(params, opt_state=opt_state, step=3)
    restarted = trainer.init(params, step=3)  # Adam's moments lost
    assert int(carried.step) == 3
    data = tiny_batches(batch_size=16)
    for i in range(3, 5):
        carried, metrics = trainer.step(carried, data.batch_at(i))
        restarted, _ = trainer.step(restarted, data.batch_at(i))
        assert int(metrics["compressed"]) == 0  # 1-bit Adam's warm-up: Adam itself
    want, _ = _own_loop(optax.adam(1e-2), params, 2, start=3, opt_state=opt_state)
    for got, kept, ref in zip(jax.tree.leaves(trainer.gather_params(carried)),
                              jax.tree.leaves(trainer.gather_params(restarted)),
                              jax.tree.leaves(want)):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    assert max(float(np.max(np.abs(k - r))) for k, r in zip(
        jax.tree.leaves(trainer.gather_params(restarted)), jax.tree.leaves(want))) > 1e-3


@pytest.mark.parametrize("optimizer", [optax.adam(1e-3), optax.adagrad(1e-3)])
def test_an_optimizers_own_init_carried_over_is_the_trainers_init(optimizer):
    params = gpt.init_params(TINY, KEY)
    trainer = zp.make_trainer(gpt_loss(TINY, True), optimizer, params, mesh=zp.make_mesh(*MESH),
                              per_layer=True, stacked=("blocks",))
    on_one_device = jax.device_put(optimizer.init(params), jax.devices()[3])
    carried = trainer.init(params, opt_state=on_one_device)
    fresh = trainer.init(params)  # adagrad's 0.1 in the padding too
    for a, b in zip(jax.tree.leaves(carried), jax.tree.leaves(fresh)):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_step_goes_on_with_the_schedule():
    trainer = _trainer("qgz", qgz_warmup_steps=2, qgz_target="gradient")
    params, batch = gpt.init_params(TINY, KEY), tiny_batches(batch_size=16).batch_at(0)
    assert int(trainer.step(trainer.init(params), batch)[1]["compressed"]) == 0
    assert int(trainer.step(trainer.init(params, step=2), batch)[1]["compressed"]) == 1


def test_init_refuses_a_state_or_step_it_cannot_carry_over():
    params = gpt.init_params(TINY, KEY)
    trainer = zp.make_trainer(gpt_loss(TINY, True), optax.adam(1e-3), params,
                              mesh=zp.make_mesh(*MESH), per_layer=True, stacked=("blocks",))
    with pytest.raises(ValueError, match=r"gives \(ScaleByAdamState\(count=\(\), mu=params, "
                       r"nu=params\), EmptyState\(\)\), opt_state is \(TraceState\(trace=params"):
        trainer.init(params, opt_state=optax.sgd(1e-3, momentum=0.9).init(params))
    with pytest.raises(ValueError, match="holds 0"):
        _trainer("zeropp-max").init(params, opt_state=optax.sgd(1e-3).init(params))
    other = gpt.init_params(dataclasses.replace(TINY, d_model=2 * TINY.d_model), KEY)
    with pytest.raises(ValueError, match="has shape"):
        trainer.init(params, opt_state=optax.adam(1e-3).init(other))
    lbfgs = optax.chain(optax.scale_by_lbfgs(), optax.scale(-1e-3))
    with pytest.raises(ValueError, match="with a history .* cannot be carried over"):
        zp.make_trainer(gpt_loss(TINY, True), lbfgs, params, mesh=zp.make_mesh(*MESH),
                        per_layer=True, stacked=("blocks",)).init(params,
                                                                  opt_state=lbfgs.init(params))
    for step in (-1, 2.5, True, 2**31):
        with pytest.raises(ValueError, match=r"an int in \[0, 2\*\*31\)"):
            trainer.init(params, step=step)
    assert int(trainer.init(params, step=jnp.int32(3)).step) == 3
    onebit = _trainer("zeropp-max", qgz_warmup_steps=2)  # v would stay 0 when compression starts
    for state in (None, optax.adam(1e-3).init(params)):
        with pytest.raises(ValueError, match="past its warm-up of 2 steps"):
            onebit.init(params, opt_state=state, step=2)
    onebit.init(params, step=1)


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


@pytest.mark.parametrize("rows, grad_accum", [(21, 1), (37, 2), (3, 1), (16, 2), (24, 2)])
def test_evaluate_takes_any_number_of_rows(rows, grad_accum):
    """A batch whose rows do not divide into devices x grad_accum: each row
    weighs as one (the plain model's mean over all rows, aux too), the state
    kept; 16 rows at grad_accum 2 divide (one program)."""
    def loss(params, batch):
        value = gpt_loss()(params, batch)
        return value, {"twice": 2 * value}

    trainer = zp.make_trainer(loss, optax.adam(1e-3), jax.eval_shape(_init(), KEY),
                              mesh=zp.make_mesh(*MESH), per_layer=True, stacked=("blocks",),
                              config=zp.ZeroConfig(grad_accum=grad_accum))
    state = trainer.init_from(_init(), KEY)
    batch = tiny_batches(batch_size=40).batch_at(0)
    batch = jax.tree.map(lambda x: x[:rows], batch)
    out = trainer.evaluate(state, batch)
    plain = jax.jit(gpt_loss(TINY, per_layer=False))(jax.jit(_init())(KEY), batch)
    np.testing.assert_allclose(float(out["loss"]), float(plain), rtol=2e-6)
    np.testing.assert_allclose(float(out["aux"]["twice"]), 2 * float(plain), rtol=2e-6)
    as_list = trainer.evaluate(state, jax.tree.map(lambda x: np.asarray(x).tolist(), batch))
    np.testing.assert_allclose(float(as_list["loss"]), float(out["loss"]), rtol=1e-7)
    if rows == 3:
        with pytest.raises(ValueError, match="not a rectangular array"):
            trainer.evaluate(state, [[1, 2], [3]])
    if rows % 8 == 0:  # already placed over the devices (24 rows: 3 a device, a tail of 8)
        placed = trainer.evaluate(state, jax.device_put(batch, trainer.batch_sharding))
        np.testing.assert_allclose(float(placed["loss"]), float(out["loss"]), rtol=1e-7)
    trainer.step(state, jax.tree.map(lambda x: x[:16], tiny_batches(batch_size=40).batch_at(0)))


def test_evaluates_tail_rows_draw_their_own_keys():
    """With ``rng=``, each row of a partial tail draws the key of its own row,
    as the head's rows do (not the keys of the head's first rows)."""
    from zeropp_jax.step.accumulate import micro_batch_key

    def loss(params, batch, key):  # a row's "loss": its key's draw (params unused but read)
        return jax.random.uniform(key) + 0 * jnp.sum(params["w"])

    params = {"w": np.ones((8, 8), np.float32)}
    trainer = zp.make_trainer(loss, optax.sgd(0.1), params, mesh=zp.make_mesh(*MESH), rng=3)
    state = trainer.init(params)
    rows = np.arange(11, dtype=np.float32)[:, None]  # 8 rows, one a device, then 3 alone
    draws = [jax.random.uniform(micro_batch_key(trainer.key, state.step, jnp.int32(r)))
             for r in range(11)]
    np.testing.assert_allclose(float(trainer.evaluate(state, rows)["loss"]),
                               float(np.mean(draws)), rtol=1e-6)


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
    with pytest.raises(ValueError, match="not on this trainer's mesh"):
        trainer.step(jax.device_get(state), batch)
    on_1x8 = zp.make_trainer(gpt_loss(), optimizer(), jax.eval_shape(_init(), KEY),
                             mesh=zp.make_mesh(1, 8), per_layer=True, stacked=("blocks",))
    with pytest.raises(ValueError, match="not on this trainer's mesh"):
        trainer.evaluate(on_1x8.init_from(_init(), KEY), batch)
    host = trainer.gather_params(jax.device_get(state))  # reading values: any placement
    jax.tree.map(np.testing.assert_array_equal, host, trainer.gather_params(state))
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


def test_the_compiling_tools_check_the_parameters_and_batch_as_a_step_does():
    trainer = _trainer(grad_accum=2)
    shapes = jax.eval_shape(_init(), KEY)
    batch = tiny_batches(batch_size=16).batch_at(0)
    abstract = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype), batch)
    assert trainer.compile_from_shapes(shapes, abstract) is not None
    state = trainer.init_from(_init(), KEY)
    assert trainer.lower(state, batch) is not None  # a host batch, placed as step places it
    with pytest.raises(ValueError, match="must be divisible by devices x grad_accum"):
        trainer.compile_from_shapes(shapes, jax.tree.map(lambda b: b[:8], batch))
    with pytest.raises(ValueError, match="must be divisible by devices x grad_accum"):
        trainer.lower(state, jax.tree.map(lambda b: b[:12], batch))
    with pytest.raises(ValueError, match="the parameters lack what make_trainer was given"):
        trainer.abstract_state({k: v for k, v in shapes.items() if k != "blocks"})
    with pytest.raises(ValueError, match=r"dtype must be 'original', None"):
        trainer.gather_params(state, dtype="bogus")
    assert jax.tree.leaves(trainer.gather_params(state, dtype=jnp.bfloat16))[0].dtype == jnp.bfloat16


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


def test_init_from_takes_a_key_committed_anywhere():
    trainer = _trainer()
    key = jax.device_put(KEY, jax.devices()[5])
    drawn = trainer.init_from(_init(), key, progress=True)
    whole = trainer.init(jax.jit(_init())(KEY))
    jax.tree.map(np.testing.assert_array_equal, drawn.params, whole.params)


def test_init_from_runs_under_the_trainers_mesh_set_by_the_caller():
    trainer = _trainer()
    whole = trainer.init(jax.jit(_init())(KEY))
    with jax.set_mesh(trainer.mesh):  # an explicit mesh: sharding constraints would be asserts
        drawn = trainer.init_from(_init(), jax.random.key(7))  # the key made on that mesh
    jax.tree.map(np.testing.assert_array_equal, drawn.params, whole.params)


def test_the_trainer_runs_on_its_own_mesh_whatever_mesh_the_caller_has_set(tmp_path):
    batch = tiny_batches(batch_size=16).batch_at(0)
    outside = _trainer()
    want, _ = outside.step(outside.init_from(_init(), KEY), batch)
    trainer = _trainer()  # fresh: nothing cached from outside the context
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        shapes = jax.eval_shape(_init(), KEY)  # carrying the caller's mesh
        assert trainer.abstract_state(shapes) is not None
        state, _ = trainer.step(trainer.init_from(_init(), KEY), batch)
        trainer.evaluate(state, batch)
        with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
            ckpt.save(1, state, trainer)
            state = ckpt.restore(trainer)
        got = trainer.gather_params(state)
    jax.tree.map(np.testing.assert_array_equal, got, outside.gather_params(want))


def test_what_runs_compiled_programs_refuses_disable_jit_and_init_transfers_explicitly():
    trainer = _trainer()
    state = trainer.init_from(_init(), KEY)
    with jax.disable_jit():
        for call in (lambda: trainer.init_from(_init(), KEY), lambda: trainer.gather_params(state),
                     lambda: trainer.step(state, tiny_batches(batch_size=16).batch_at(0))):
            with pytest.raises(RuntimeError, match="does not run under jax.disable_jit"):
                call()
    params = jax.jit(_init())(KEY)
    with jax.transfer_guard("disallow"):  # the step count is no implicit transfer
        trainer.init(params, step=3)


def test_init_from_warns_of_a_stack_built_by_a_python_loop():
    params = {"w": jnp.zeros((8, 256, 256))}  # 2 MiB: large enough to be warned of

    def loss(p, x):
        h, _ = zp.scan_layers(lambda h, w: (jnp.tanh(h @ zp.gather(w)), None), x, p["w"])
        return h.mean()

    def looped(key):  # each layer drawn alone, then stacked: not split over devices
        keys = jax.random.split(key, 8)
        return {"w": jnp.stack([jax.random.normal(k, (256, 256)) for k in keys])}

    def vmapped(key):
        return {"w": jax.vmap(lambda k: jax.random.normal(k, (256, 256)))(jax.random.split(key, 8))}

    trainer = zp.make_trainer(loss, optax.adam(1e-3), params, mesh=zp.make_mesh(*MESH),
                              per_layer=True, stacked=("w",))
    with pytest.warns(UserWarning, match="jax.vmap over per-layer keys"):
        trainer.init_from(looped, KEY)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer.init_from(vmapped, KEY)
        small = zp.make_trainer(loss, optax.adam(1e-3), {"w": jnp.zeros((2, 4, 4))},
                                mesh=zp.make_mesh(*MESH), per_layer=True, stacked=("w",))
        small.init_from(lambda k: {"w": jax.random.normal(k, (2, 4, 4))}, KEY)  # tiny: quiet


def test_init_from_runs_the_init_functions_python_once():
    calls = []

    def init_fn(key):  # an unseeded NumPy draw shared by two units
        calls.append(1)
        shared = np.random.default_rng().normal(size=(16,)).astype(np.float32)
        return {"w": jnp.stack([shared * (i + 1) for i in range(4)]) + 0 * key[0],
                "b": jnp.asarray(shared)}

    def loss(p, x):
        h, _ = zp.scan_layers(lambda h, w: (jnp.tanh(h * zp.gather(w)), None), x, p["w"])
        return (h + p["b"]).mean()

    trainer = zp.make_trainer(loss, optax.adam(1e-3), jax.eval_shape(init_fn, jnp.zeros(2)),
                              mesh=zp.make_mesh(*MESH), per_layer=True, stacked=("w",))
    calls.clear()
    params = trainer.gather_params(trainer.init_from(init_fn, jnp.zeros(2)))
    assert len(trainer.layout.units) == 2 and len(calls) <= 1  # 0: JAX's trace cache
    np.testing.assert_array_equal(params["w"][2], 3 * params["b"])


def test_an_nnx_model_starts_from_its_init_function_with_only_its_parameters_abstract():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(16, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return x + self.drop(jnp.tanh(self.dense(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.head = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)[:, 0]

    def make(key=0):
        return Model(nnx.Rngs(params=key, dropout=1))

    def criterion(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    with pytest.raises(ValueError, match="keep only the parameters abstract"):
        zp.nnx_loss(nnx.eval_shape(make), criterion)
    graphdef, shapes, _ = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    rest = jax.jit(lambda: nnx.split(make(), nnx.Param, ...)[2])()
    params, loss = zp.nnx_loss(nnx.merge(graphdef, shapes, rest), criterion)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 16)).astype(np.float32),
             "y": rng.normal(size=(16,)).astype(np.float32)}
    trainer = zp.make_trainer(loss, optax.adam(1e-3), params, mesh=zp.make_mesh(*MESH), rng=0,
                              wrap=(Block,), example_batch=batch)

    def init_fn(key):
        return nnx.to_pure_dict(nnx.state(make(key), nnx.Param))

    drawn = trainer.init_from(init_fn, KEY)
    jax.tree.map(np.testing.assert_array_equal, drawn.params,
                 trainer.init(jax.jit(init_fn)(KEY)).params)
    assert np.isfinite(float(trainer.step(drawn, batch)[1]["loss"]))


def test_evaluate_takes_a_loss_key_committed_anywhere():
    def loss(params, batch, key):
        return gpt_loss()(params, batch) + 0.0 * jax.random.uniform(key)

    trainer = zp.make_trainer(loss, optax.adam(1e-3), jax.eval_shape(_init(), KEY),
                              mesh=zp.make_mesh(*MESH), per_layer=True, stacked=("blocks",),
                              rng=jax.device_put(jax.random.key(1), jax.devices()[3]))
    state = trainer.init_from(_init(), KEY)
    batch = tiny_batches(batch_size=16).batch_at(0)
    assert float(trainer.evaluate(state, batch)["loss"]) == float(trainer.step(state, batch)[1]["loss"])


def test_gather_params_compiles_once_per_trainer_form(caplog):
    """An eval or export loop's repeated ``gather_params`` reuses its programs
    (it compiled one per unit at every call)."""
    import logging

    for preset in ("zero3", "zeropp-max"):
        trainer = _trainer(preset)
        state = trainer.init_from(_init(), KEY)
        first = trainer.gather_params(state)
        caplog.clear()
        with caplog.at_level(logging.WARNING), jax.log_compiles():
            again = trainer.gather_params(state)
        assert not [r for r in caplog.records if "Compiling" in r.getMessage()], preset
        jax.tree.map(np.testing.assert_array_equal, first, again)


def test_a_replay_cut_to_some_outputs_does_only_their_work():
    from zeropp_jax.step.traced import traced_once

    def fn(x):
        heavy = x
        for _ in range(20):
            heavy = jnp.sin(heavy) * 1.5
        return {"a": x * 2.0, "b": heavy}

    x = jnp.arange(4.0)
    replay, shapes = traced_once(fn, (x,))
    whole, cut = replay(x), replay(x, keep=frozenset({0}))  # leaf 0 is "a"
    np.testing.assert_array_equal(cut["a"], whole["a"])
    np.testing.assert_array_equal(cut["b"], np.zeros(4))  # not computed
    count = lambda **kw: len(jax.make_jaxpr(lambda v: replay(v, **kw))(x).eqns)  # noqa: E731
    assert count(keep=frozenset({0})) < 5 < 40 < count()
