"""Gradient sinks in the compute dtype (``zeropp_jax.step.geometry.sink_dtype``).

Where a stack's rows are each written once with the reduced gradient (one
micro-batch, reduced per layer over every device), that gradient arrives in
the compute dtype, so a sink in that dtype changes no value and halves the
gradient's bytes. XLA:CPU widens 2-byte floats around in-place updates, so
on the CPU the sinks stay float32; these tests lift that to run the
compute-dtype sinks here, and check they train bit for bit as float32 ones.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeropp_jax as zp
from zeropp_jax.models import gpt
from zeropp_jax.step import geometry
from zeropp_jax.step.geometry import sink_dtype

from _util import TINY, gpt_loss, mesh_of, optimizer, tiny_gpt_run


@pytest.fixture
def half_sinks(monkeypatch):
    """Compute-dtype sinks on this backend too."""
    monkeypatch.setattr(geometry, "WIDENS_HALF_FLOATS", frozenset())


def _geometry(preset, **overrides):
    config = zp.ZeroConfig.from_preset(preset, **{"compute_dtype": "bfloat16", **overrides})
    shapes = jax.eval_shape(lambda k: gpt.init_params(TINY, k), jax.random.key(0))
    trainer = zp.make_trainer(gpt_loss(), optimizer(config), shapes, mesh=mesh_of(2, 4),
                              config=config, per_layer=True, stacked=("blocks",))
    return trainer, {u.name: u for u in trainer.layout.units}


def test_which_sinks_take_the_compute_dtype(half_sinks):
    trainer, units = _geometry("zero3")
    geo = trainer.geometry
    assert sink_dtype(geo, units["blocks"]) == jnp.bfloat16
    assert sink_dtype(geo, units["embed"]) == jnp.float32  # unstacked: the tied embedding
    accum, units2 = _geometry("zero3", grad_accum=2)
    assert sink_dtype(accum.geometry, units2["blocks"]) == jnp.float32  # summed micro-batches
    zeropp, units3 = _geometry("zeropp")
    assert sink_dtype(zeropp.geometry, units3["blocks"]) == jnp.float32  # node-partial
    fp32, units4 = _geometry("zero3", compute_dtype="float32")
    assert sink_dtype(fp32.geometry, units4["blocks"]) == jnp.float32


def test_cpu_keeps_float32_sinks():
    trainer, units = _geometry("zero3")
    assert sink_dtype(trainer.geometry, units["blocks"]) == jnp.float32


def test_the_step_holds_the_stacked_gradient_in_bfloat16(half_sinks):
    trainer, units = _geometry("zero3")
    rows = units["blocks"].padded // trainer.n_devices
    batch = jax.ShapeDtypeStruct((8, TINY.seq_len + 1), jnp.int32)
    shapes = jax.eval_shape(lambda k: gpt.init_params(TINY, k), jax.random.key(0))
    hlo = trainer.compile_from_shapes(shapes, batch).as_text()
    assert f"bf16[{TINY.n_layers},{rows}]" in hlo


@pytest.mark.parametrize("preset, overrides", [
    ("zero3", {}),
    pytest.param("zero3", {"prefetch": False}, marks=pytest.mark.slow),  # lax.scan(zp.layer)
    pytest.param("qwz", {}, marks=pytest.mark.slow),
    pytest.param("hpz", {}, marks=pytest.mark.slow),
])
def test_same_training_as_float32_sinks(preset, overrides, monkeypatch):
    config = zp.ZeroConfig.from_preset(preset, compute_dtype="bfloat16", **overrides)
    want_losses, want = tiny_gpt_run(config, steps=3)
    monkeypatch.setattr(geometry, "WIDENS_HALF_FLOATS", frozenset())
    losses, got = tiny_gpt_run(config, steps=3)
    np.testing.assert_array_equal(losses, want_losses)
    jax.tree.map(np.testing.assert_array_equal, got, want)
