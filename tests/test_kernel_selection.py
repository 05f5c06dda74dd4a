"""The step runs the Pallas kernels (interpret mode on CPU) like the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeropp_jax as zp
from zeropp_jax.step.gather import GatherPlan, decode_payload
from zeropp_jax.wire.kernels import XLA, Kernels, select
from zeropp_jax.models import gpt

from _util import TINY, gpt_loss, mesh_of, optimizer, tiny_batches, zero_run


def test_selection_is_explicit():
    assert select("auto", "cpu").name == "xla"
    assert select("auto", "gpu").label == "pallas+xla-layer-decode"
    assert select("auto", "gpu").layer_decode == XLA
    assert select("pallas", "gpu").label == "pallas" == select("pallas", "gpu").layer_decode.name
    assert select("pallas", "cpu").name == "pallas-interpret"
    assert select("xla", "gpu").name == "xla"


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


@pytest.mark.parametrize(
    "overrides, steps",
    [
        ({}, 3), ({"qgz": "int4", "qwz_bits": 4}, 3),
        ({"qgz_code": "dither", "qgz_error_feedback": False}, 3),
        # 1-bit Adam's two hops; v from 2 warm-up steps (from 1 it is so poor an
        # estimate that float rounding differences grow to 2e-4)
        ({"qgz_target": "momentum", "qgz_warmup_steps": 2}, 5),
    ],
)
@pytest.mark.slow
def test_pallas_step_matches_xla_step(overrides, steps):
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
        losses[impl], _ = zero_run(trainer, params, tiny_batches(), steps)
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=1e-5)


def test_pallas_needs_power_of_two_blocks():
    params = gpt.init_params(TINY, jax.random.key(0))
    config = zp.ZeroConfig.from_preset("zeropp", qwz_block=24, implementation="pallas")
    with pytest.raises(ValueError, match="power-of-two blocks.*qwz_block=24"):
        zp.make_trainer(gpt_loss(), optimizer(config), params, mesh=mesh_of(2, 4), config=config,
                        per_layer=True, stacked=("blocks",))
