"""The unbiased 1-bit code (zeropp_jax.wire.dither): noise, code, kernel, exchange."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
import zeropp_jax as zp
from zeropp_jax.wire import dither, quantization
from zeropp_jax.wire.qgz import cross_node_reduce

from _util import mesh_of, tiny_batches, zero_run
from test_zeropp import GRADIENT, _train, report


def _x(shape, seed=0, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed))
    # mixed magnitudes inside every block, no zeros-only input
    mags = jnp.exp(2.0 * jax.random.normal(k1, shape))
    return (jax.random.normal(k2, shape) * mags).astype(dtype)


def _xi(shape, *ids):
    return dither.uniform_noise(dither.stream_key(*ids), dither.element_counters(shape))


def test_noise_is_uniform_symmetric_and_keyed():
    n = 1 << 16
    a, b, a2 = _xi((n,), 3, 1), _xi((n,), 3, 2), _xi((n,), 3, 1)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.min() > -1 and a.max() < 1
    np.testing.assert_array_equal(a, np.asarray(a2))  # a pure function of (key, counter)
    sigma = np.sqrt(1 / 3 / n)
    assert abs(a.mean()) < 5 * sigma and abs(b.mean()) < 5 * sigma
    assert abs(a.var() - 1 / 3) < 0.01
    hist, _ = np.histogram(a, bins=16, range=(-1, 1))
    assert hist.min() > 0.9 * n / 16 and hist.max() < 1.1 * n / 16
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(n)  # another key: another stream
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 5 / np.sqrt(n)  # neighbours unrelated
    # Python ints (seeds) are taken modulo 2**32, also negative and large ones
    assert int(dither.stream_key(-1, 4)) == int(dither.stream_key(2**32 - 1, 4))
    assert int(dither.stream_key(2**40 + 5)) == int(dither.stream_key(5))


@pytest.mark.parametrize(
    "shape,block,dtype,scale_dtype",
    [((3, 40), 8, jnp.float32, jnp.float32), ((2, 5, 96), 32, jnp.bfloat16, jnp.float32),
     ((7, 64), 16, jnp.float32, jnp.bfloat16), ((1, 24), 24, jnp.float16, jnp.bfloat16)],
)
@pytest.mark.slow
def test_code_error_is_within_the_scale_and_zero_blocks_stay_zero(shape, block, dtype, scale_dtype):
    x = _x(shape, dtype=dtype)
    x = x.at[..., :block].set(0)  # one zero block per row
    xi = _xi(shape, 0)
    q = dither.quantize_dithered(x, xi, block=block, scale_dtype=scale_dtype)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (*shape[:-1], shape[-1] // 8)
    assert q.scales.dtype == scale_dtype
    x32 = np.asarray(x, np.float32)
    s = np.asarray(q.scales, np.float32)
    blocks = x32.reshape(*shape[:-1], -1, block)
    assert (s >= np.abs(blocks).max(-1)).all()  # rounded up: |x| <= s
    out = np.asarray(dither.dequantize_dithered(q, xi, block=block))
    err = np.abs(out - x32).reshape(blocks.shape)
    assert (err <= s[..., None] * (1 + 1e-6)).all()
    np.testing.assert_array_equal(out[..., :block], 0.0)


def test_code_is_unbiased():
    x = _x((4, 64), seed=1)
    draws = 4000
    keys = jnp.arange(draws, dtype=jnp.uint32)

    def decode(k):
        xi = _xi(x.shape, k)
        return dither.dequantize_dithered(dither.quantize_dithered(x, xi, block=32), xi, block=32)

    mean = np.asarray(jnp.mean(jax.lax.map(decode, keys), axis=0), np.float64)
    s = np.abs(np.asarray(x)).reshape(4, 2, 32).max(-1, keepdims=True)
    # error uniform on (-s, s): standard deviation s / sqrt(3) per draw
    bound = 5 * s / np.sqrt(3 * draws)
    assert (np.abs(mean - np.asarray(x)).reshape(4, 2, 32) < bound).all()
    # while the plain sign code is biased: mean|x| * sign(x) != x
    sign = quantization.dequantize(
        quantization.quantize(x, bits=1, block=32), bits=1, block=32, dtype=jnp.float32
    )
    assert np.abs(np.asarray(sign) - np.asarray(x)).max() > 10 * bound.max()


def test_non_finite_block_is_reported():
    x = _x((2, 32)).at[0, 3].set(jnp.nan).at[1, 20].set(jnp.inf)
    xi = _xi(x.shape, 0)
    out = np.asarray(dither.dequantize_dithered(
        dither.quantize_dithered(x, xi, block=16), xi, block=16))
    assert np.isnan(out[0, :16]).all() and np.isnan(out[1, 16:]).all()
    assert np.isfinite(out[0, 16:]).all() and np.isfinite(out[1, :16]).all()


def test_bad_dither_is_refused():
    x = _x((2, 32))
    q = dither.quantize_dithered(x, _xi(x.shape, 0), block=16)
    for block in (0, 4, 12):  # as the sender refuses them
        with pytest.raises(ValueError, match="block must be a positive multiple of 8"):
            dither.dequantize_dithered(q, _xi(x.shape, 0), block=block)
    with pytest.raises(ValueError, match="xi must be float32"):
        dither.quantize_dithered(x, jnp.zeros((2, 16)), block=16)
    with pytest.raises(ValueError, match="xi must be float32"):
        pk.quantize_dithered(x, jnp.zeros((2, 32), jnp.bfloat16), block=16, interpret=True)


def test_exchange_regenerates_each_senders_dither():
    """Receivers decode with the dither their senders used: reduced = node-sum of sent."""
    mesh = mesh_of(2, 4)
    width = 2 * 32 * 3
    grads = _x((8, 2, width), seed=3)  # (devices, L, r)
    grads = grads.at[:, 1, : width // 2].set(grads[:, 0, : width // 2])  # equal rows, per layer

    def run(g, step):
        key = dither.stream_key(step, 0, jax.lax.axis_index("local"))
        reduced, carry, sent = cross_node_reduce(
            g[0], None, bits=1, block=32, scale_dtype=jnp.float32, reduce_dtype=jnp.float32,
            compress=True, code="dither", key=key,
        )
        assert carry is None
        return reduced[None], sent[None]

    spec = P(("node", "local"))
    g = jax.device_put(grads, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(spec, P()), out_specs=(spec, spec)))
        reduced, sent = f(g, jnp.int32(7))
        reduced8, _ = f(g, jnp.int32(8))
    reduced, sent, grads = (np.asarray(a, np.float64) for a in (reduced, sent, grads))
    # device (n, l) holds chunk n of the sum over nodes of devices (., l)
    sent_nodes = sent.reshape(2, 4, 2, 2, -1).sum(0)  # (local, L, chunk, m)
    want = sent_nodes.transpose(2, 0, 1, 3).reshape(8, 2, -1)
    np.testing.assert_allclose(reduced, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # what was sent is x plus an error bounded by each block's absmax
    s = np.abs(grads).reshape(8, 2, -1, 32).max(-1, keepdims=True)
    assert (np.abs(sent - grads).reshape(s.shape[:-1] + (32,)) <= s * (1 + 1e-6)).all()
    assert not np.allclose(sent, grads)
    # layers draw their own noise: equal inputs in two stacked layers, unequal codes
    half = width // 2  # chunk 0 (for node 0) of both layers holds equal values
    assert not np.allclose(sent[:, 0, :half], sent[:, 1, :half])
    # another step draws other noise
    assert not np.allclose(np.asarray(reduced8), reduced)


def test_config_refuses_dither_with_error_feedback_or_other_modes():
    with pytest.raises(ValueError, match="without error feedback"):
        zp.ZeroConfig.from_preset("zeropp", qgz_code="dither", qgz_target="gradient")
    with pytest.raises(ValueError, match="1-bit code"):
        zp.ZeroConfig.from_preset("qgz", qgz="int4", qgz_code="dither", qgz_error_feedback=False)
    with pytest.raises(ValueError, match="qgz_code must be one of"):
        zp.ZeroConfig.from_preset("qgz", qgz_code="stochastic")
    with pytest.raises(ValueError, match="qgz_target='gradient' to compress gradients"):
        zp.ZeroConfig.from_preset("zeropp", qgz_code="dither", qgz_error_feedback=False)
    cfg = zp.ZeroConfig.from_preset("zeropp", qgz_code="dither", qgz_error_feedback=False,
                                    qgz_target="gradient")
    assert cfg.describe()["qgz_code"] == "dither" and cfg.qgz_block == 16
    assert zp.ZeroConfig.from_preset("zeropp").qgz_block == 128  # the compact wire's
    assert zp.ZeroConfig.from_preset("qgz").qgz_block == 32
    # the wire itself names what would be right, should a caller bypass the config
    from zeropp_jax.wire import kernels, qgz

    with pytest.raises(ValueError, match="1-bit only, got bits=4; use bits=1"):
        qgz._encode(jnp.ones((2, 16)), None, bits=4, block=8, scale_dtype=jnp.float32,
                    kernels=kernels.XLA, code="dither")


@pytest.mark.slow
def test_dithered_zeropp_sends_the_same_bytes_and_trains():
    sign = report("zeropp", qgz_error_feedback=False, qgz_block=16, **GRADIENT)  # same wire format
    dith = report("zeropp", qgz_code="dither", qgz_error_feedback=False, **GRADIENT)
    a2a = [c for c in dith.collectives if c.kind == "all-to-all"]
    assert a2a and all(c.axis == "node" for c in a2a)
    assert {c.dtype for c in a2a} == {"u8"}  # bits and float32 scales, packed
    assert dith.inter_node_bytes == sign.inter_node_bytes

    trainer, params = _train("zeropp", 15, qgz_code="dither", qgz_error_feedback=False,
                             qgz_warmup_steps=0, **GRADIENT)
    assert trainer.error_feedback is False
    losses, _ = zero_run(trainer, params, tiny_batches(), 15)
    z3, _ = zero_run(*_train("zero3", 15), tiny_batches(), 15)
    # no warm-up on a tiny model: the code's noise slows the first steps a little
    np.testing.assert_allclose(losses, z3, rtol=0.15)
    assert losses[-1] < losses[0] - 1.0
    assert not np.allclose(losses, z3, rtol=1e-7)

    # the seed names the noise stream: another seed, other noise, same first loss
    other, _ = zero_run(*_train("zeropp", 4, qgz_code="dither", qgz_error_feedback=False,
                                qgz_warmup_steps=0, qgz_seed=-7, **GRADIENT), tiny_batches(), 4)
    assert other[0] == losses[0]
    assert not np.allclose(other[1:], losses[1:4], rtol=1e-7)
    with pytest.raises(ValueError, match="qgz_seed must be an integer"):
        zp.ZeroConfig.from_preset("zeropp", qgz_seed=1.5)
