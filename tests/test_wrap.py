"""The wrap policy on unmodified Flax models (Hugging Face Flax GPT-2 and Llama).

``make_trainer(..., wrap=(Block,), example_batch=...)``: each block is its own
unit, gathered when called and again in the backward; embeddings, the final
norm and the head form the remainder unit. Models are built from configs
(nothing is downloaded).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.analysis.comm_report import comm_report
from zeropp_jax.step import wrap as wrap_policy

# Hugging Face's Flax models are a test dependency (the "test" extra).
from transformers import FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block
from transformers.models.llama.modeling_flax_llama import FlaxLlamaDecoderLayer

SEQ, VOCAB = 16, 128


@pytest.fixture(autouse=True)
def _allow_rank_promotion():
    # transformers' Flax models broadcast ranks implicitly (attention masks).
    with jax.numpy_rank_promotion("allow"):
        yield


def _gpt2(n_layer, width):
    config = GPT2Config(n_layer=n_layer, n_embd=width, n_head=4, vocab_size=VOCAB,
                        n_positions=SEQ)
    return FlaxGPT2LMHeadModel, config, FlaxGPT2Block, ("transformer", "h")


def _llama(n_layer, width):
    # Flax Llama's rotary table keeps only max_position_embeddings of its
    # 2 * head_dim columns, so it must be at least 2 * head_dim.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=n_layer, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4 * SEQ)
    return FlaxLlamaForCausalLM, config, FlaxLlamaDecoderLayer, ("model", "layers")


ARCHS = {"gpt2": _gpt2, "llama": _llama}


def hf_model(arch, n_layer, width=64, init=True):
    """``(module, params or their shapes, block class, the blocks' parent path)``."""
    model_class, config, block, parent = ARCHS[arch](n_layer, width)
    model = model_class(config, seed=0, _do_init=init)
    if init:
        return model.module, model.params, block, parent
    shapes = jax.eval_shape(lambda k: model.init_weights(k, (1, SEQ)), jax.random.key(0))
    return model.module, shapes, block, parent


def gpt2(n_layer, n_embd=64, init=True):
    module, params, _, _ = hf_model("gpt2", n_layer, n_embd, init)
    return module, params


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


def _tanh_block():
    """A Linen block class: ``tanh(Dense(8)(x))``."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(8)(x))

    return Block


def test_a_wrapped_module_named_like_the_remaining_units_is_refused():
    """Units are named by path; ``rest`` holds what no wrapped module does:
    a module named ``rest`` beside other parameters would share its name."""
    import flax.linen as nn

    Block = _tanh_block()

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1, name="out")(Block(name="rest")(nn.Dense(8, name="inp")(x)))

    model, x = Model(), np.ones((8, 4), np.float32)
    params = model.init(jax.random.key(0), x)["params"]
    with pytest.raises(ValueError, match="wrap= makes two units named 'rest'.*rename the module"):
        zp.make_trainer(lambda p, b: jnp.mean(model.apply({"params": p}, b)), optax.adam(1e-3),
                        params, mesh=zp.make_mesh(2, 4), wrap=(Block,), example_batch=x)


def counting_batch(step, rows=16):
    """Rows that count up from a random token: the next token is learnable."""
    first = np.random.default_rng(step).integers(0, VOCAB, (rows, 1))
    x = ((first + np.arange(SEQ)) % VOCAB).astype(np.int32)
    return {"x": x, "y": (x + 1) % VOCAB}


def wrapped_trainer(module, params, block, preset, optimizer, **config):
    return zp.make_trainer(
        loss_of(module), optimizer, params, mesh=zp.make_mesh(2, 4),
        config=zp.ZeroConfig.from_preset(preset, compute_dtype="float32", **config),
        wrap=(block,), example_batch=batch_shapes(),
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_wrapped_model_matches_optax_on_one_device(arch, tmp_path):
    module, params, block, parent = hf_model(arch, 2)
    loss = loss_of(module)
    # A learnable batch and a moderate rate: the loss falls (the comparison
    # covers real training), and Adam does not blow float32 summation-order
    # differences up to the scale of the tolerance, as it does at 1e-2.
    opt = optax.adam(3e-3)

    @jax.jit
    def ref_step(p, o, b):
        value, g = jax.value_and_grad(loss)(p, b)
        updates, o = opt.update(g, o, p)
        return optax.apply_updates(p, updates), o, value

    ref, ref_opt, ref_losses = params, opt.init(params), []
    for step in range(20):
        ref, ref_opt, value = ref_step(ref, ref_opt, counting_batch(step))
        ref_losses.append(float(value))
    assert ref_losses[-1] < 0.6 * ref_losses[0], ref_losses

    for preset in ("zero3", "hpz"):
        trainer = wrapped_trainer(module, params, block, preset, opt)
        blocks = tuple("/".join(parent + (str(i),)) for i in range(2))
        assert trainer.layout.names == ("rest",) + blocks
        state, losses = trainer.init(params), []
        for step in range(20):
            state, metrics = trainer.step(state, counting_batch(step))
            losses.append(float(metrics["loss"]))
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=preset)
        full = trainer.gather_params(state)
        assert jax.tree.structure(full) == jax.tree.structure(params)
        # Adam turns float32 rounding in near-zero gradients (biases) into
        # differences up to ~lr per step; a misplaced leaf would differ by far more.
        for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3, err_msg=preset)

    # checkpoints and exports keep the user's parameter tree
    import flax.serialization
    from zeropp_jax.checkpoint import Checkpointer, export_params

    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(20, state, trainer)
    restored = trainer.gather_params(ckpt.restore(trainer))
    ckpt.close()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored),
                                                    jax.tree.leaves(full)))
    for source, kw in [(state, {"trainer": trainer}), (tmp_path / "ckpt", {})]:
        export_params(source, tmp_path / "p.msgpack", **kw)
        tree = flax.serialization.msgpack_restore((tmp_path / "p.msgpack").read_bytes())
        assert jax.tree.structure(tree) == jax.tree.structure(params)


@pytest.mark.slow
@pytest.mark.parametrize("arch,preset", [("gpt2", "qwz"), ("llama", "zeropp")])
def test_wrapped_model_trains_with_compression(arch, preset):
    module, params, block, _ = hf_model(arch, 2)
    # 1-bit Adam freezes Adam's second moment after the warm-up: after 2 steps
    # the compact wire's 128-value blocks diverged here at lr 1e-2 (and at
    # 3e-3), after 6 they train (float32 scales per 32 signs trained after 2)
    steps, warmup = 24, 6
    if preset == "zeropp":  # int8 weights, hpZ, 1-bit Adam after a short warm-up
        trainer = wrapped_trainer(module, params, block, preset, zp.onebit_adam(1e-2),
                                  qgz_warmup_steps=warmup)
    else:  # int8 weights
        trainer = wrapped_trainer(module, params, block, preset, optax.adam(1e-2))
    state, losses, compressed = trainer.init(params), [], 0
    for step in range(steps):
        state, metrics = trainer.step(state, counting_batch(step))
        losses.append(float(metrics["loss"]))
        compressed += int(metrics["compressed"])
    assert np.mean(losses[-4:]) < 0.75 * losses[0], losses
    if preset == "zeropp":
        # all but the warm-up and the second-moment refreshes cross nodes in 1 bit
        refreshes = (steps - warmup) // trainer.config.qgz_refresh_every
        assert compressed == steps - warmup - refreshes > steps // 2, compressed
    else:
        assert compressed == 0


def _compiled(arch, n_layer, width):
    module, shapes, block, _ = hf_model(arch, n_layer, width, init=False)
    trainer = wrapped_trainer(module, shapes, block, "zero3", optax.adam(1e-3))
    compiled = trainer.compile_from_shapes(shapes, batch_shapes())
    gathers = sum(c.count for c in comm_report(compiled, mesh_shape=(2, 4)).collectives
                  if c.kind == "all-gather")
    return gathers, compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_wrapped_gpt2_gathers_per_block_and_memory_is_flat_in_depth():
    gathers2, temp2 = _compiled("gpt2", 2, 128)
    gathers8, temp8 = _compiled("gpt2", 8, 128)
    # each block twice (forward, backward recompute) plus the remainder once
    assert (gathers2, gathers8) == (2 * 2 + 1, 2 * 8 + 1)
    assert temp8 <= 1.3 * temp2, (temp2, temp8)


@pytest.mark.slow
def test_wrapped_llama_gathers_each_decoder_layer_twice():
    gathers, _ = _compiled("llama", 3, 64)
    assert gathers == 2 * 3 + 1


def _bart():
    """``(params, loss, block classes)``: a Flax BART encoder-decoder,
    whose encoder and decoder layers are two block classes."""
    from transformers import BartConfig, FlaxBartForConditionalGeneration
    from transformers.models.bart.modeling_flax_bart import (
        FlaxBartDecoderLayer, FlaxBartEncoderLayer)

    config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=SEQ)
    model = FlaxBartForConditionalGeneration(config, seed=0)
    module = model.module

    def loss(params, batch):
        x = batch["x"]
        pos = jnp.broadcast_to(jnp.arange(SEQ), x.shape)
        dec = jnp.concatenate([jnp.zeros_like(x[:, :1]), batch["y"][:, :-1]], axis=1)
        out = module.apply({"params": params}, x, jnp.ones_like(x), dec, jnp.ones_like(dec),
                           pos, pos, deterministic=True)
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["y"]).mean()

    return model.params, loss, (FlaxBartEncoderLayer, FlaxBartDecoderLayer)


@pytest.mark.slow
def test_an_encoder_decoder_with_two_block_classes_trains_like_optax():
    params, loss, blocks = _bart()
    opt = optax.sgd(0.1)  # no Adam: float32 rounding stays rounding
    trainer = zp.make_trainer(loss, opt, params, mesh=zp.make_mesh(2, 4),
                              config=zp.ZeroConfig(compute_dtype="float32"),
                              wrap=blocks, example_batch=batch_shapes())
    assert trainer.layout.names == ("rest",) + tuple(
        f"model/{part}/layers/{i}" for part in ("encoder", "decoder") for i in range(2))
    state, ref = _steps_match_optax(trainer, loss, opt, params, counting_batch(0), 3)
    for a, b in zip(jax.tree.leaves(trainer.gather_params(state)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _steps_match_optax(trainer, loss, opt, params, batch, steps):
    """``steps`` trainer steps, each loss equal to plain optax's on the same
    parameters; returns the trainer's state and optax's parameters."""
    state, ref, ref_opt = trainer.init(params), params, opt.init(params)
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        value, g = jax.value_and_grad(loss)(ref, batch)
        updates, ref_opt = opt.update(g, ref_opt, ref)
        ref = optax.apply_updates(ref, updates)
        np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=1e-5)
    return state, ref


def _nn_scan_model():
    """``(Block, loss, params, batch)``: three blocks under Linen's ``nn.scan``."""
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

    return Block, loss, params, batch


def test_blocks_under_nn_scan_are_one_stacked_unit():
    Block, loss, params, batch = _nn_scan_model()
    opt = optax.adam(1e-2)
    trainer = zp.make_trainer(
        loss, opt, params, mesh=zp.make_mesh(2, 4),
        config=zp.ZeroConfig(compute_dtype="float32"), wrap=(Block,), example_batch=batch,
    )
    assert [(u.name, u.stack) for u in trainer.layout.units] == [("rest", None), ("blocks", 3)]
    state, _ = _steps_match_optax(trainer, loss, opt, params, batch, 4)
    compiled = trainer.compile_from_shapes(jax.eval_shape(lambda: params), batch)
    gathers = sum(c.count for c in comm_report(compiled, mesh_shape=(2, 4)).collectives
                  if c.kind == "all-gather")
    assert gathers == 2 * 3 + 1


def test_blocks_of_a_model_applied_to_part_of_the_trained_tree_are_found():
    """The blocks' Linen scope paths are relative to what their model was
    applied to: two models trained together (``{"enc": ..., "head": ...}``)
    and the whole variables dict (``{"params": ...}``) find their blocks by
    identity; a scanned block's slice cannot be, and is refused saying why."""
    import flax.linen as nn

    Block = _tanh_block()

    class Enc(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = Block()(nn.Dense(8)(x))
            return Block()(h)

    enc, head = Enc(), nn.Dense(1)
    x = np.random.default_rng(0).normal(size=(16, 5)).astype(np.float32)
    batch = {"x": x, "y": np.sin(x.sum(axis=1))}
    variables = enc.init(jax.random.key(0), x)
    params = {"enc": variables["params"],
              "head": head.init(jax.random.key(1), np.zeros((1, 8), np.float32))["params"]}

    def loss(p, b):
        h = enc.apply({"params": p["enc"]}, b["x"])
        return jnp.mean((head.apply({"params": p["head"]}, h)[:, 0] - b["y"]) ** 2)

    _wrapped_trains_like_optax((Block,), params, loss, batch,
                               ("rest", "enc/Block_0", "enc/Block_1"))
    _wrapped_trains_like_optax(
        (Block,), variables, lambda v, b: jnp.mean((enc.apply(v, b["x"]).sum(1) - b["y"]) ** 2),
        batch, ("rest", "params/Block_0", "params/Block_1"))

    with pytest.raises(ValueError, match=r"found in nested dicts \(not tuples or lists\)"):
        zp.make_trainer(lambda p, b: loss({"enc": p[0], "head": p[1]}, b), optax.sgd(0.1),
                        (params["enc"], params["head"]), mesh=zp.make_mesh(2, 4),
                        wrap=(Block,), example_batch=batch)
    Scanned, scan_loss, scan_params, scan_batch = _nn_scan_model()
    with pytest.raises(ValueError, match=r"called Block blocks with parameters \(at \['blocks'\] "
                                         r"of the variables.*none was found as a sub-dict of the tree"):
        zp.make_trainer(lambda p, b: scan_loss(p["model"], b), optax.sgd(0.1),
                        {"model": scan_params}, mesh=zp.make_mesh(2, 4),
                        wrap=(Scanned,), example_batch=scan_batch)

    def own_error(p, b):  # the loss's own error, after a block was called, is its own
        loss({"enc": p[0], "head": p[1]}, b)
        raise ValueError("the loss's own error")

    with pytest.raises(ValueError, match="the loss's own error"):
        zp.make_trainer(own_error, optax.sgd(0.1), (params["enc"], params["head"]),
                        mesh=zp.make_mesh(2, 4), wrap=(Block,), example_batch=batch)


def test_blocks_not_found_beside_blocks_found_are_named_in_a_warning():
    """One block's parameters reach it as a copy the loss made (here scaled):
    it cannot be its own unit and is gathered whole with the rest, which a
    warning names; the block found is still wrapped."""
    import flax.linen as nn

    Block = _tanh_block()

    class Enc(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = Block()(x)
            return Block()(h)

    enc = Enc()
    batch = _linen_batch()
    params = {"enc": enc.init(jax.random.key(0), batch["x"])["params"]}

    def loss(p, b):
        enc_p = dict(p["enc"], Block_1=jax.tree.map(lambda w: 0.5 * w, p["enc"]["Block_1"]))
        return jnp.mean((enc.apply({"params": enc_p}, b["x"]).sum(1) - b["y"]) ** 2)

    with pytest.warns(UserWarning, match=r"called Block blocks with parameters it made from "
                                         r"the tree .*\(at \['Block_1'\] of the variables.*"
                                         r"stay in the 'rest' unit, gathered whole"):
        paths, _ = wrap_policy.discover(loss, params, batch, (Block,))
    assert paths == [("enc", "Block_0")]
    teacher = jax.tree.map(lambda w: w + 1.0, params["enc"])  # a frozen model, closed over

    def distill(p, b):
        student = enc.apply({"params": p["enc"]}, b["x"])
        return jnp.mean((student - jax.lax.stop_gradient(enc.apply({"params": teacher}, b["x"]))) ** 2)

    for quiet in (distill, lambda p, b: jnp.mean(enc.apply({"params": p["enc"]}, b["x"]))):
        with warnings.catch_warnings():  # every block of the trained tree found: nothing to say
            warnings.simplefilter("error", UserWarning)
            assert wrap_policy.discover(quiet, params, batch, (Block,))[0] == [
                ("enc", "Block_0"), ("enc", "Block_1")]


def test_nn_scan_blocks_refresh_hpz_secondary_once_per_step():
    """A stacked unit that runs through ``zp.layer`` (here ``nn.scan``'s, under
    the wrap policy) forms each layer's hpZ secondary in the forward and keeps
    it for the recomputation: the bytes across nodes of a refresh up front."""
    Block, loss, params, batch = _nn_scan_model()
    reports, losses = {}, {}
    for prefetch in (True, False):
        config = zp.ZeroConfig.from_preset("hpz", compute_dtype="float32", prefetch=prefetch)
        trainer = zp.make_trainer(loss, optax.adam(1e-2), params, mesh=zp.make_mesh(2, 4),
                                  config=config, wrap=(Block,), example_batch=batch)
        assert trainer.geometry.forms_secondary_per_layer(trainer.layout.unit("blocks")) \
            == prefetch
        state = trainer.init(params)
        losses[prefetch] = []
        for _ in range(3):
            state, metrics = trainer.step(state, batch)
            losses[prefetch].append(float(metrics["loss"]))
        compiled = trainer.compile_from_shapes(jax.eval_shape(lambda: params), batch)
        reports[prefetch] = comm_report(compiled, mesh_shape=(2, 4))
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)
    assert reports[True].inter_node_bytes == reports[False].inter_node_bytes


def test_every_parameter_inside_a_wrapped_block_leaves_no_remainder_unit():
    """``Block()(Block()(x))`` with ``wrap=(Block,)``: nothing is left for the
    remainder, so there is no ``rest`` unit, and the step is optax's step."""
    import flax.linen as nn

    Block = _tanh_block()

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block()(Block()(x))[:, 0]

    model = Model()
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    batch = {"x": x, "y": x.sum(axis=1) * 0.1}
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    opt = optax.sgd(0.1)
    trainer = zp.make_trainer(loss, opt, params, mesh=zp.make_mesh(2, 4),
                              config=zp.ZeroConfig(compute_dtype="float32"),
                              wrap=(Block,), example_batch=batch)
    assert sorted(trainer.layout.names) == ["Block_0", "Block_1"]  # no "rest"
    state, ref = _steps_match_optax(trainer, loss, opt, params, batch, 2)
    gathered = trainer.gather_params(state)
    assert jax.tree.structure(gathered) == jax.tree.structure(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 gathered, ref)


def _linen_model(block_body, x_width=8, **scan_axes):
    """``(Block, model)``: two ``Block``s under ``nn.scan`` of ``nn.remat``
    (``scan_axes``: the scan's ``variable_axes`` beyond ``params``), then one
    under ``nn.remat`` alone; ``block_body(h) -> h`` is the block's body."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _=None):
            return block_body(h), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(nn.remat(Block), variable_axes={"params": 0, **scan_axes},
                           split_rngs={"params": True, "dropout": True}, length=2)
            h, _ = scan(name="blocks")(nn.Dense(16)(x), None)
            h, _ = nn.remat(Block)(name="last")(h)
            return nn.Dense(1)(h)[:, 0]

    return Block, Model()


def _linen_batch():
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(axis=1))}


def _dropout_trainer(rate, opt, **kw):
    """A wrapped trainer of blocks with dropout under ``nn.scan``/``nn.remat``,
    whose loss passes ``rngs=`` (``kw``: more of make_trainer's arguments);
    ``(trainer, loss(p, b, key), params, batch)``."""
    import flax.linen as nn

    def body(h):
        return h + nn.Dropout(rate, deterministic=False)(jnp.tanh(nn.Dense(16)(h)))

    Block, model = _linen_model(body)
    batch = _linen_batch()
    params = jax.jit(model.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                 batch["x"])["params"]

    def loss(p, b, key):
        return jnp.mean((model.apply({"params": p}, b["x"], rngs={"dropout": key}) - b["y"]) ** 2)

    trainer = zp.make_trainer(loss, opt, params, mesh=zp.make_mesh(2, 4), rng=0,
                              config=zp.ZeroConfig(compute_dtype="float32"),
                              wrap=(Block,), example_batch=batch, **kw)
    assert [(u.name, u.stack) for u in trainer.layout.units] == [
        ("rest", None), ("blocks", 2), ("last", None)]
    return trainer, loss, params, batch


def test_linen_blocks_under_scan_and_remat_take_the_loss_rngs():
    """The blocks' dropout keys (``make_rng`` under ``nn.scan``/``nn.remat``:
    tracers of those transforms) enter each layer as its inputs, not captured
    by its backward: new masks each step, the same again from the same state."""
    # sgd(0.0) moves no leaf, which the optimizer check cannot judge
    trainer, _, params, batch = _dropout_trainer(0.5, optax.sgd(0.0), check_optimizer=False)
    losses = []
    for _ in range(2):
        state = trainer.init(params)
        for _ in range(2):
            state, metrics = trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[0] != losses[1], losses
    assert losses[:2] == losses[2:], losses


@pytest.mark.slow
def test_linen_blocks_under_scan_and_remat_train_like_optax():
    """The same with dropout at rate 0 (the keys are drawn, the masks are
    ones): the steps are plain optax's on one device."""
    opt = optax.sgd(0.1)
    trainer, loss, params, batch = _dropout_trainer(0.0, opt)
    _steps_match_optax(trainer, jax.jit(lambda p, b: loss(p, b, jax.random.key(5))), opt,
                       params, batch, 2)


def test_wrapped_linen_blocks_read_frozen_batch_stats():
    """Blocks with ``BatchNorm`` in eval mode read ``batch_stats`` (sliced by
    ``nn.scan`` for the stacked ones): the collection enters each layer."""
    import flax.linen as nn

    def body(h):
        return h + nn.BatchNorm(use_running_average=True)(jnp.tanh(nn.Dense(16)(h)))

    Block, model = _linen_model(body, batch_stats=0)
    batch = _linen_batch()
    variables = jax.jit(model.init)(jax.random.key(0), batch["x"])
    params = variables["params"]
    stats = jax.tree.map(lambda s: s + np.float32(0.5), variables["batch_stats"])

    def loss(p, b):
        out = model.apply({"params": p, "batch_stats": stats}, b["x"])
        return jnp.mean((out - b["y"]) ** 2)

    opt = optax.sgd(0.1)
    trainer = zp.make_trainer(loss, opt, params, mesh=zp.make_mesh(2, 4),
                              config=zp.ZeroConfig(compute_dtype="float32"),
                              wrap=(Block,), example_batch=batch)
    assert trainer.layout.names == ("rest", "blocks", "last")
    _steps_match_optax(trainer, jax.jit(loss), opt, params, batch, 2)


def test_a_linen_loss_writing_batch_stats_is_warned_about():
    """``apply(..., mutable=["batch_stats"])`` in the loss: the running
    averages cannot leave the step (only parameters are carried), which the
    first step says; eval mode and a collection the apply creates (``sow``)
    are not warned about."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
            self.sow("losses", "h", h.mean())  # a collection the apply creates
            return nn.Dense(1)(h)[:, 0]

    net, batch = Net(), _linen_batch()
    variables = net.init(jax.random.key(0), batch["x"], False)

    def loss_of(train, mutable):
        def loss(p, b):
            out, _ = net.apply({"params": p, "batch_stats": variables["batch_stats"]}, b["x"],
                               train, mutable=mutable)
            return jnp.mean((out - b["y"]) ** 2)
        return loss

    def step(loss, params=variables["params"], batch=batch):
        trainer = zp.make_trainer(loss, optax.sgd(0.1), params, mesh=zp.make_mesh(2, 4),
                                  per_layer=False)
        trainer.step(trainer.init(params), batch)

    with pytest.warns(UserWarning, match=r"applies a Linen model with mutable collections "
                                         r"\(Net: batch_stats\).*running averages never move"):
        step(loss_of(True, ["batch_stats", "losses"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        step(loss_of(False, ["losses"]))
        _, scan_loss, scan_params, scan_batch = _nn_scan_model()  # nn.scan's body: all mutable
        step(scan_loss, scan_params, scan_batch)


def test_a_pure_block_under_an_apply_with_mutable_collections_is_wrapped():
    """The loss's apply asks for mutable collections (here ``intermediates``,
    or a BatchNorm outside the blocks): a block that writes none trains as
    unwrapped; one that writes (BatchNorm in training mode) is refused."""
    import flax.linen as nn

    class Block(nn.Module):
        train_norm: bool = False

        @nn.compact
        def __call__(self, h):
            if self.train_norm:
                h = nn.BatchNorm(use_running_average=False)(h)
            return h + nn.Dense(8)(jnp.tanh(h))

    class Net(nn.Module):
        train_norm: bool = False

        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = Block(self.train_norm)(x)
            return nn.Dense(1)(x)[:, 0]

    batch = _linen_batch()
    for train_norm in (False, True):
        net = Net(train_norm)
        variables = net.init(jax.random.key(0), batch["x"])

        def loss(p, b, net=net, variables=variables):
            out, _ = net.apply({**variables, "params": p}, b["x"],
                               mutable=["intermediates", "batch_stats"])
            return jnp.mean((out - b["y"]) ** 2)

        def make():
            return zp.make_trainer(loss, optax.adam(0.01), variables["params"],
                                   mesh=zp.make_mesh(2, 4), wrap=(Block,), example_batch=batch)
        if train_norm:
            with pytest.raises(ValueError, match="writes a variable.*must be pure"):
                make()
        else:  # nothing is written: no warning either
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                _steps_match_optax(make(), loss, optax.adam(0.01), variables["params"], batch, 2)


def test_a_wrapped_block_sowing_into_a_collection_the_loss_takes_is_refused():
    """Its sown values could not leave the step: they would vanish from the
    loss silently (an aux loss summed from them), so make_trainer refuses."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            h = h + nn.Dense(8)(jnp.tanh(h))
            self.sow("losses", "aux", jnp.mean(h ** 2))
            return h

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = Block()(x)
            return nn.Dense(1)(x)[:, 0]

    batch, net = _linen_batch(), Net()
    params = net.init(jax.random.key(0), batch["x"])["params"]

    def loss(p, b):
        out, state = net.apply({"params": p}, b["x"], mutable=["losses"])
        return jnp.mean((out - b["y"]) ** 2) + sum(jax.tree.leaves(state["losses"]))

    with pytest.raises(ValueError, match=r"writes collection\(s\) \['losses'\] \(sow"):
        zp.make_trainer(loss, optax.adam(0.01), params, mesh=zp.make_mesh(2, 4),
                        wrap=(Block,), example_batch=batch)


def test_a_loss_may_return_loss_and_aux():
    """``(loss, aux)``, as jax.value_and_grad(has_aux=True) takes: the step
    trains exactly as with the loss alone, and ``metrics["aux"]`` holds each
    leaf averaged over micro-batches and devices (a constant and an int too)."""
    params = {"w": np.linspace(-1, 1, 8, dtype=np.float32).reshape(8, 1)}
    batch = _linen_batch()

    def plain(p, b):
        return jnp.mean(((b["x"] @ p["w"])[:, 0] - b["y"]) ** 2)

    def with_aux(p, b):
        value = plain(p, b)
        return value, {"mse": value, "rows": b["x"].shape[0], "one": 1.0,
                       "x0": jnp.mean(b["x"][:, 0])}

    runs = []
    for loss in (plain, with_aux):
        trainer = zp.make_trainer(loss, optax.adam(0.1), params, mesh=zp.make_mesh(2, 4),
                                  config=zp.ZeroConfig(grad_accum=2))
        state, metrics = trainer.step(trainer.init(params), batch)
        runs.append((trainer.gather_params(state)["w"], metrics))
    (w_plain, m_plain), (w_aux, m_aux) = runs
    np.testing.assert_array_equal(w_aux, w_plain)
    assert "aux" not in m_plain and m_aux["loss"] == m_plain["loss"]
    aux = {k: float(v) for k, v in m_aux["aux"].items()}
    assert aux["mse"] == pytest.approx(float(m_aux["loss"]), rel=1e-6)
    assert aux["rows"] == 1 and aux["one"] == 1  # 16 rows / 8 devices / 2 micro-batches
    assert aux["x0"] == pytest.approx(batch["x"][:, 0].mean(), rel=1e-5)
    for aux, message in (
            ({"mask": jnp.ones((), jnp.complex64)}, r"aux\['mask'\] has dtype complex64; aux "
                                                    "leaves must be real scalars"),
            ({"name": "x"}, r"aux\['name'\] is a str; aux leaves must be real scalars"),
            ({"logits": jnp.ones((2, 3))}, r"aux\['logits'\] has shape \(2, 3\); aux leaves "
                                           "must be scalars.*jnp.mean")):
        trainer = zp.make_trainer(lambda p, b, aux=aux: (plain(p, b), aux), optax.sgd(0.1),
                                  params, mesh=zp.make_mesh(2, 4))
        with pytest.raises(ValueError, match=message):
            trainer.step(trainer.init(params), batch)
    trainer = zp.make_trainer(lambda p, b: (plain(p, b), 1.0, 2.0), optax.sgd(0.1), params,
                              mesh=zp.make_mesh(2, 4))
    with pytest.raises(ValueError, match=r"or a \(loss, aux\) tuple; got a tuple of 3"):
        trainer.step(trainer.init(params), batch)


def _hf_decay_mask(params):
    """Weight decay everywhere but biases and LayerNorm scales, the way
    Hugging Face's Flax examples build it (by key path)."""
    from flax import traverse_util

    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict(
        {k: k[-1] != "bias" and k[-2:] not in (("ln_1", "scale"), ("ln_2", "scale"),
                                               ("ln_f", "scale")) for k in flat})


@pytest.mark.parametrize("optimizer, refused", [
    (optax.adamw(1e-3, mask=_hf_decay_mask), True),
    (optax.multi_transform({"train": optax.adam(1e-3), "freeze": optax.set_to_zero()},
                           lambda p: jax.tree_util.tree_map_with_path(
                               lambda k, _: "freeze" if "wte" in str(k) else "train", p)), True),
    # a warm-up from 0 moves nothing on the first stand-in step
    (optax.adamw(optax.linear_schedule(0.0, 1e-3, 100), mask=_hf_decay_mask), True),
    (optax.adamw(1e-3), False),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, mask=lambda p: jax.tree.map(
        lambda _: True, p))), False),
], ids=["adamw-hf-mask", "multi_transform-freeze", "adamw-hf-mask-warmup-from-0", "adamw",
        "clip-adamw-uniform-mask"])
def test_per_leaf_optimizer_choices_are_refused_not_silently_unit_wide(optimizer, refused):
    """The trainer's optimizer runs on flat units, so a per-leaf weight-decay
    mask or label would decay (or freeze) every parameter of a unit alike:
    it is refused at make_trainer, naming two leaves it moves differently;
    an optimizer that treats every leaf alike, uniform masks included, is
    accepted."""
    module, shapes = gpt2(2, init=False)
    build = functools.partial(zp.make_trainer, loss_of(module), optimizer, shapes,
                              mesh=zp.make_mesh(2, 4), wrap=(FlaxGPT2Block,),
                              example_batch=batch_shapes())
    if refused:
        with pytest.raises(ValueError, match=r"treats parameter leaves differently.*\['"):
            build()
    else:
        build()


def test_the_optimizer_check_can_be_skipped_and_says_why_it_failed():
    """Per-leaf noise (optax.add_noise) looks like a mask on the stand-in step:
    refused, unless check_optimizer=False; an optimizer whose stand-in step
    raises is named with the cause."""
    module, shapes = gpt2(1, init=False)
    noisy = optax.chain(optax.add_noise(0.1, 0.55, 0), optax.sgd(1e-2))
    build = functools.partial(zp.make_trainer, loss_of(module), mesh=zp.make_mesh(2, 4),
                              wrap=(FlaxGPT2Block,), example_batch=batch_shapes())
    with pytest.raises(ValueError, match="check_optimizer=False"):
        build(noisy, shapes)
    build(noisy, shapes, check_optimizer=False)
    with pytest.raises(ValueError, match=r"stand-in.*that failed: TypeError"):
        build(optax.lbfgs(), shapes)



def _token_model(Model, rngs=False):
    """``(params, loss, batch)`` of a Linen model of tokens (``(16, SEQ)`` int32
    to ``(16, SEQ, VOCAB)`` logits); with ``rngs``, the loss takes a dropout key."""
    model = Model()
    batch = counting_batch(0)
    params = jax.jit(model.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                 batch["x"])["params"]

    def xent(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    if rngs:
        return params, lambda p, b, key: xent(
            model.apply({"params": p}, b["x"], rngs={"dropout": key}), b["y"]), batch
    return params, lambda p, b: xent(model.apply({"params": p}, b["x"]), b["y"]), batch


def _wrapped_trains_like_optax(wrap, params, loss, batch, names):
    opt = optax.sgd(0.5)
    trainer = zp.make_trainer(loss, opt, params, mesh=zp.make_mesh(2, 4),
                              config=zp.ZeroConfig(compute_dtype="float32"),
                              wrap=wrap, example_batch=batch)
    assert trainer.layout.names == names
    state, ref = _steps_match_optax(trainer, loss, opt, params, batch, 2)
    gathered = trainer.gather_params(state)
    assert jax.tree.structure(gathered) == jax.tree.structure(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 gathered, ref)


@pytest.mark.slow
def test_wrapped_linen_modules_may_create_parameters_in_setup():
    """``nn.Embed`` and a block declaring a parameter in ``setup``: their
    ``setup`` runs inside the layer, on the gathered parameters."""
    import flax.linen as nn

    class SetupBlock(nn.Module):
        def setup(self):
            self.w = self.param("w", nn.initializers.normal(0.1), (16, 16))
            self.norm = nn.LayerNorm()

        def __call__(self, h):
            return h + jnp.tanh(self.norm(h) @ self.w)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Embed(VOCAB, 16, name="emb")(x)
            for i in range(2):
                h = SetupBlock(name=f"b{i}")(h)
            return nn.Dense(VOCAB)(h)

    _wrapped_trains_like_optax((nn.Embed, SetupBlock), *_token_model(Model),
                               ("rest", "emb", "b0", "b1"))


def test_wrapped_linen_modules_may_be_applied_by_other_methods():
    """A tied embedding (``emb(x)``, then ``emb.attend(h)``: two layers on one
    unit, their gradients summed) and a head applied only by a method that
    reads its ``variables`` (found by that call)."""
    import flax.linen as nn

    class Head(nn.Module):
        def setup(self):
            self.param("w", nn.initializers.normal(0.1), (VOCAB, 16))

        def project(self, h):
            return h @ self.variables["params"]["w"].T

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            emb = nn.Embed(VOCAB, 16, name="emb")
            h = jnp.tanh(nn.Dense(16)(emb(x)))
            return emb.attend(h) + Head(name="head").project(h)

    _wrapped_trains_like_optax((nn.Embed, Head), *_token_model(Model),
                               ("rest", "emb", "head"))


def test_frozen_dict_parameters_reach_the_loss_as_a_frozen_dict():
    """Parameters given as a ``FrozenDict`` (``flax.core.freeze``) and a loss
    calling its methods: make_trainer's check traces the loss with a
    ``FrozenDict`` too (it once rebuilt plain dicts: AttributeError). A bare
    class is taken for a tuple of one."""
    import flax.linen as nn
    from flax.core import FrozenDict, freeze

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            return h + jnp.tanh(nn.Dense(16)(h))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Embed(VOCAB, 16)(x)
            for i in range(2):
                h = Block(name=f"b{i}")(h)
            return nn.Dense(VOCAB)(h)

    params, loss, batch = _token_model(Model)

    def frozen_loss(p, b):
        assert isinstance(p, FrozenDict)
        return loss(p.unfreeze(), b)

    trainer = zp.make_trainer(frozen_loss, optax.sgd(0.1), freeze(params), mesh=zp.make_mesh(2, 4),
                              config=zp.ZeroConfig(compute_dtype="float32"),
                              wrap=Block, example_batch=batch)  # one class: (Block,)
    assert trainer.layout.names == ("rest", "b0", "b1")


@pytest.mark.parametrize("read", ["variables", "copy", "attribute"])
def test_a_wrapped_linen_modules_parameters_read_from_outside_are_refused(read):
    """Another module reading a wrapped ``Embed``'s table (Hugging Face
    GPT-2's tied head reads ``variables``; or a copy of its dict) is refused
    at make_trainer, as is an attribute its setup defines."""
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            emb = nn.Embed(VOCAB, 16, name="emb")
            h = jnp.tanh(nn.Dense(16)(emb(x)))
            table = {"variables": lambda: self.variables["params"]["emb"]["embedding"],
                     "copy": lambda: self.variables["params"]["emb"].copy()["embedding"],
                     "attribute": lambda: emb.embedding}[read]()
            return h @ table.T

    params, loss, batch = _token_model(Model)
    match = "defines in its setup" if read == "attribute" else "read outside its methods"
    with pytest.raises(ValueError, match=match):
        zp.make_trainer(loss, optax.sgd(0.1), params, mesh=zp.make_mesh(2, 4),
                        wrap=(nn.Embed,), example_batch=batch)


@pytest.mark.slow
def test_wrapped_linen_blocks_draw_the_dropout_masks_they_draw_unwrapped():
    """Blocks under ``nn.scan(nn.remat(...))`` and one block called twice, with
    dropout keys from ``rngs=``: each ``make_rng`` in a wrapped block gives the
    key it gives unwrapped (flax folds the scope path and a call counter into
    the root key), so the wrapped trainer's steps are the unwrapped one's."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _=None):
            return h + nn.Dropout(0.5, deterministic=False)(jnp.tanh(nn.Dense(16)(h))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dropout(0.5, deterministic=False)(nn.Embed(VOCAB, 16)(x))
            scan = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                           split_rngs={"params": True, "dropout": True}, length=2)
            h, _ = scan(name="blocks")(h, None)
            shared = Block(name="shared")
            h, _ = shared(shared(h)[0])
            return nn.Dense(VOCAB)(nn.Dropout(0.5, deterministic=False)(h))

    params, loss, batch = _token_model(Model, rngs=True)
    runs = {}
    for wrap in ((), (Block,)):
        trainer = zp.make_trainer(loss, optax.sgd(0.5), params, mesh=zp.make_mesh(2, 4),
                                  rng=0, config=zp.ZeroConfig(compute_dtype="float32"),
                                  wrap=wrap, example_batch=batch if wrap else None)
        state, losses = trainer.init(params), []
        for _ in range(2):
            state, metrics = trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[wrap] = losses, trainer.gather_params(state)
    assert trainer.layout.names == ("rest", "blocks", "shared")
    np.testing.assert_allclose(runs[(Block,)][0], runs[()][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 runs[(Block,)][1], runs[()][1])
