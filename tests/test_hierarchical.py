"""Two-level ZeRO-3 (``hierarchical_collectives``): the same step, other collectives.

Gathers run over ``node`` then ``local`` and reduce-scatters over ``local``
then ``node``; the values are those of the one-step collectives (gathers
exactly, sums up to rounding), and the compiled program has no collective
whose groups span both axes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import zeropp_jax as zp
from zeropp_jax.mesh import SHARD_AXES
from zeropp_jax.wire import collectives

from _util import assert_trees_close, gpt_loss, gpt_step, mesh_of, optimizer, tiny_batches, zero_run

FP32 = dict(compute_dtype="float32")


def _run(fn, x):
    mesh = mesh_of(2, 4)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(None, SHARD_AXES)))
    return np.asarray(jax.jit(jax.shard_map(
        fn, mesh=mesh, in_specs=P(None, SHARD_AXES), out_specs=P(None, SHARD_AXES),
    ))(x))


def test_two_level_collectives_match_one_step():
    x = jax.random.normal(jax.random.key(0), (3, 8 * 16), jnp.float32)

    def gather(two_level):
        # every device's gathered copy, side by side: (3, 8 * 8 * 16)
        return lambda s: collectives.all_gather(s, SHARD_AXES, two_level=two_level)

    np.testing.assert_array_equal(_run(gather(True), x), _run(gather(False), x))
    np.testing.assert_array_equal(_run(gather(True), x)[:, : 8 * 16], x)

    def scatter(two_level):
        return lambda s: collectives.reduce_scatter(
            jnp.tile(s, (1, 8)) * (1.0 + collectives.axes_index(SHARD_AXES)), SHARD_AXES,
            two_level=two_level,
        )

    np.testing.assert_allclose(_run(scatter(True), x), _run(scatter(False), x), rtol=1e-6, atol=1e-5)


@pytest.mark.slow
def test_two_level_zero3_trains_like_zero3():
    params = zp.models.gpt.init_params(zp.models.gpt.GPTConfig(
        vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2), jax.random.key(0))
    runs = []
    for hierarchical in (False, True):
        config = zp.ZeroConfig.from_preset("zero3", hierarchical_collectives=hierarchical, **FP32)
        trainer = zp.make_trainer(
            gpt_loss(), optimizer(), params, mesh=mesh_of(2, 4), config=config,
            per_layer=True, stacked=("blocks",),
        )
        losses, state = zero_run(trainer, params, tiny_batches(), 4)
        runs.append((losses, trainer.gather_params(state)))
    (flat_losses, flat_params), (two_losses, two_params) = runs
    np.testing.assert_allclose(two_losses, flat_losses, rtol=1e-6)
    assert_trees_close(two_params, flat_params, rtol=1e-5, atol=1e-6)


def test_two_level_zero3_has_no_collective_spanning_both_axes():
    _, _, report = gpt_step(2, hierarchical_collectives=True)
    moving = [c for c in report.collectives if c.kind in ("all-gather", "reduce-scatter")]
    for kind in ("all-gather", "reduce-scatter"):
        axes = {c.axis for c in moving if c.kind == kind}
        assert axes == {"node", "local"}, (kind, axes)
        counts = {a: sum(c.count for c in moving if c.kind == kind and c.axis == a)
                  for a in axes}
        assert counts["node"] == counts["local"], (kind, counts)
    # a node's gathers take in what the flat algorithm's would, from one device per node
    node_gathers = [c for c in moving if c.kind == "all-gather" and c.axis == "node"]
    assert all(c.group_size == 2 and c.num_groups == 4 for c in node_gathers)


def _compiled_report(fn, x):
    from zeropp_jax.analysis.comm_report import comm_report

    mesh = mesh_of(2, 4)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(None, SHARD_AXES)))
    step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(None, SHARD_AXES),
                                 out_specs=P(None, SHARD_AXES)))
    return comm_report(step.lower(x).compile(), mesh_shape=(2, 4))


def test_two_byte_floats_cross_at_two_bytes_with_a_ring_s_bytes():
    """bf16 gathers move as u16 bits; with ``sum_bits`` bf16 reductions as an
    exchange of bits and a local sum: the values of the float32 collectives
    (gathers exactly, sums to bf16 rounding) at half their bytes, which
    XLA:CPU's own bf16 collectives (widened to f32) would not send."""
    from zeropp_jax.analysis.collectives import payload_role

    # small integers: every partial sum is exact in bf16, so any order of
    # summation gives the float32 collectives' values exactly
    x = jax.random.randint(jax.random.key(1), (3, 8 * 16), -4, 5).astype(jnp.float32)
    half = x.astype(jnp.bfloat16)

    def scatter(dtype, sum_bits):
        return lambda s: collectives.reduce_scatter(
            jnp.tile(s.astype(dtype), (1, 8)) * (1.0 + collectives.axes_index(SHARD_AXES)),
            SHARD_AXES, two_level=True, sum_bits=sum_bits)

    def reduce(dtype, sum_bits):  # every node's sum, on every device
        return lambda s: collectives.all_reduce(
            s.astype(dtype) * (1.0 + jax.lax.axis_index("node")), ("node",), sum_bits=sum_bits)

    def gather(dtype, sum_bits):
        del sum_bits
        return lambda s: collectives.all_gather(s.astype(dtype), SHARD_AXES, two_level=True)

    for make in (gather, scatter, reduce):
        got = _run(make(jnp.bfloat16, True), x)
        want = _run(make(jnp.float32, False), x)
        assert got.dtype == jnp.bfloat16 and np.abs(want).max() >= (4 if make is gather else 8)
        np.testing.assert_array_equal(got.astype(np.float32), want)
        as_bits = _compiled_report(make(jnp.bfloat16, True), half)
        native = _compiled_report(make(jnp.float32, False), x)
        assert {c.dtype for c in as_bits.collectives} == {"u16"}, make
        assert all(payload_role(c) == "float" for c in as_bits.collectives)
        # a ring's bytes at 2 bytes an element: half the float32 collectives'
        assert 2 * as_bits.inter_node_bytes == native.inter_node_bytes > 0, make
        assert 2 * as_bits.intra_node_bytes == native.intra_node_bytes, make


def test_a_bf16_two_level_zero3_step_puts_nothing_wider_than_bf16_on_the_wire():
    """On CPU a bf16 run's gathers and gradient reductions cross at 2 bytes,
    so the comm report has nothing to narrow and the emulated cluster's link
    carries what a GPU's would."""
    _, _, report = gpt_step(1, hierarchical_collectives=True, compute_dtype="bfloat16")
    floats = [c for c in report.collectives if c.dtype in ("f32", "bf16")]
    assert all(c.operand_bytes <= 16 for c in floats), floats  # metric scalars only
    wide = report.collectives
    assert {c.dtype for c in wide if c.operand_bytes > 16} == {"u16"}
    narrowed = dataclasses.replace(report, float_dtypes=("bf16", "bf16"))
    assert narrowed.inter_node_bytes == report.inter_node_bytes > 0
    f32 = gpt_step(1, hierarchical_collectives=True)[2]

    def payload_bytes(r):  # the metric scalars stay float32
        return sum(r.counted_bytes(c)[0] for c in r.collectives if c.operand_bytes > 16)

    assert 2 * payload_bytes(report) == payload_bytes(f32) > 0


@pytest.mark.parametrize("preset", ["zeropp", "zeropp-max"])
def test_a_bf16_refresh_step_all_reduces_gradients_at_two_bytes(preset):
    """1-bit Adam's full-precision steps all-reduce the gradient over ``node``
    in the reduce dtype (bf16 here): as bits and a local sum on CPU."""
    _, _, report = gpt_step(1, preset=preset, compress=False, compute_dtype="bfloat16")
    node = [c for c in report.collectives if c.axis == "node" and c.operand_bytes > 16]
    assert node and {c.dtype for c in node} <= {"u16", "u8"}, node
    assert {c.kind for c in node if c.dtype == "u16"} == {"all-to-all", "all-gather"}


def test_full_precision_1bit_adam_steps_sum_gradients_over_nodes_per_layer():
    """With one micro-batch a warm-up or refresh step all-reduces each layer's
    gradient over ``node`` in the backward (where compute can hide it); with
    several, the accumulated gradient once per step."""
    def node_sums(rep):
        return [c for c in rep.collectives
                if c.kind == "all-reduce" and c.axis == "node" and c.operand_bytes > 16]

    # four layers: the backward computes its first and last around its loop
    per_layer = node_sums(gpt_step(4, preset="zeropp", compress=False)[2])
    assert per_layer and any(c.count > 1 for c in per_layer), per_layer  # in the layer loop
    once = node_sums(gpt_step(3, preset="zeropp", compress=False, grad_accum=2)[2])
    assert once and all(c.count == 1 for c in once), once
