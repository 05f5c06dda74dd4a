"""``ZeroConfig.keep_activations``: layers keep their activations, never their gathered parameters.

``linearize`` / ``pull_back`` against ``jax.vjp``; the same values as full
recomputation through ``zp.scan_layers`` (prefetch on) and ``zp.layer``
(prefetch off); the same collectives with fewer matrix products; and
temporaries that grow by the kept activations, not by gathered layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.analysis.hlo import multiplicities, parse_module
from zeropp_jax.step.linearize import linearize, pull_back

from _util import (
    assert_trees_close, compile_step, executions, mesh_of, stacked_mlp_loss, stacked_mlp_params,
    tiny_gpt_run, train_and_gather,
)

WIDTH, LAYERS, BATCH = 128, 4, 64  # 8 rows per device


def _layer(w, x):
    h = jnp.tanh(x @ w[0])
    return jnp.sum(jnp.sin(h @ w[1]) * h)


def test_linearize_matches_vjp_and_keeps_activations_only():
    kw, kx = jax.random.split(jax.random.key(0))
    w = jax.random.normal(kw, (2, 24, 24)) / 5
    x = jax.random.normal(kx, (5, 24))

    @jax.jit
    def run(w, x):
        out, lin = linearize(_layer, w, x, drop=w)
        # the saved arrays: the two matrix products' outputs, (5, 24) each
        shapes = [a.shape for a in lin.saved]
        # the inputs given again are new arrays (as the backward's re-gather is)
        return out, pull_back(lin, (w * 1.0, x + 0.0), jnp.ones(())), shapes

    want_out, vjp = jax.vjp(_layer, w, x)
    out, grads, _ = run(w, x)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    assert_trees_close(grads, vjp(jnp.ones(())), rtol=1e-5, atol=1e-6)
    _, lin = jax.eval_shape(lambda w, x: linearize(_layer, w, x), w, x)
    assert sorted(a.shape for a in lin.saved) == [(5, 24), (5, 24)]
    assert lin.slots.count(None) == 2 and {0, 1} <= set(lin.slots)


def test_linearize_refuses_to_keep_an_array_shaped_like_the_parameters():
    # a matrix product of the parameters with a constant is an activation
    # the policy keeps: shaped like the flat parameters, it is refused
    w = jnp.linspace(-1.0, 1.0, 12)

    def touches_weights(w, x):
        return jnp.sum(jnp.tanh(jnp.eye(12) @ w) * x)

    with pytest.raises(RuntimeError, match="shaped like its gathered parameters"):
        linearize(touches_weights, w, 2.0, drop=w)


# ------------------------------------------------------------ a stacked MLP
def _mlp_params(layers=LAYERS):
    return stacked_mlp_params(layers, WIDTH)


def _config(keep, prefetch, preset="zero3"):
    return zp.ZeroConfig.from_preset(
        preset, compute_dtype="float32", prefetch=prefetch, keep_activations=keep
    )


def _mlp_step(keep, prefetch):
    batch = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
    return compile_step(
        stacked_mlp_loss, jax.eval_shape(_mlp_params), config=_config(keep, prefetch),
        stacked=("blocks",), batch=batch,
    )


def _dots(compiled):
    """Matrix products the step executes (loop bodies times their trip counts)."""
    comps, entry = parse_module(compiled.as_text())
    runs = multiplicities(comps, entry)
    return sum(runs[name].count for name, comp in comps.items() if name in runs
               for inst in comp.instructions if inst.opcode == "dot")


# prefetch on: scan_layers' own custom VJP; off: lax.scan(zp.layer(block))
@pytest.mark.parametrize("prefetch", [True, False])
def test_same_collectives_fewer_dots_and_no_gathered_layer_kept(prefetch):
    (trainer, keep, r_keep), (_, full, r_full) = (
        _mlp_step(True, prefetch), _mlp_step(False, prefetch)
    )
    for kind in ("all-gather", "reduce-scatter"):
        assert executions(r_keep, kind) == executions(r_full, kind), kind
    assert r_keep.inter_node_bytes == r_full.inter_node_bytes
    # per layer: the forward's product is not computed again in the backward
    assert _dots(full) - _dots(keep) == LAYERS, (_dots(keep), _dots(full))
    # Temporaries grow by the kept activations (one (BATCH / 8, WIDTH) float32
    # product per layer and device), less than one gathered layer
    # (WIDTH x WIDTH): no layer's parameters stay alive from the forward to
    # the backward, and the kept products are not copied.
    layer_bytes = 4 * trainer.layout.unit("blocks").padded
    kept = LAYERS * BATCH // 8 * WIDTH * 4
    extra = keep.memory_analysis().temp_size_in_bytes - full.memory_analysis().temp_size_in_bytes
    assert extra <= kept * 1.25 + 1024 < layer_bytes, (extra, kept, layer_bytes)


@pytest.mark.parametrize("prefetch", [True, False])
def test_mlp_values_equal_full_recomputation(prefetch):
    params = _mlp_params()
    batches = [jax.random.normal(jax.random.key(i), (BATCH, WIDTH)) for i in range(2)]
    runs = {}
    for keep in (True, False):
        trainer = zp.make_trainer(
            stacked_mlp_loss, optax.adam(1e-2), params, mesh=mesh_of(2, 4),
            config=_config(keep, prefetch), per_layer=True, stacked=("blocks",),
        )
        runs[keep] = train_and_gather(trainer, params, batches)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
    assert_trees_close(runs[True][1], runs[False][1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ unrolled layers
def _loop_params():
    keys = jax.random.split(jax.random.key(3), LAYERS)
    return {f"l{i}": {"w": jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH)}
            for i, k in enumerate(keys)}


def _loop_loss(params, x):
    # the first activation each layer receives is a replicated constant, which
    # cannot order a gather: the re-gather must still wait for the cotangent
    table = jnp.linspace(0.5, 1.5, WIDTH)

    def block(table, h, stored):
        return jnp.tanh(h @ zp.gather(stored)["w"]) * table[None, :]

    h = x
    for i in range(LAYERS):
        h = zp.layer(block)(table, h, params[f"l{i}"])
    return jnp.mean(jnp.square(h))


def test_unrolled_layers_gather_again_in_the_backward():
    batch = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
    shapes = jax.eval_shape(_loop_params)
    runs = {keep: compile_step(_loop_loss, shapes, config=_config(keep, True), batch=batch)
            for keep in (True, False)}
    # L gathers forward and L backward; kept activations spare the first
    # layer's (its input is the batch: its weight gradient needs no weights)
    assert executions(runs[False][2], "all-gather") == 2 * LAYERS
    assert executions(runs[True][2], "all-gather") == 2 * LAYERS - 1
    # and no gathered layer is kept from the forward (without the backward's
    # sources tied to the cotangent, XLA:CPU kept them: +213 KB here)
    layer_bytes = 4 * runs[True][0].layout.unit("l0").padded
    extra = (runs[True][1].memory_analysis().temp_size_in_bytes
             - runs[False][1].memory_analysis().temp_size_in_bytes)
    assert extra < layer_bytes, (extra, layer_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [True, False])
def test_gpt_zeropp_values_equal_full_recomputation(prefetch):
    # zeropp in its full-precision warm-up (see test_prefetch's GPT test)
    runs = {keep: tiny_gpt_run(_config(keep, prefetch, preset="zeropp")) for keep in (True, False)}
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
    assert_trees_close(runs[True][1], runs[False][1], rtol=1e-5, atol=1e-5)
