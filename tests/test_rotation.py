"""The ``hadamard`` qgZ code (a randomized Hadamard rotation per block) and the
one-hop momentum share (every node gathers every node's codes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zp
from zeropp_jax.wire import rotation
from zeropp_jax.wire.kernels import XLA
from zeropp_jax.wire.qgz import cross_node_reduce, gather_decode, gather_encode, gathered_codes
from pallas_kernels.references.quantization import dequantize, quantize

from _util import gpt_step, mesh_of


@pytest.mark.parametrize("shape,block", [((3, 5 * 128), 128), ((7, 2, 64), 16), ((8,), 8)])
def test_unrotate_inverts_rotate_and_scales_norms_by_sqrt_block(shape, block):
    x = jax.random.normal(jax.random.key(1), shape) * jnp.logspace(-3, 2, shape[-1]).reshape((1,) * (len(shape) - 1) + (-1,))
    y = rotation.rotate(x, block)
    np.testing.assert_allclose(rotation.unrotate(y, block), x, rtol=1e-5, atol=1e-5 * float(jnp.abs(x).max()))
    per_block = lambda a: np.linalg.norm(np.reshape(np.asarray(a), (-1, block)), axis=-1)
    np.testing.assert_allclose(per_block(y), np.sqrt(block) * per_block(x), rtol=1e-5)


@pytest.mark.parametrize("block", [2, 8, 32, 128, 256])
def test_rotate_is_the_dense_walsh_hadamard_matrix_after_the_signs(block):
    """The radix-4 passes (and a last radix-2 one for odd powers) give Sylvester's ``H``."""
    dense = np.ones((1, 1))
    while dense.shape[0] < block:
        dense = np.block([[dense, dense], [dense, -dense]])
    x = np.asarray(jax.random.normal(jax.random.key(block), (3, 5 * block)), np.float64)
    signs = rotation.random_signs(block, 1)
    want = ((x.reshape(-1, block) * signs) @ dense.T).reshape(x.shape)
    got = rotation.rotate(jnp.asarray(x, jnp.float32), block, 1, 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(block) * np.abs(x).max())


def test_random_signs_are_fixed_and_balanced():
    signs = rotation.random_signs(128)
    assert set(np.unique(signs)) == {-1.0, 1.0}
    assert abs(signs.sum()) < 32  # not all one sign
    np.testing.assert_array_equal(signs[:8], [-1, -1, 1, -1, 1, 1, 1, -1])  # stable across versions
    np.testing.assert_array_equal(rotation.random_signs(16), signs[:16])


def test_each_pattern_is_its_own_and_unrotate_rows_undoes_each_senders():
    block, k, n = 32, 3, 5 * 32
    table = np.stack([rotation.random_signs(block, i) for i in range(k)])
    assert len({row.tobytes() for row in table}) == k  # distinct patterns
    assert np.abs(table[0] @ table[1]) < block / 2  # and not nearly equal
    x = jax.random.normal(jax.random.key(7), (2, k, n))
    rows = jnp.stack([rotation.rotate(x[:, i], block, i, k) for i in range(k)], axis=1)
    np.testing.assert_allclose(rotation.unrotate_rows(rows, block), x, rtol=1e-5, atol=1e-5)
    traced = jax.jit(lambda v, i: rotation.rotate(v, block, i, k))(x[:, 2], jnp.int32(2))
    np.testing.assert_array_equal(traced, rows[:, 2])
    with pytest.raises(ValueError, match="pattern must be in"):
        rotation.rotate(x[:, 0], block, 3, k)


def test_per_node_patterns_make_the_codes_errors_independent():
    """Two nodes coding nearly the same vector: with one pattern their 1-bit
    errors are alike and their mean keeps the whole error; with a pattern
    each the independent part of their errors averages down."""
    block = 128
    base = jax.random.normal(jax.random.key(8), (64, block))
    pair = base[None] + 0.05 * jax.random.normal(jax.random.key(9), (2, 64, block))

    def error_of_mean(patterns):
        decoded = [rotation.unrotate(dequantize(quantize(rotation.rotate(pair[n], block, p, 2), bits=1,
                                                         block=block), bits=1, block=block,
                                                dtype=jnp.float32), block, p, 2)
                   for n, p in enumerate(patterns)]
        return float(jnp.linalg.norm((decoded[0] + decoded[1]) / 2 - pair.mean(0)))

    shared, own = error_of_mean((0, 0)), error_of_mean((0, 1))
    # the shared part of each error is the scaled-sign code's shrinkage of x;
    # the rest averages out: the mean keeps about sqrt(0.68) = 0.83 of it
    assert own < 0.88 * shared, (own, shared)


@pytest.mark.parametrize("block,n", [(12, 48), (128, 100), (1, 8), (16.0, 32), (None, 32)])
def test_bad_blocks_are_rejected(block, n):
    with pytest.raises(ValueError, match="power-of-two block|power of two >= 2|multiple of the block"):
        rotation.rotate(jnp.ones((n,)), block)


def test_a_numpy_pattern_is_range_checked_as_an_int():
    x = jnp.ones((2, 16))
    with pytest.raises(ValueError, match=r"pattern must be in \[0, 2\), got 5"):
        rotation.rotate(x, 8, np.int64(5), 2)
    np.testing.assert_array_equal(rotation.rotate(x, 8, np.int64(1), 2), rotation.rotate(x, 8, 1, 2))


def test_rotation_spreads_an_outlier_error_over_its_block():
    """A sign code sends the block's mean magnitude to every coordinate: a
    coordinate 20x its neighbours keeps most of its value as error; after a
    rotation its error is about the block's average."""
    block = 128
    x = jax.random.normal(jax.random.key(2), (4, block))
    x = x.at[:, 5].set(20.0)

    def one_bit(v):
        return dequantize(quantize(v, bits=1, block=block), bits=1, block=block, dtype=jnp.float32)

    plain = np.abs(np.asarray(x - one_bit(x)))[:, 5]
    rotated = np.abs(np.asarray(x - rotation.unrotate(one_bit(rotation.rotate(x, block)), block)))[:, 5]
    assert (plain > 15).all() and (rotated < 5).all(), (plain, rotated)


def _on_mesh(fn, *arrays):
    """``fn`` under shard_map over a 2x4 mesh, inputs and outputs split on devices."""
    mesh = mesh_of(2, 4)
    spec = P(("node", "local"))
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]
    with jax.set_mesh(mesh):
        out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arrays),
                                    out_specs=spec))(*placed)
    return jax.tree.map(np.asarray, out)


def _shared(x, carry, *, mean, scale_dtype, **wire):
    """``x + carry`` coded, gathered over ``node`` and decoded, as 1-bit Adam composes the
    halves (``step/momentum_exchange.py``): every node's rows averaged (``mean``, the
    one-hop share) or side by side (the two hops' second), and the new carry."""
    wire = dict(kernels=XLA, **wire)
    q, pending = gather_encode(x, carry, scale_dtype=scale_dtype, **wire)
    return gather_decode(gathered_codes(q), pending, mean=mean, **wire)


@pytest.mark.parametrize("code", ["sign", "hadamard"])
def test_gather_mean_is_every_nodes_decoded_codes_averaged_on_every_node(code):
    block, width = 32, 3 * 64
    x = jax.random.normal(jax.random.key(3), (8, width)) * jnp.logspace(-2, 1, width)[None]
    carry = 0.1 * jax.random.normal(jax.random.key(4), (8, width))
    wire = dict(bits=1, block=block, scale_dtype=jnp.float32, code=code)

    def run(x, c):
        mean, new_carry = _shared(x[0], c[0], mean=True, **wire)
        sent = x[0] + c[0] - new_carry
        return jnp.stack([mean, sent])[None]

    out = _on_mesh(run, x, carry)  # (devices, 2, width): device = node * 4 + local
    mean, sent = out[:, 0], out[:, 1]
    # what each device sent decodes from its own codes: x + carry - residual
    # with the hadamard code each node rotates with its own sign pattern
    node_of = np.repeat(np.arange(2), 4)
    rotate = (lambda v, n: rotation.rotate(v, block, n, 2)) if code == "hadamard" else (lambda v, n: v)
    back = (lambda v, n: rotation.unrotate(v, block, n, 2)) if code == "hadamard" else (lambda v, n: v)
    want_sent = np.stack([
        back(dequantize(quantize(rotate((x + carry)[d], int(node_of[d])), bits=1, block=block),
                        bits=1, block=block, dtype=jnp.float32), int(node_of[d]))
        for d in range(8)])
    np.testing.assert_allclose(sent, want_sent, rtol=1e-5, atol=1e-5)
    by_node = sent.reshape(2, 4, width)
    for node in range(2):  # the same bits on every node: the mean of both nodes' codes
        np.testing.assert_array_equal(mean.reshape(2, 4, width)[node], mean.reshape(2, 4, width)[0])
    np.testing.assert_allclose(mean.reshape(2, 4, width)[0], by_node.mean(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("code", [pytest.param("sign", marks=pytest.mark.slow), "hadamard"])
def test_two_hops_keep_what_they_lose(code):
    """Reduce then share (1-bit Adam's two hops), with non-zero carries at both.

    Each hop's codes are decoded here, independently of the library, as its
    sender coded them (with the hadamard code: rotated with the sending
    node's pattern, and unrotated): the receivers sum exactly what the
    senders' codes say, the share hands every node every node's decoded
    ``summed + carry``, and each hop's new carry is what its codes lost of
    ``value + old carry``.
    """
    block, width, nodes = 16, 2 * 64, 2
    chunk = width // nodes
    x = jax.random.normal(jax.random.key(5), (8, width)) * jnp.logspace(-2, 1, width)[None]
    carry = 0.3 * jax.random.normal(jax.random.key(6), (8, width))
    receiver_carry = 0.3 * jax.random.normal(jax.random.key(7), (8, chunk))
    wire = dict(bits=1, block=block, scale_dtype=jnp.float32, code=code)

    def run(x, c, rc):
        summed, new_carry, sent = cross_node_reduce(
            x[0], c[0], reduce_dtype=jnp.float32, compress=True, **wire)
        shared, new_receiver = _shared(summed, rc[0], mean=False, **wire)
        return jnp.stack([sent, new_carry, shared,
                          jnp.concatenate([summed, new_receiver])])[None]

    out = _on_mesh(run, x, carry, receiver_carry)  # device = node * 4 + local
    sent, new_carry, shared = out[:, 0], out[:, 1], out[:, 2]
    summed, new_receiver = out[:, 3, :chunk], out[:, 3, chunk:]

    def decoded(v, node):  # what node `node`'s 1-bit codes of `v` decode to
        if code == "hadamard":
            v = rotation.rotate(v, block, node, nodes)
        v = dequantize(quantize(v, bits=1, block=block), bits=1, block=block, dtype=jnp.float32)
        return np.asarray(rotation.unrotate(v, block, node, nodes) if code == "hadamard" else v)

    def per_node(v):  # each node's rows (its 4 devices') decoded as it codes them
        return np.concatenate([decoded(v[4 * n:4 * (n + 1)], n) for n in range(nodes)])

    total = np.asarray(x + carry)
    want_sent = per_node(total)
    np.testing.assert_allclose(sent, want_sent, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_carry, total - want_sent, rtol=1e-5, atol=1e-5)
    # device (k, l) sums chunk k of what the devices (n, l) sent, over n
    by_sender = want_sent.reshape(nodes, 4, nodes, chunk)  # (node, local, chunk k, ·)
    want_summed = np.stack([by_sender[:, local, k].sum(0)
                            for k in range(nodes) for local in range(4)])
    np.testing.assert_allclose(summed, want_summed, rtol=1e-5, atol=1e-5)
    # the share: every node gets node k's decoded summed + receiver carry as chunk k
    held = summed + np.asarray(receiver_carry)
    want_chunks = per_node(held)
    want_shared = want_chunks.reshape(nodes, 4, chunk).transpose(1, 0, 2).reshape(4, width)
    for node in range(nodes):
        np.testing.assert_allclose(shared.reshape(nodes, 4, width)[node], want_shared,
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_receiver, held - want_chunks, rtol=1e-5, atol=1e-5)
    assert np.abs(new_carry).max() > 0 and np.abs(new_receiver).max() > 0


def test_with_two_nodes_the_one_hop_moves_the_same_bytes_as_two():
    wire = {k: zp.config.PRESETS["zeropp-max"][k] for k in ("qgz_block", "scale_dtype", "qgz_code")}
    reports = {share: gpt_step(3, "zeropp-max", compress=True, qgz_warmup_steps=1,
                               qgz_share=share, **wire)[2]
               for share in ("two-hop", "auto")}
    kinds = {share: {c.kind for c in r.collectives if c.axis == "node"} for share, r in reports.items()}
    assert "all-to-all" in kinds["two-hop"] and "all-to-all" not in kinds["auto"], kinds
    assert reports["auto"].inter_node_bytes == pytest.approx(reports["two-hop"].inter_node_bytes,
                                                             rel=0.01)


def test_config_checks_for_the_code_and_the_share():
    with pytest.raises(ValueError, match="power-of-two qgz_block"):
        zp.ZeroConfig.from_preset("zeropp-max", qgz_block=96)
    with pytest.raises(ValueError, match="needs qgz_target='momentum'"):
        zp.ZeroConfig.from_preset("zero3", qgz="1bit", qgz_share="gather")
    with pytest.raises(ValueError, match="qgz_share must be one of"):
        zp.ZeroConfig.from_preset("zeropp-max", qgz_share="tree")
    # a preset's code and share go away with qgZ or its momentum target
    assert zp.ZeroConfig.from_preset("zeropp-max", qgz="off", qgz_target="gradient",
                                     node_replicated=False).qgz_code == "sign"
    assert zp.ZeroConfig.from_preset("zeropp-max", qgz_target="gradient",
                                     node_replicated=False).qgz_share == "two-hop"
