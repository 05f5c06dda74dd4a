"""Node-replicated 1-bit Adam (``node_replicated``, the ``zeropp-max`` preset)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import zeropp_jax as zp
from zeropp_jax.analysis.comm_report import comm_report
from zeropp_jax.checkpoint import Checkpointer
from zeropp_jax.models import gpt

from _util import TINY, continue_run, gpt_loss, gpt_step, mesh_of, tiny_batches, zero_run

# A short 1-bit Adam schedule: 2 warm-up steps, then every 3rd step refreshes v.
SCHEDULE = dict(qgz_warmup_steps=2, qgz_refresh_every=3)
STEPS = 8


def _trainer(preset, mesh=(2, 4), **overrides):
    params = gpt.init_params(TINY, jax.random.key(0))
    config = zp.ZeroConfig.from_preset(preset, compute_dtype="float32", **SCHEDULE, **overrides)
    trainer = zp.make_trainer(
        gpt_loss(), zp.onebit_adam(3e-3, clip_norm=1.0), params, mesh=mesh_of(*mesh),
        config=config, per_layer=True, stacked=("blocks",),
    )
    return trainer, params


# zeropp-max's 1-bit wire, with qwZ int8 on both presets: both then gather
# values dequantized from the same codes and take bit-identical steps.
# Without qwZ they compile the same float arithmetic differently, and the
# 1-bit code turns last-bit differences of momenta near zero into sign flips.
WIRE = {**{k: zp.config.PRESETS["zeropp-max"][k]
           for k in ("qgz_block", "scale_dtype", "qgz_code", "qgz_share")},
        "qwz_bits": 8}


@functools.cache
def _runs():
    out = {}
    # zeropp's secondary kept quantized: per-layer gathers and decodes of the
    # same form as zeropp-max's, so the same float arithmetic
    extra = {"zeropp": dict(hpz_secondary="quantized"), "zeropp-max": {}}
    for preset in ("zeropp", "zeropp-max"):
        trainer, params = _trainer(preset, **WIRE, **extra[preset])
        losses, state = zero_run(trainer, params, tiny_batches(), STEPS)
        out[preset] = trainer, losses, state
    return out


@pytest.mark.slow
def test_zeropp_max_takes_zeropps_steps():
    """The same update as zeropp: its hpZ secondary is the local slice that
    zeropp-max keeps, quantized in the same blocks; only where it lives differs."""
    runs = _runs()
    (t_max, l_max, s_max), (t_pp, l_pp, s_pp) = runs["zeropp-max"], runs["zeropp"]
    np.testing.assert_allclose(l_max, l_pp, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(t_max.gather_params(s_max)),
                    jax.tree.leaves(t_pp.gather_params(s_pp))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_replicas_stay_bit_identical_across_nodes():
    trainer, _, state = _runs()["zeropp-max"]
    for name, p in state.params.items():
        assert p.shape[0] == trainer.nodes, (name, p.shape)
        rows = np.asarray(jax.device_get(p))
        for node in range(1, trainer.nodes):
            np.testing.assert_array_equal(rows[node], rows[0], err_msg=name)
        assert np.abs(rows[0]).sum() > 0


@pytest.mark.slow
def test_checkpoint_restores_into_zeropp_and_onto_another_node_count(tmp_path):
    """Saved at step 4 (after a compressed and a refresh step): restored into
    zeropp (parameters sharded over all devices) it takes zeropp-max's steps;
    on a 4x2 mesh the equal rows are copied onto 4 nodes."""
    first = 4
    trainer, params = _trainer("zeropp-max", **WIRE)
    _, state = zero_run(trainer, params, tiny_batches(), first)
    saved = trainer.gather_params(state)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(first, state, trainer)
    want, _ = continue_run(trainer, state, first, first + 2)
    zeropp, _ = _trainer("zeropp", **WIRE)
    got, _ = continue_run(zeropp, Checkpointer(tmp_path).restore(zeropp), first, first + 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    other, _ = _trainer("zeropp-max", mesh=(4, 2), **WIRE)
    restored = Checkpointer(tmp_path).restore(other)
    for a, b in zip(jax.tree.leaves(other.gather_params(restored)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)
    m = {name: np.asarray(jax.device_get(x)) for name, x in restored.opt_state.inner.m.items()}
    assert all(x.shape[0] == 4 and (x == x[:1]).all() and np.abs(x).sum() > 0 for x in m.values())
    losses, _ = continue_run(other, restored, first, first + 2)
    assert np.isfinite(losses).all()


@pytest.mark.slow
def test_checkpoint_moves_between_the_two_hop_and_the_gathered_share(tmp_path):
    """Two hops -> one: the receiver carry (deferred momentum) joins every
    node's sender carry, whose mean the exchange delivers; one -> two: the
    receiver carry starts at zeros."""
    two_hop = {**WIRE, "qgz_share": "two-hop"}
    trainer, params = _trainer("zeropp-max", **two_hop)
    _, state = zero_run(trainer, params, tiny_batches(), 6)  # ends on compressed steps
    with Checkpointer(tmp_path / "two") as ckpt:
        ckpt.save(6, state, trainer)
    gathered, _ = _trainer("zeropp-max", **WIRE)
    restored = Checkpointer(tmp_path / "two").restore(gathered)
    assert not restored.opt_state.inner.receiver_carry
    for name, sender in state.opt_state.qgz.carry.items():
        receiver = np.asarray(jax.device_get(state.opt_state.inner.receiver_carry[name]))
        assert np.abs(receiver).max() > 0, name
        want = np.asarray(jax.device_get(sender)) + receiver[None]
        np.testing.assert_allclose(jax.device_get(restored.opt_state.qgz.carry[name]), want,
                                   rtol=1e-6, atol=1e-7)
    with Checkpointer(tmp_path / "one") as ckpt:
        ckpt.save(6, restored, gathered)
    again = Checkpointer(tmp_path / "one").restore(trainer)
    for name, r in again.opt_state.inner.receiver_carry.items():
        assert not np.asarray(jax.device_get(r)).any(), name
    losses, _ = continue_run(trainer, again, 6, 8)
    assert np.isfinite(losses).all()


def test_master_parameters_are_one_local_slice_per_device():
    trainer, _ = _trainer("zeropp-max", **WIRE)
    reference, _ = _trainer("zeropp", hpz_secondary="quantized", **WIRE)
    mem, ref = trainer.memory_per_device(), reference.memory_per_device()
    assert mem["master_params"] == ref["master_params"] * trainer.nodes
    assert mem["gather_source"] == ref["gather_source"]  # int8 local slice either way
    # The preset (no qwZ, float32 here): the gathers send the master slice itself.
    assert _trainer("zeropp-max")[0].memory_per_device()["gather_source"] == 0


def _crosses_node(c):
    return c.axis in ("node", "node+local")


@functools.cache
def _compiled(preset: str, compress: bool | None, accum: int = 1):
    """The example GPT's (3 layers, d_model 128) compiled step; 1-bit Adam
    compresses from step 1."""
    schedule = dict(qgz_warmup_steps=1) if preset != "zero3" else {}
    return gpt_step(3, preset, compress=compress, grad_accum=accum, **schedule)[1]


def _report(compress: bool):
    return comm_report(_compiled("zeropp-max", compress), mesh_shape=(2, 4))


def test_no_parameter_crosses_nodes():
    """Compressed: only the momentum's codes and scales cross (with two nodes
    one all-gather of every node's codes); full precision: only the gradient
    all-reduce."""
    METRIC_BYTES = 16  # the loss and norm scalars
    compressed = [c for c in _report(True).collectives
                  if _crosses_node(c) and not (c.kind == "all-reduce" and c.operand_bytes <= METRIC_BYTES)]
    # codes and bf16 scales of every unit packed into one byte buffer
    assert [(c.kind, c.dtype, c.count) for c in compressed] == [("all-gather", "u8", 1)]
    assert all(c.axis == "node" for c in compressed)
    full = [c for c in _report(False).collectives if _crosses_node(c)]
    assert {c.kind for c in full} == {"all-reduce"}


def test_compressed_step_is_zeropps_without_the_hpz_refresh():
    preset_wire = {k: zp.config.PRESETS["zeropp-max"][k]
                   for k in ("qwz_bits", "qgz_block", "scale_dtype", "qgz_code", "qgz_share")}
    zeropp = gpt_step(3, "zeropp", compress=True, qgz_warmup_steps=1, **preset_wire)[2]
    refresh = sum(zeropp.counted_bytes(c)[0] for c in zeropp.collectives
                  if "hpz_secondary" in c.op_name)
    assert refresh > zeropp.inter_node_bytes / 2
    assert _report(True).inter_node_bytes == pytest.approx(zeropp.inter_node_bytes - refresh, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("accum, limit", [(1, 16), (4, 64)])
def test_refresh_cycle_moves_16x_fewer_bytes_than_zero3_in_bf16(accum, limit):
    """Two-level per-node bytes at the widths a bf16 GPU run sends (floats in
    bf16; the scales are bf16 bytes in their packed buffers), over one
    refresh cycle of the preset."""
    wire = dict(float_dtypes=("bf16", "bf16"))

    def inter(preset, compress):
        compiled = _compiled(preset, compress, accum)
        return comm_report(compiled, mesh_shape=(2, 4), **wire).inter_node_bytes

    every = zp.ZeroConfig.from_preset("zeropp-max").qgz_refresh_every
    compressed, full = inter("zeropp-max", True), inter("zeropp-max", False)
    cycle = ((every - 1) * compressed + full) / every
    assert compressed < cycle < full
    assert cycle * limit <= inter("zero3", None), (compressed, full, cycle)


@pytest.mark.parametrize("overrides, message", [
    (dict(qgz_target="gradient", qgz_refresh_every=0), "needs 1-bit Adam"),
    (dict(hpz=True), "set hpz=False"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        zp.ZeroConfig.from_preset("zeropp-max", **overrides)
