"""Two-level ZeRO-3 (``hierarchical_collectives``): the same step, other collectives.

Gathers run over ``node`` then ``local`` and reduce-scatters over ``local``
then ``node``; the values are those of the one-step collectives (gathers
exactly, sums up to rounding), and the compiled program has no collective
whose groups span both axes.
"""

from __future__ import annotations

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
