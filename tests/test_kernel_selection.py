"""The step runs the Pallas kernels (interpret mode on CPU) like the XLA path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeropp_jax as zp
from zeropp_jax.step.gather import GatherPlan, decode_payload
from zeropp_jax.wire.kernels import XLA, Kernels, select
from zeropp_jax.models import gpt

from _util import TINY, gpt_loss, mesh_of, optimizer, tiny_batches, zero_run
from test_kernel_tiles import _eqns


def test_selection_is_explicit():
    assert select("auto", "cpu").name == "xla"
    assert select("auto", "gpu").label == "pallas+xla-layer-decode"
    assert select("auto", "gpu").layer_decode == XLA
    assert select("pallas", "gpu").label == "pallas" == select("pallas", "gpu").layer_decode.name
    assert select("pallas", "cpu").name == "pallas-interpret"
    assert select("xla", "gpu").name == "xla"
    assert select("auto", "rocm").name == "xla"  # the Pallas kernels emit NVIDIA's PTX
    with pytest.raises(ValueError, match="written for NVIDIA GPUs"):
        select("pallas", "rocm")


@pytest.mark.parametrize("xla_layer_decode", [False, True])
def test_layer_decode_runs_in_xla_where_selected(xla_layer_decode):
    # A gathered layer's codes decode where the layer uses them: a Pallas call
    # or, with xla_layer_decode, the XLA reference (which fuses into the slicing)
    kernels = Kernels("pallas-interpret", xla_layer_decode=xla_layer_decode)
    plan = GatherPlan(gather_axes=(), reduce_axes=(), bits=8, block=32, scale_dtype=jnp.float32,
                      compute_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16, kernels=kernels)
    x = jax.random.normal(jax.random.key(0), (4096,), jnp.float32)
    payload = XLA.quantize(x, bits=8, block=32, scale_dtype=jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda p: decode_payload(plan, p))(payload))
    assert ("pallas_call" in jaxpr) != xla_layer_decode
    want = XLA.dequantize(payload, bits=8, block=32, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(decode_payload(plan, payload), want)


def _pallas_calls(trainer, params, batch, *, compress):
    """The names of the ``pallas_call``s in the step's jaxpr (tracing only)."""
    update = functools.partial(trainer.rule.update, trainer.geometry, trainer.loss_fn,
                               compress=compress, key=trainer.key)
    with jax.set_mesh(trainer.mesh):
        jaxpr = jax.make_jaxpr(update)(trainer.abstract_state(params), trainer.shard_batch(batch))
    return {e.params["name"] for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"}


# qwZ's and hpZ's int8 (or int4) codes, both ways, in every step
QWZ8, QWZ4 = {"quantize_int8", "dequantize_int8"}, {"quantize_int4", "dequantize_int4"}


@pytest.mark.parametrize(
    "overrides, steps, compressed_kernels",
    [
        # the preset's hadamard code: its 1-bit codes carry nothing into the kernel
        # (the carry is added before the rotation), so they are XLA's quantize, as
        # Kernels.quantize's 1 bit is, and its rows decode with the reference
        ({}, 3, QWZ8),
        # the sign code quantizes with its carry in the fused 1-bit kernel and sums
        # the received chunks in one decode
        ({"qgz_code": "sign"}, 3, QWZ8 | {"compress_1bit_ef", "dequantize_sum_1bit"}),
        # at 4 bits the code is "sign": the received chunks decode in one sum
        ({"qgz": "int4", "qwz_bits": 4}, 3, QWZ4 | {"dequantize_sum_4bit"}),
        ({"qgz_code": "dither", "qgz_error_feedback": False}, 3, QWZ8 | {"quantize_dithered"}),
        # 1-bit Adam's two hops; v from 2 warm-up steps (from 1 it is so poor an
        # estimate that float rounding differences grow to 2e-4)
        ({"qgz_target": "momentum", "qgz_warmup_steps": 2}, 5, QWZ8),
    ],
)
@pytest.mark.slow
def test_pallas_step_matches_xla_step(overrides, steps, compressed_kernels):
    """Same losses with either set, and the Pallas set really runs its kernels.

    The losses alone would also match if the Pallas set silently ran the XLA
    references, so the step's jaxpr must hold a ``pallas_call`` for every
    operation the config uses (none with the XLA set).
    """
    params = gpt.init_params(TINY, jax.random.key(0))
    losses = {}
    for impl in ("xla", "pallas"):
        config = zp.ZeroConfig.from_preset(
            "zeropp", compute_dtype="float32", implementation=impl,
            **{"qgz_warmup_steps": 0, "qgz_target": "gradient", **overrides},
        )
        opt = optimizer(config)
        trainer = zp.make_trainer(
            gpt_loss(), opt, params, mesh=mesh_of(2, 4), config=config,
            per_layer=True, stacked=("blocks",),
        )
        assert trainer.describe()["kernels"] == {"xla": "xla", "pallas": "pallas-interpret"}[impl]
        pallas = impl == "pallas"
        batch = tiny_batches().batch_at(0)
        assert _pallas_calls(trainer, params, batch, compress=True) == (
            compressed_kernels if pallas else set())
        assert _pallas_calls(trainer, params, batch, compress=False) == (
            (QWZ4 if overrides.get("qwz_bits") == 4 else QWZ8) if pallas else set())
        losses[impl], _ = zero_run(trainer, params, tiny_batches(), steps)
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=1e-5)


def test_pallas_needs_power_of_two_blocks():
    params = gpt.init_params(TINY, jax.random.key(0))
    config = zp.ZeroConfig.from_preset("zeropp", qwz_block=24, implementation="pallas")
    with pytest.raises(ValueError, match="power-of-two blocks.*qwz_block=24"):
        zp.make_trainer(gpt_loss(), optimizer(config), params, mesh=mesh_of(2, 4), config=config,
                        per_layer=True, stacked=("blocks",))
    # the block of a feature that is off is not used, so not checked
    off = zp.ZeroConfig.from_preset("qwz", qgz_block=24, implementation="pallas")
    zp.make_trainer(gpt_loss(), optimizer(off), params, mesh=mesh_of(2, 4), config=off,
                    per_layer=True, stacked=("blocks",))
