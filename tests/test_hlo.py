"""The compiled step does per-layer ZeRO-3: read from the HLO, not timed.

For L layers the step must run about 2L all-gathers (forward, and again in
the backward), not one whole-model gather, and its temporary memory must grow
with the largest layer, not with depth.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import zeropp_jax as zp

from _util import child_env, compile_step, executions, gpt_step, hlo_digest
from conftest import FAST_CODEGEN_FLAG


def block_bytes(trainer):
    return 4 * trainer.layout.unit("blocks").padded


def test_scan_layers_gather_twice_per_layer_and_memory_is_flat_in_depth():
    t2, c2, r2 = gpt_step(2)
    t6, c6, r6 = gpt_step(6)
    # every extra layer adds exactly one forward and one backward gather
    assert executions(r6, "all-gather") - executions(r2, "all-gather") == 2 * 4
    assert executions(r6, "reduce-scatter") - executions(r2, "reduce-scatter") == 4
    # a gather is one layer, never the stacked blocks or the whole model
    largest = max(c.result_bytes for c in r6.collectives if c.kind == "all-gather")
    assert largest <= block_bytes(t6)
    # temporaries grow by the sharded gradient of a layer (1/8 of it), not
    # by a gathered layer per layer of depth
    growth_per_layer = (
        c6.memory_analysis().temp_size_in_bytes - c2.memory_analysis().temp_size_in_bytes
    ) / 4
    assert growth_per_layer < 0.25 * block_bytes(t6), growth_per_layer


def _python_loop_model(n_layers, width=256):
    shapes = {
        f"layer{i}": {"w": jax.ShapeDtypeStruct((width, width), jnp.float32),
                      "b": jax.ShapeDtypeStruct((width,), jnp.float32)}
        for i in range(n_layers)
    }

    def loss(params, x):
        for i in range(n_layers):
            def one(unit, h):
                p = zp.gather(unit)
                return jnp.tanh(h @ p["w"] + p["b"][None, :])

            x = zp.layer(one)(params[f"layer{i}"], x)
        return jnp.mean(jnp.square(x))

    return shapes, loss


def test_python_loop_layers_gather_twice_per_layer_and_memory_is_flat_in_depth():
    results = {}
    for n in (2, 8):
        shapes, loss = _python_loop_model(n)
        batch = jax.ShapeDtypeStruct((8, 256), jnp.float32)
        trainer, compiled, report = compile_step(loss, shapes, batch=batch)
        results[n] = (trainer, compiled, report)
        assert executions(report, "all-gather") == 2 * n
        assert executions(report, "reduce-scatter") == n
    layer_bytes = 4 * results[8][0].layout.unit("layer0").padded
    growth = (
        results[8][1].memory_analysis().temp_size_in_bytes
        - results[2][1].memory_analysis().temp_size_in_bytes
    ) / 6
    assert growth < 0.25 * layer_bytes, growth


def test_whole_model_fallback_gathers_everything_once():
    trainer, _, report = gpt_step(2, per_layer=False)
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert sum(c.count for c in gathers) == 1
    assert gathers[0].result_bytes == 4 * trainer.layout.padded_numel


def test_zero3_collectives_span_all_devices_in_fp32():
    _, _, report = gpt_step(2)
    for c in report.collectives:
        if c.kind in ("all-gather", "reduce-scatter"):
            assert c.axis == "node+local", c
            assert c.dtype == "f32", c
    assert report.inter_node_bytes > 0
    assert report.exact


def _linen_loop_step(n_layers):
    """A Linen model with its layers in a Python loop, gathered whole (per_layer=False)."""
    import flax.linen as nn
    import optax

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(n_layers):
                x = x + nn.Dense(64)(nn.LayerNorm()(x))
            return nn.Dense(8)(x)

    model = Model()
    x = jax.ShapeDtypeStruct((8, 16, 64), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]

    def loss(p, b):
        return jnp.mean(model.apply({"params": p}, b) ** 2)

    trainer = zp.make_trainer(loss, optax.sgd(0.1), params, mesh=zp.make_mesh(2, 4),
                              config=zp.ZeroConfig(compute_dtype="float32"))
    return trainer, trainer.compile_from_shapes(params, x)


def test_whole_model_gradient_is_assembled_once_so_memory_is_linear_in_depth():
    t2, c2 = _linen_loop_step(2)
    t8, c8 = _linen_loop_step(8)
    # Each leaf's gradient used to be padded to the whole unit and summed in a
    # chain (quadratic in depth); now one concatenation builds it.
    assert " pad(" not in c8.as_text()
    temp2 = c2.memory_analysis().temp_size_in_bytes
    temp8 = c8.memory_analysis().temp_size_in_bytes
    model_ratio = t8.layout.padded_numel / t2.layout.padded_numel
    assert temp8 <= 1.25 * model_ratio * temp2, (temp2, temp8, model_ratio)


# Imports no test module: conftest, imported by one, would set level 0 again.
_DIGEST_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import _util
assert "optimization_level" not in os.environ["XLA_FLAGS"], os.environ["XLA_FLAGS"]
print(_util.hlo_digest(_util.gpt_step(2, "zeropp")[1]))
"""


@pytest.mark.slow  # compiles again in a second process
def test_the_tests_llvm_level_compiles_the_same_hlo_as_the_default():
    """conftest's LLVM level 0 changes code generation only: the ZeRO++ step's
    optimized HLO, where every byte count of these tests is read, is the text
    a user's default level compiles."""
    assert FAST_CODEGEN_FLAG in os.environ["XLA_FLAGS"]
    env = child_env(8, default_codegen=True)
    assert "optimization_level" not in env["XLA_FLAGS"]
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", _DIGEST_SCRIPT.format(tests=tests)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == hlo_digest(gpt_step(2, "zeropp")[1])
