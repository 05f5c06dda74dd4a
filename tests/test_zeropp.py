"""ZeRO++: what crosses the wire (from the HLO), error feedback, schedule."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zp
from zeropp_jax.models import gpt
from zeropp_jax.wire.qgz import cross_node_reduce
from pallas_kernels.references.quantization import dequantize, quantize

from _util import TINY, gpt_loss, gpt_step, mesh_of, optimizer, tiny_batches, zero_run

# Collectives of the metrics (loss, gradient norm): a few scalars.
METRIC_BYTES = 16
# The 1-bit presets run 1-bit Adam; these select gradient compression.
GRADIENT = dict(qgz_target="gradient")


def crosses_node(c):
    return c.axis in ("node", "node+local")


def per_layer(c):
    """Collectives inside the layer loops (executed more than once)."""
    return c.count > 1


@functools.cache
def _step(preset, layers=3, **overrides):
    return gpt_step(layers, preset, **overrides)


def report(preset, layers=3, **overrides):
    return _step(preset, layers, **overrides)[2]


def _gathered_bytes(rep):
    return sum(c.result_bytes * c.count for c in rep.collectives if c.kind == "all-gather")


def test_qwz_gathers_carry_int8_codes_and_scales_only():
    from zeropp_jax.analysis.collectives import payload_role

    rep = report("qwz")
    gathers = [c for c in rep.collectives if c.kind == "all-gather"]
    # codes and fp32 scales packed into one byte buffer per gather
    assert {(c.dtype, payload_role(c)) for c in gathers} == {("u8", "packed")}
    # 1 byte per value plus a 4-byte scale per 256-element block (qwZ block),
    # against zero3's 4 bytes per value, for the same gathers: zero3's gather of
    # a unit (4 bytes per padded element) is qwz's gather of the same unit at
    # qwz's padding (shards a multiple of the block, leaves aligned to it)
    zero3 = report("zero3")
    assert [c.count for c in gathers] == [
        c.count for c in zero3.collectives if c.kind == "all-gather"]
    units = {name: _step(name)[0].geometry.layout.units for name in ("zero3", "qwz")}
    unit_of = {4 * u.padded: u.name for u in units["zero3"]}
    assert len(unit_of) == len(units["zero3"])  # a gather's bytes name its unit
    padded = {u.name: u.padded for u in units["qwz"]}
    want = sum(c.count * padded[unit_of[c.result_bytes]] * (1 + 4 / 256)
               for c in zero3.collectives if c.kind == "all-gather")
    assert _gathered_bytes(rep) == want


@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_qwz_computes_with_each_shards_decoded_codes(bits):
    """The weights a qwZ step computes with are ``dequantize(quantize(w))``,
    block by block within each device's shard, decoded exactly as the
    reference decodes them: the first loss of a linear loss is that of the
    decoded weights, which differs from the loss of ``w`` itself by far more
    than the tolerance (so a gather that skipped or coarsened qwZ fails)."""
    config = zp.ZeroConfig.from_preset("qwz", qwz_bits=bits, compute_dtype="float32")
    n = 8 * 2 * config.qwz_block  # two blocks per device's shard
    rng = np.random.default_rng(1)
    w = (rng.normal(size=(n,)) * np.logspace(-2, 1, n)).astype(np.float32)
    rows = rng.normal(size=(16, n)).astype(np.float32)

    def loss(p, batch):
        return jnp.mean(batch @ zp.gather(p["w"]))

    trainer = zp.make_trainer(loss, optax.sgd(0.1), {"w": w}, mesh=mesh_of(2, 4), config=config,
                              per_layer=True)
    _, metrics = trainer.step(trainer.init({"w": w}), rows)
    wire = dict(bits=bits, block=config.qwz_block)
    decoded = dequantize(quantize(jnp.asarray(w), scale_dtype=config.scale_dtype, **wire),
                         dtype=jnp.float32, **wire)
    mean_row = rows.astype(np.float64).mean(0)
    want, unquantized = mean_row @ np.asarray(decoded, np.float64), mean_row @ w
    # two float32 roundings of the largest sum the dot product could reach
    tolerance = 2 * np.finfo(np.float32).eps * (np.abs(mean_row) @ np.abs(w))
    assert abs(want - unquantized) > 100 * tolerance, (want, unquantized, tolerance)
    assert abs(float(metrics["loss"]) - want) < tolerance, (float(metrics["loss"]), want)


def test_qwz_int4_gathers_packed_bytes():
    packed4, packed8 = _gathered_bytes(report("qwz", qwz_bits=4)), _gathered_bytes(report("qwz"))
    # int8: n + s bytes, int4: n / 2 + s, s = 4 n / 256 (fp32 scales per 256)
    codes8 = 2 * (packed8 - packed4)
    assert packed8 - codes8 == pytest.approx(codes8 * 4 / 256, rel=1e-6)


@pytest.mark.parametrize("prefetch", [True, False])
def test_hpz_per_layer_gathers_stay_inside_the_node(prefetch):
    """Of the parameters only the refresh of the secondary partition crosses
    nodes: once per step for the whole model, or, under prefetch, layer by
    layer in the forward for the stacked layers (one layer ahead), the same
    bytes. With one micro-batch each layer's gradient is reduced over
    ``local``, then over ``node`` in the backward; with several, over
    ``local`` per layer and micro-batch, and over ``node`` once per step."""
    # four layers: with prefetch the backward computes its first and last
    # layers around its loop, which three layers would leave one iteration (inlined)
    rep = report("hpz", layers=4, prefetch=prefetch)
    refresh = [c for c in rep.collectives if c.kind == "all-gather" and crosses_node(c)]
    assert refresh, "hpZ must refresh its secondary copy across nodes once per step"
    for c in rep.collectives:
        if c in refresh:
            assert c.axis == "node" and "hpz_secondary" in c.op_name, c
            assert c.count == 1 or (prefetch and "/while/body/" in c.op_name), c
        elif per_layer(c) and c.kind == "all-gather":
            assert c.axis == "local", c
        elif per_layer(c):  # the gradient's two levels, each over one axis
            assert c.kind == "reduce-scatter" and c.axis in ("local", "node"), c
    assert any(per_layer(c) and c.kind == "reduce-scatter" and c.axis == "node"
               for c in rep.collectives)
    accumulated = report("hpz", layers=4, prefetch=prefetch, grad_accum=2)
    node_reductions = [c for c in accumulated.collectives
                       if c.kind == "reduce-scatter" and crosses_node(c)]
    assert node_reductions and all(c.count == 1 for c in node_reductions), node_reductions
    bytes_of = lambda r: sum(c.result_bytes * c.count for c in r.collectives  # noqa: E731
                             if c.kind == "all-gather" and crosses_node(c))
    assert bytes_of(rep) == bytes_of(report("hpz", layers=4, prefetch=not prefetch))
    assert any(c.count > 1 for c in refresh) == prefetch


def test_hpz_secondary_is_decoded_once_or_kept_quantized():
    """qwZ's codes cross nodes once per step either way; decoded, the per-layer
    gathers inside the node carry the compute dtype and the same values."""
    reports = {s: report("zeropp", hpz_secondary=s) for s in ("decoded", "quantized")}
    for rep in reports.values():
        refresh = [c for c in rep.collectives if c.kind == "all-gather" and crosses_node(c)]
        assert "u8" in {c.dtype for c in refresh}, refresh  # codes and scales, packed
    in_node = {s: {c.dtype for c in rep.collectives
                   if c.kind == "all-gather" and per_layer(c) and c.axis == "local"}
               for s, rep in reports.items()}
    assert in_node["decoded"] == {"f32"}, in_node
    assert in_node["quantized"] == {"u8"}, in_node
    assert reports["decoded"].inter_node_bytes == reports["quantized"].inter_node_bytes

    runs = {}
    for secondary in ("decoded", "quantized"):
        # full precision throughout: a 1-bit code would turn rounding into sign flips
        trainer, params = _train("zeropp", 0, qgz_warmup_steps=3, hpz_secondary=secondary)
        runs[secondary] = (zero_run(trainer, params, tiny_batches(), 3)[0],
                           trainer.memory_per_device()["gather_source"])
    (decoded, decoded_mem), (quantized, quantized_mem) = runs.values()
    assert decoded[0] == quantized[0]  # the same parameters gathered: the same first loss
    np.testing.assert_allclose(decoded, quantized, rtol=1e-6)  # then float32 rounding
    assert decoded_mem > 3 * quantized_mem  # float32 vs int8 codes and their scales
    with pytest.raises(ValueError, match="hpz=True and qwz_bits"):
        zp.ZeroConfig.from_preset("hpz", hpz_secondary="quantized")


def test_qgz_gradients_cross_nodes_as_packed_bits_and_scales():
    # gradient qgZ; 1-bit Adam's wire: tests/test_momentum.py
    rep = report("qgz", **GRADIENT)
    across = [c for c in rep.collectives if crosses_node(c) and c.kind != "all-gather"]
    assert not [c for c in across if c.kind == "reduce-scatter"], across
    a2a = [c for c in across if c.kind == "all-to-all"]
    assert {c.dtype for c in a2a} == {"u8"}  # bits and scales packed, one per unit
    assert all(c.axis == "node" and c.count == 1 for c in a2a)
    for c in rep.collectives:
        if c.kind == "reduce-scatter":
            assert c.axis == "local", c


@pytest.mark.slow
@pytest.mark.parametrize("mode,bits", [("int8", 8), ("int4", 4)])
def test_qgz_integer_modes_on_the_wire(mode, bits):
    rep = report("qgz", qgz=mode, **GRADIENT)
    a2a = [c for c in rep.collectives if c.kind == "all-to-all"]
    assert {c.dtype for c in a2a} == {"u8"}
    # per value: bits / 8 bytes of codes plus a float32 scale per qgZ block
    block = zp.ZeroConfig.from_preset("qgz", qgz=mode, **GRADIENT).qgz_block
    one_bit = report("qgz", **GRADIENT)
    values = sum(c.operand_bytes for c in one_bit.collectives if c.kind == "all-to-all")
    values /= 1 / 8 + 4 / zp.ZeroConfig.from_preset("qgz", **GRADIENT).qgz_block
    got = sum(c.operand_bytes for c in a2a)
    assert got == pytest.approx(values * (bits / 8 + 4 / block), rel=0.02)


def test_zeropp_only_refresh_and_compressed_gradients_cross_nodes():
    # gradient qgZ; the presets' 1-bit Adam: tests/test_momentum.py
    rep = report("zeropp", **GRADIENT)
    for c in rep.collectives:
        if not crosses_node(c):
            continue
        if c.kind == "all-reduce":
            assert c.operand_bytes <= METRIC_BYTES, c
        elif c.kind == "all-gather":  # hpZ's refresh (of the stacked layers: per layer)
            assert c.axis == "node" and c.dtype == "u8", c
            assert c.count == 1 or "hpz_secondary" in c.op_name, c
        else:
            assert c.kind == "all-to-all" and c.dtype == "u8", c


@pytest.mark.slow
@pytest.mark.parametrize("accum,limit", [(1, 5), (4, 16)])
def test_zeropp_gradient_inter_node_bytes_vs_zero3(accum, limit):
    """Gradient qgZ; the presets' 1-bit Adam over its refresh cycle: test_momentum.py."""
    zero3 = report("zero3", grad_accum=accum).inter_node_bytes
    zeropp = report("zeropp", grad_accum=accum, **GRADIENT).inter_node_bytes
    assert zeropp * limit <= zero3, (zeropp, zero3)


def test_error_feedback_loses_nothing():
    """sum(transmitted) + final carry == sum(true gradients), per device."""
    mesh = mesh_of(2, 4)
    steps, width = 25, 2 * 256 * 3
    magnitudes = jnp.logspace(-3, 1, width)[None, None, :]
    grads = jax.random.normal(jax.random.key(0), (steps, 8, width)) * magnitudes

    def run(g):  # g: (steps, 1, width) on each device
        def step(carry, g_t):
            reduced, carry, sent = cross_node_reduce(
                g_t, carry, bits=1, block=256, scale_dtype=jnp.float32,
                reduce_dtype=jnp.float32, compress=True,
            )
            return carry, (sent, reduced)

        carry0 = jnp.zeros_like(g[0])
        carry, (sent, reduced) = jax.lax.scan(step, carry0, g)
        return carry, sent.sum(0), reduced.sum(0)

    spec = P(None, ("node", "local"))
    g = jax.device_put(grads, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        carry, sent, reduced = jax.jit(
            jax.shard_map(run, mesh=mesh, in_specs=spec,
                          out_specs=(P(("node", "local")),) * 3)
        )(g)
    carry, sent, reduced = (np.asarray(x, np.float64) for x in (carry, sent, reduced))
    truth = np.asarray(grads, np.float64).sum(0)
    np.testing.assert_allclose(sent + carry, truth, rtol=1e-4, atol=1e-4 * np.abs(truth).max())
    # the receivers summed exactly what was sent: node-sum of each chunk
    sent_nodes = sent.reshape(2, 4, 2, -1).sum(0)  # (local, chunk, m)
    reduced = reduced.reshape(2, 4, -1).transpose(1, 0, 2)  # (local, node->chunk, m)
    np.testing.assert_allclose(reduced, sent_nodes, rtol=1e-5, atol=1e-5)
    # and compression really lost something each step (carry is not zero)
    assert np.abs(carry).max() > 0


def test_trainer_error_feedback_loses_nothing():
    """Gradient qgZ through the trainer: what SGD moved plus the final carry
    is the sum of the true mean gradients, so each step's carry was sent.

    A linear loss, whose gradient (the batch's mean row) does not depend on
    the parameters, and SGD at learning rate 1: the parameters move by minus
    the decoded sums over ``devices``; the carries, summed over nodes, hold
    what the codes have not sent yet, in the same units.
    """
    rng = np.random.default_rng(0)
    n, steps, devices = 300, 4, 8
    params = {"w": np.zeros((n,), np.float32), "b": np.zeros((3, 5), np.float32)}
    rows = [rng.normal(size=(16, n + 15)).astype(np.float32) * np.logspace(-2, 1, n + 15)
            for _ in range(steps)]

    def loss(p, batch):
        return jnp.mean(batch @ jnp.concatenate([p["w"], p["b"].reshape(-1)]))

    config = zp.ZeroConfig.from_preset("qgz", compute_dtype="float32", qgz_warmup_steps=0,
                                       **GRADIENT)
    trainer = zp.make_trainer(loss, optax.sgd(1.0), params, mesh=mesh_of(2, 4), config=config)
    state = trainer.init(params)
    for batch in rows:
        state, metrics = trainer.step(state, batch)
        assert int(metrics["compressed"]) == 1
    moved = trainer.gather_params(state)  # minus the sum of the sent mean gradients
    carries = {name: c.sum(0) / devices for name, c in state.opt_state.qgz.carry.items()}
    pending = trainer.gather_params(carries)
    total = sum(r.mean(0) for r in rows)
    truth = {"w": total[:n], "b": total[n:].reshape(3, 5)}
    for name, want in truth.items():
        np.testing.assert_allclose(pending[name] - moved[name], want, rtol=1e-5,
                                   atol=1e-5 * np.abs(total).max(), err_msg=name)
        # and the codes lost something (the carry is not zero)
        assert np.abs(pending[name]).max() > 1e-3 * np.abs(want).max(), name


def _train(preset, steps, **overrides):
    params = gpt.init_params(TINY, jax.random.key(0))
    config = zp.ZeroConfig.from_preset(preset, compute_dtype="float32", **overrides)
    trainer = zp.make_trainer(
        gpt_loss(), optimizer(config), params, mesh=mesh_of(2, 4), config=config,
        per_layer=True, stacked=("blocks",),
    )
    return trainer, params


@pytest.mark.slow
def test_compressed_presets_track_zero3():
    losses = {}
    # 1-bit Adam estimates v in the warm-up: from one step it spiked to loss 33
    runs = {"zero3": {}, "qwz": {}, "zeropp": dict(qgz_warmup_steps=4),
            "zeropp-gradient": dict(qgz_warmup_steps=0, **GRADIENT)}
    for name, overrides in runs.items():
        trainer, params = _train(name.split("-")[0], 15, **overrides)
        losses[name], _ = zero_run(trainer, params, tiny_batches(), 15)
    # int8 weights: within 2x the gap measured over these 15 steps (9.5e-4),
    # and not zero3's losses (qwZ applied); its exact decode:
    # test_qwz_computes_with_each_shards_decoded_codes
    np.testing.assert_allclose(losses["qwz"], losses["zero3"], rtol=2e-3)
    assert not np.allclose(losses["qwz"], losses["zero3"], rtol=1e-4, atol=0)
    # 1-bit compression lags a little early on (benchmarks/presets.py
    # measures 400 steps) but must train clearly
    for name in ("zeropp", "zeropp-gradient"):
        np.testing.assert_allclose(losses[name], losses["zero3"], rtol=0.1)
        assert losses[name][-1] < losses[name][0] - 1.0
        assert not np.allclose(losses[name], losses["zero3"], rtol=1e-7)


@pytest.mark.slow
def test_hpz_secondary_and_carry_are_right_after_a_restore():
    """A state rebuilt from host copies continues exactly (no stale copy).

    Gradient qgZ from step 0; 1-bit Adam's state is resumed exactly by
    tests/test_checkpoint.py's CLI resume."""
    trainer, params = _train("zeropp", 0, qgz_warmup_steps=0, **GRADIENT)
    batches = tiny_batches()
    state = trainer.init(params)
    for i in range(3):
        state, _ = trainer.step(state, batches.batch_at(i))
    host = jax.device_get(state)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    restored = jax.tree.map(lambda h, s: jax.device_put(h, s), host, shardings)
    cont = []
    for i in range(3, 6):
        state, m = trainer.step(state, batches.batch_at(i))
        cont.append(float(m["loss"]))
    again = []
    for i in range(3, 6):
        restored, m = trainer.step(restored, batches.batch_at(i))
        again.append(float(m["loss"]))
    assert cont == again


def test_qgz_is_inactive_on_a_single_node():
    trainer, _ = _train("qgz", 0)
    assert trainer.qgz_active
    config = zp.ZeroConfig.from_preset("qgz")
    single = zp.make_trainer(
        gpt_loss(), optimizer(config), gpt.init_params(TINY, jax.random.key(0)), mesh=mesh_of(1, 8),
        config=config, per_layer=True, stacked=("blocks",),
    )
    assert not single.qgz_active and single.describe()["qgz_active"] is False


@pytest.mark.slow
def test_non_finite_parameter_is_reported_not_hidden():
    trainer, params = _train("zeropp", 0, qgz_warmup_steps=1)
    params = jax.tree.map(lambda x: x, params)
    params["blocks"]["mlp"]["fc"]["kernel"] = params["blocks"]["mlp"]["fc"]["kernel"].at[0, 0, 0].set(jnp.inf)
    state = trainer.init(params)
    _, m = trainer.step(state, tiny_batches().batch_at(0))
    assert not np.isfinite(float(m["loss"]))


@pytest.mark.parametrize("mode", ["int8", "1bit"])
def test_a_non_finite_gradient_leaves_the_carry_as_it_was(mode):
    """With ``optax.apply_if_finite``, a NaN step is skipped and training goes on.

    The carry of that step would be NaN and poison every later gradient (each
    step then skipped, the loss frozen); it is kept as it was instead, and so
    is the gradient RMS ``qgz_min_grad_rms``'s gate reads (NaN would open it).
    """
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(64, 4)).astype(np.float32)}
    x, y = rng.normal(size=(16, 64)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)
    config = zp.ZeroConfig.from_preset("zero3", qgz=mode, qgz_warmup_steps=0, **GRADIENT)
    trainer = zp.make_trainer(
        lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=10), params,
        mesh=mesh_of(2, 4), config=config)
    state, losses = trainer.init(params), []
    for i in range(6):
        state, metrics = trainer.step(state, {"x": _with_nan(x, i == 2), "y": y})
        assert int(metrics["compressed"]) == 1
        losses.append(float(metrics["loss"]))
        if i == 1:
            qgz_before = jax.device_get(state.opt_state.qgz)
        if i == 2:  # skipped: the carry waits, the gate keeps the last finite RMS
            jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.opt_state.qgz),
                         qgz_before)
    assert np.isnan(losses[2]) and np.all(np.isfinite(losses[3:]))
    assert losses[5] < losses[3] < losses[1]
    assert int(state.opt_state.inner.total_notfinite) == 1
    assert all(np.isfinite(np.asarray(c)).all() for c in jax.tree.leaves(state.opt_state.qgz.carry))


def test_a_finite_gradient_past_float32s_norm_is_applied_and_moves_the_carry():
    """Finite elements whose squared norm overflows float32: ``apply_if_finite``
    applies the step (its test is per element), so the carry must move on with
    it; kept, what it held would be delivered twice."""
    params = {"w": np.zeros((64, 4), np.float32)}
    x = np.random.default_rng(1).normal(size=(16, 64)).astype(np.float32)
    config = zp.ZeroConfig.from_preset("zero3", qgz="int8", qgz_warmup_steps=0, **GRADIENT)
    trainer = zp.make_trainer(
        lambda p, b: jnp.sum(b["x"] @ p["w"]) * 1e20,  # gradient ~1e20: finite, its square not
        optax.apply_if_finite(optax.sgd(0.0), max_consecutive_errors=10), params,
        mesh=mesh_of(2, 4), config=config)
    state = trainer.init(params)
    state, metrics = trainer.step(state, {"x": x})
    carry_before = jax.device_get(state.opt_state.qgz.carry)
    state, metrics = trainer.step(state, {"x": x[::-1] * 1.5})
    assert np.isinf(float(metrics["grad_norm"])) and int(metrics["compressed"]) == 1
    assert int(state.opt_state.inner.total_notfinite) == 0  # applied
    carry = jax.device_get(state.opt_state.qgz.carry)
    assert all(np.isfinite(c).all() for c in jax.tree.leaves(carry))
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(carry), jax.tree.leaves(carry_before)))
    state, metrics = trainer.step(state, {"x": _with_nan(x, True)})  # a NaN: kept, and
    assert np.isnan(float(metrics["grad_norm"]))  # reported as NaN
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.opt_state.qgz.carry), carry)


def _with_nan(x, nan):
    x = x.copy()
    if nan:
        x[0, 0] = np.nan
    return x
