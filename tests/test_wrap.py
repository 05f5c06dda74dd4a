"""The wrap policy on an unmodified Flax model (Hugging Face Flax GPT-2).

``make_trainer(..., wrap=(FlaxGPT2Block,), example_batch=...)``: each block is
its own unit, gathered when called and again in the backward; embeddings and
the final LayerNorm form the remainder unit. Models are built from configs
(nothing is downloaded).
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.analysis.comm_report import comm_report
from zeropp_jax.step import wrap as wrap_policy

# Hugging Face's Flax GPT-2 is a test dependency (the "test" extra).
from transformers import GPT2Config, FlaxGPT2LMHeadModel  # noqa: E402
from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block  # noqa: E402

SEQ, VOCAB = 16, 128


@pytest.fixture(autouse=True)
def _allow_rank_promotion():
    # transformers' Flax GPT-2 broadcasts ranks implicitly (attention masks).
    with jax.numpy_rank_promotion("allow"):
        yield


def gpt2(n_layer, n_embd=64, init=True):
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=VOCAB,
                        n_positions=SEQ)
    model = FlaxGPT2LMHeadModel(config, seed=0, _do_init=init)
    if init:
        return model.module, model.params
    shapes = jax.eval_shape(lambda k: model.init_weights(k, (1, SEQ)), jax.random.key(0))
    return model.module, shapes


def loss_of(module):
    def loss_fn(params, batch):
        x = batch["x"]
        pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        out = module.apply({"params": params}, x, jnp.ones_like(x), pos, deterministic=True)
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["y"]).mean()

    return loss_fn


def batch_at(step, rows=16):
    x = np.random.default_rng(step).integers(0, VOCAB, (rows, SEQ)).astype(np.int32)
    return {"x": x, "y": np.roll(x, -1, axis=1)}


def batch_shapes(rows=16):
    return {k: jax.ShapeDtypeStruct((rows, SEQ), jnp.int32) for k in ("x", "y")}


def test_discover_finds_each_block():
    module, params = gpt2(3, init=False)
    paths, stacked = wrap_policy.discover(loss_of(module), params, batch_shapes(),
                                          (FlaxGPT2Block,))
    assert paths == [("transformer", "h", str(i)) for i in range(3)]
    assert stacked == []


@pytest.mark.slow
def test_wrapped_loss_is_the_loss_outside_a_trainer():
    module, params = gpt2(2)
    loss = loss_of(module)
    wrapped = wrap_policy.wrap_loss(loss, (FlaxGPT2Block,))
    assert float(wrapped(params, batch_at(0))) == float(loss(params, batch_at(0)))


def test_bad_wrap_classes():
    module, params = gpt2(1, init=False)
    with pytest.raises(TypeError, match="flax.linen.Module classes"):
        wrap_policy.discover(loss_of(module), params, batch_shapes(), (int,))
    import flax.linen as nn

    with pytest.raises(ValueError, match="never called a module of class Conv"):
        wrap_policy.discover(loss_of(module), params, batch_shapes(), (nn.Conv,))


def test_wrap_needs_an_example_batch():
    module, params = gpt2(1, init=False)
    with pytest.raises(ValueError, match="example_batch"):
        zp.make_trainer(loss_of(module), optax.adam(1e-3), params,
                        mesh=zp.make_mesh(2, 4), wrap=(FlaxGPT2Block,))


@pytest.mark.slow
def test_wrapped_gpt2_matches_optax_on_one_device(tmp_path):
    module, params = gpt2(2)
    loss = loss_of(module)
    opt = optax.adam(1e-2)
    trainer = zp.make_trainer(
        loss, opt, params, mesh=zp.make_mesh(2, 4),
        config=zp.ZeroConfig(compute_dtype="float32"),
        wrap=(FlaxGPT2Block,), example_batch=batch_shapes(),
    )
    assert trainer.layout.names == ("rest", "transformer/h/0", "transformer/h/1")
    state = trainer.init(params)

    @jax.jit
    def ref_step(p, o, b):
        value, g = jax.value_and_grad(loss)(p, b)
        updates, o = opt.update(g, o, p)
        return optax.apply_updates(p, updates), o, value

    ref, ref_opt = params, opt.init(params)
    for step in range(6):
        state, metrics = trainer.step(state, batch_at(step))
        ref, ref_opt, ref_loss = ref_step(ref, ref_opt, batch_at(step))
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
    full = trainer.gather_params(state)
    assert jax.tree.structure(full) == jax.tree.structure(params)
    # Adam turns float32 rounding in near-zero gradients (biases) into
    # differences up to ~lr per step; a misplaced leaf would differ by far more.
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)

    # checkpoints and exports keep the user's parameter tree
    import flax.serialization
    from zeropp_jax.checkpoint import Checkpointer, export_params

    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(6, state, trainer)
    restored = trainer.gather_params(ckpt.restore(trainer))
    ckpt.close()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored),
                                                    jax.tree.leaves(full)))
    for source, kw in [(state, {"trainer": trainer}), (tmp_path / "ckpt", {})]:
        export_params(source, tmp_path / "p.msgpack", **kw)
        tree = flax.serialization.msgpack_restore((tmp_path / "p.msgpack").read_bytes())
        assert jax.tree.structure(tree) == jax.tree.structure(params)


def _compiled(n_layer):
    module, shapes = gpt2(n_layer, n_embd=128, init=False)
    trainer = zp.make_trainer(
        loss_of(module), optax.adam(1e-3), shapes, mesh=zp.make_mesh(2, 4),
        config=zp.ZeroConfig(compute_dtype="float32"),
        wrap=(FlaxGPT2Block,), example_batch=batch_shapes(),
    )
    compiled = trainer.compile_from_shapes(shapes, batch_shapes())
    gathers = sum(c.count for c in comm_report(compiled, mesh_shape=(2, 4)).collectives
                  if c.kind == "all-gather")
    return gathers, compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_wrapped_gpt2_gathers_per_block_and_memory_is_flat_in_depth():
    gathers2, temp2 = _compiled(2)
    gathers8, temp8 = _compiled(8)
    # each block twice (forward, backward recompute) plus the remainder once
    assert (gathers2, gathers8) == (2 * 2 + 1, 2 * 8 + 1)
    assert temp8 <= 1.3 * temp2, (temp2, temp8)


@pytest.mark.slow
def test_blocks_under_nn_scan_are_one_stacked_unit():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.Dense(h.shape[-1])(jnp.tanh(nn.LayerNorm()(h))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=3)
            h, _ = scan(name="blocks")(nn.Dense(32)(x), None)
            return nn.Dense(1)(h)[:, 0]

    model = Model()
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    batch = {"x": x, "y": x.sum(axis=1)}
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    opt = optax.adam(1e-2)
    trainer = zp.make_trainer(
        loss, opt, params, mesh=zp.make_mesh(2, 4),
        config=zp.ZeroConfig(compute_dtype="float32"), wrap=(Block,), example_batch=batch,
    )
    assert [(u.name, u.stack) for u in trainer.layout.units] == [("rest", None), ("blocks", 3)]
    state, ref, ref_opt = trainer.init(params), params, opt.init(params)
    for _ in range(4):
        state, metrics = trainer.step(state, batch)
        value, g = jax.value_and_grad(loss)(ref, batch)
        updates, ref_opt = opt.update(g, ref_opt, ref)
        ref = optax.apply_updates(ref, updates)
        np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=1e-5)
    compiled = trainer.compile_from_shapes(jax.eval_shape(lambda: params), batch)
    gathers = sum(c.count for c in comm_report(compiled, mesh_shape=(2, 4)).collectives
                  if c.kind == "all-gather")
    assert gathers == 2 * 3 + 1
