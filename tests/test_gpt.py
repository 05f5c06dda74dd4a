"""Tests for zeropp_jax.models.gpt."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zeropp_jax import models
from zeropp_jax.models import GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4, mlp_ratio=4)


@pytest.fixture(scope="module")
def params():
    return models.init_params(CFG, jax.random.key(0))


def _batch(seed=0, batch_size=4, seq_len=CFG.seq_len):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, CFG.vocab_size, (batch_size, seq_len + 1)), jnp.int32)


def _loss(params, batch, **kw):
    return models.loss_fn(params, batch, CFG, **kw)


# Shared jitted functions: compiled once per input dtype, reused across tests.
_jit_loss = jax.jit(_loss)
_jit_value_and_grad = jax.jit(jax.value_and_grad(_loss))
_jit_logits = jax.jit(models.logits_fn, static_argnums=2)


# --- config -----------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig(n_layers=0)
    with pytest.raises(ValueError, match="vocab_size"):
        GPTConfig(vocab_size=2.5)
    with pytest.raises(ValueError, match="mlp_ratio"):
        GPTConfig(mlp_ratio=True)


# --- params -----------------------------------------------------------------


def test_init_params_shapes(params):
    V, S, L, d = CFG.vocab_size, CFG.seq_len, CFG.n_layers, CFG.d_model
    assert set(params) == {"embed", "blocks", "ln_f"}
    assert params["embed"]["tokens"].shape == (V, d)
    assert params["embed"]["positions"].shape == (S, d)
    assert params["ln_f"]["scale"].shape == (d,)
    assert params["ln_f"]["bias"].shape == (d,)
    blocks = params["blocks"]
    assert blocks["attn"]["qkv"]["kernel"].shape == (L, d, 3 * d)
    assert blocks["attn"]["proj"]["kernel"].shape == (L, d, d)
    assert blocks["mlp"]["fc"]["kernel"].shape == (L, d, 4 * d)
    assert blocks["mlp"]["proj"]["kernel"].shape == (L, 4 * d, d)
    assert blocks["ln_1"]["scale"].shape == (L, d)
    for leaf in jax.tree.leaves(params):
        assert leaf.dtype == jnp.float32
    for leaf in jax.tree.leaves(blocks):
        assert leaf.shape[0] == L
    # Layers come from different keys.
    qkv = blocks["attn"]["qkv"]["kernel"]
    assert not np.allclose(qkv[0], qkv[1])
    assert float(jnp.std(params["embed"]["tokens"])) == pytest.approx(0.02, rel=0.2)


def test_count_params_and_flops(params):
    n = sum(x.size for x in jax.tree.leaves(params))
    assert models.count_params(CFG) == n
    flops = models.flops_per_token(CFG)
    assert isinstance(flops, float)
    assert flops == 6 * n + 12 * CFG.n_layers * CFG.seq_len * CFG.d_model


# --- forward ----------------------------------------------------------------


def test_loss_at_init_is_near_log_vocab(params):
    loss = _jit_loss(params, _batch())
    assert loss.shape == () and loss.dtype == jnp.float32
    assert float(loss) == pytest.approx(math.log(CFG.vocab_size), abs=0.1)


def test_loss_matches_logits(params):
    batch = _batch(1)
    logits = _jit_logits(params, batch[:, :-1], CFG)
    assert logits.shape == (4, CFG.seq_len, CFG.vocab_size) and logits.dtype == jnp.float32
    logp = jax.nn.log_softmax(logits, axis=-1)
    expected = -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))
    np.testing.assert_allclose(_jit_loss(params, batch), expected, rtol=1e-5)


@pytest.mark.slow
def test_bfloat16_params(params):
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    batch = _batch(2)
    loss, grads = _jit_value_and_grad(p16, batch)
    assert loss.dtype == jnp.float32 and bool(jnp.isfinite(loss))
    assert float(loss) == pytest.approx(float(_jit_loss(params, batch)), abs=0.05)
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.bfloat16
        assert bool(jnp.all(jnp.isfinite(g)))


def test_mixed_dtype_subtrees(params):
    mixed = dict(params, blocks=jax.tree.map(lambda x: x.astype(jnp.bfloat16), params["blocks"]))
    loss = _jit_loss(mixed, _batch(2))
    assert bool(jnp.isfinite(loss))
    assert float(loss) == pytest.approx(float(_jit_loss(params, _batch(2))), abs=0.05)


def test_causality(params):
    inputs = _batch(3)[:, :-1]
    t = 9
    changed = inputs.at[:, t].set((inputs[:, t] + 1) % CFG.vocab_size)
    a = _jit_logits(params, inputs, CFG)
    b = _jit_logits(params, changed, CFG)
    np.testing.assert_array_equal(a[:, :t], b[:, :t])
    assert not np.allclose(a[:, t:], b[:, t:])


def test_shorter_sequences_and_too_long(params):
    short = _batch(4, seq_len=5)
    loss = _jit_loss(params, short)
    assert bool(jnp.isfinite(loss))
    # Prefix property: logits of a shorter sequence equal the prefix of the full one.
    full = _jit_logits(params, _batch(4)[:, :-1], CFG)
    part = _jit_logits(params, _batch(4)[:, :5], CFG)
    np.testing.assert_allclose(part, full[:, :5], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="seq_len=16"):
        _loss(params, _batch(seq_len=CFG.seq_len + 1))


def test_adam_overfits_one_batch(params):
    batch = _batch(5)
    opt = optax.adam(1e-2)

    @jax.jit
    def apply(p, g, s):
        # optax's bias correction computes `float ** int32`, which strict
        # promotion rejects; the model itself stays strict.
        with jax.numpy_dtype_promotion("standard"):
            updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    p, s = params, opt.init(params)
    losses = []
    for _ in range(30):
        loss, g = _jit_value_and_grad(p, batch)
        p, s = apply(p, g, s)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.5, losses


# --- hooks ------------------------------------------------------------------


def _describe(tree):
    return jax.tree.map(lambda x: tuple(x.shape), tree)


def test_gather_called_on_embed_block_slices_and_ln_f_only(params):
    calls = []

    def recording_gather(subtree):
        calls.append(subtree)
        return subtree

    jax.eval_shape(lambda p, b: _loss(p, b, gather=recording_gather), params, _batch())
    embed = _describe(params["embed"])
    ln_f = _describe(params["ln_f"])
    block_slice = jax.tree.map(lambda x: tuple(x.shape[1:]), params["blocks"])
    described = [_describe(c) for c in calls]
    # embed is gathered for the input embedding and again for the tied head.
    assert described.count(embed) == 2
    assert described.count(ln_f) == 1
    # The scan body is traced once (not once per layer), with one layer's slice.
    assert described.count(block_slice) == 1
    assert len(calls) == 4


def test_gather_runs_once_per_layer_at_runtime(params):
    counts = {"embed": 0, "block": 0, "ln_f": 0}
    kind_by_keys = {("positions", "tokens"): "embed", ("bias", "scale"): "ln_f"}

    def counting_gather(subtree):
        kind = kind_by_keys.get(tuple(sorted(subtree)), "block")

        def bump():
            counts[kind] += 1

        jax.debug.callback(bump)
        return subtree

    loss = jax.jit(lambda p, b: _loss(p, b, gather=counting_gather))(params, _batch())
    jax.block_until_ready(loss)
    jax.effects_barrier()
    assert counts == {"embed": 2, "block": CFG.n_layers, "ln_f": 1}


@jax.tree_util.register_pytree_node_class
class _Opaque:
    """A stored subtree that is not a dict: no indexing, no shape."""

    def __init__(self, leaves, treedef):
        self.leaves = tuple(leaves)
        self.treedef = treedef

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(leaves, treedef)


def _wrap(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return _Opaque(leaves, treedef)


def _unwrap(stored):
    assert isinstance(stored, _Opaque), type(stored)
    return jax.tree.unflatten(stored.treedef, stored.leaves)


def test_layer_hook_wraps_three_functions(params):
    wrapped = []

    def recording_layer(fn):
        wrapped.append(fn)
        return fn

    jax.eval_shape(lambda p, b: _loss(p, b, layer=recording_layer), params, _batch())
    assert len(wrapped) == 3


def test_opaque_stored_subtrees_with_checkpoint_match_plain(params):
    """The trainer's configuration: opaque stored subtrees plus remat per layer."""
    stored = {k: _wrap(v) for k, v in params.items()}
    batch = _batch(6)

    @jax.jit
    def stored_value_and_grad(stored, batch):
        return jax.value_and_grad(
            lambda p: _loss(p, batch, gather=_unwrap, layer=jax.checkpoint)
        )(stored)

    loss, grads = stored_value_and_grad(stored, batch)
    ref_loss, ref_grads = _jit_value_and_grad(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert set(grads) == {"embed", "blocks", "ln_f"}
    assert all(isinstance(g, _Opaque) for g in grads.values())
    grads = {k: _unwrap(g) for k, g in grads.items()}
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_zero_hooks_on_plain_params_are_plain_training(params):
    """Outside a ZeRO step ``zp.gather`` / ``zp.layer`` and the blocks' ``scan_layers`` change nothing."""
    import zeropp_jax as zp

    batch = _batch(3)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: _loss(p, batch, gather=zp.gather, layer=zp.layer)
    ))(params)
    ref_loss, ref_grads = _jit_value_and_grad(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_attention_is_causal_softmax_attention_and_picks_cudnn_only_on_gpu():
    """``jax.nn.dot_product_attention`` == explicit causal softmax attention (float32)."""
    from zeropp_jax.models import gpt

    assert jax.default_backend() != "gpu"
    assert gpt.attention_implementation(jnp.bfloat16, 64) is None  # XLA off the GPU
    # asked for by name: cuDNN (e.g. compiling for a GPU elsewhere) or XLA
    assert gpt.attention_implementation(jnp.bfloat16, 64, "cudnn") == "cudnn"
    assert gpt.attention_implementation(jnp.bfloat16, 64, "xla") is None
    assert gpt.attention_implementation(jnp.float32, 64, "cudnn") is None  # 16-bit only
    # "auto" on GPUs: cuDNN from compute capability 8.0, XLA before it and off CUDA
    import types
    from unittest import mock

    for capability, want in (("9.0", "cudnn"), ("8.0", "cudnn"), ("7.0", None), (None, None)):
        gpu = types.SimpleNamespace(platform="gpu")
        if capability is not None:
            gpu.compute_capability = capability
        with mock.patch.object(gpt.jax, "default_backend", return_value="gpu"), \
                mock.patch.object(gpt.jax, "devices", return_value=[gpu]):
            assert gpt.attention_implementation(jnp.bfloat16, 64) == want, capability
    with pytest.raises(ValueError, match="multiple of 8 up to 128"):
        gpt.GPTConfig(d_model=640, n_heads=4, attention="cudnn")  # head dim 160
    with pytest.raises(ValueError, match="GPTConfig.attention must be one of"):
        gpt.GPTConfig(attention="flash")
    attn = gpt.CausalSelfAttention(n_heads=4, out_init_std=0.02)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32), jnp.float32)
    variables = attn.init(jax.random.key(1), x)
    p = variables["params"]
    qkv = x @ p["qkv"]["kernel"] + p["qkv"]["bias"][None, None]
    q, k, v = jnp.split(qkv.reshape(2, 8, 3, 4, 8), 3, axis=2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    scores = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), scores, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(2, 8, 32)
    want = out @ p["proj"]["kernel"] + p["proj"]["bias"][None, None]
    np.testing.assert_allclose(attn.apply(variables, x), want, rtol=2e-5, atol=2e-6)
