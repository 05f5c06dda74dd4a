"""1-bit Adam's checkpoints restore into optax Adam trainers and back
(:mod:`zeropp_jax.checkpoint.convert`): zeropp-max <-> zero3 on the 2x4 mesh."""

from __future__ import annotations

import functools
import json
import pickle
import warnings

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.checkpoint import Checkpointer, CheckpointMismatchError
from zeropp_jax.models import gpt

from _util import TINY, continue_run, gpt_loss, mesh_of, optimizer, tiny_batches, zero_run

# 1-bit Adam: steps 0-1 warm-up, 2-3 compressed, 4 refreshes v, 5 compressed.
SCHEDULE = dict(qgz_warmup_steps=2, qgz_refresh_every=3)
ONEBIT_STEPS = 6
ADAM_STEPS = 3
B1, B2, EPS = 0.9, 0.999, 1e-8  # onebit_adam's and optax.adam's defaults

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@functools.cache
def params():
    return gpt.init_params(TINY, jax.random.key(0))


SHAPES = jax.eval_shape(lambda: gpt.init_params(TINY, jax.random.key(0)))


@functools.cache
def trainer(preset: str, opt=None) -> zp.Trainer:
    onebit = preset == "zeropp-max"
    config = zp.ZeroConfig.from_preset(preset, compute_dtype="float32",
                                       **(SCHEDULE if onebit else {}))
    return zp.make_trainer(
        gpt_loss(), opt or optimizer(config), SHAPES, mesh=mesh_of(2, 4),
        config=config, per_layer=True, stacked=("blocks",),
    )


def real(x, unit) -> np.ndarray:
    """The real entries of a unit's ``(..., padded)`` array, leaf after leaf (float64)."""
    x = np.asarray(x, np.float64)
    return np.concatenate([x[..., s.offset:s.offset + s.size] for s in unit.leaves], axis=-1)


def adam_state(state):
    """The ScaleByAdamState of an optax chain(clip, adam) train state."""
    return state.opt_state.inner[1][0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """zeropp-max after ONEBIT_STEPS and zero3 after ADAM_STEPS: checkpoint
    directories, host copies of the saved states, and each run continued."""
    out = {}
    for preset, steps in (("zeropp-max", ONEBIT_STEPS), ("zero3", ADAM_STEPS)):
        tr = trainer(preset)
        _, state = zero_run(tr, params(), tiny_batches(), steps)
        directory = tmp_path_factory.mktemp(preset)
        with Checkpointer(directory, async_save=False) as ckpt:
            ckpt.save(steps, state, tr)
        host, before = jax.device_get((state, tr.gather_params(state)))
        losses, after = continue_run(tr, state, steps, steps + 2)
        out[preset] = dict(dir=directory, state=host, before=before, losses=losses,
                           after=jax.device_get(tr.gather_params(after)))
    return out


@pytest.mark.slow
def test_onebit_adam_restores_into_zero3(saved, caplog):
    """mu = m + d * carries / b1 and nu = v * (1 - b2**count) / (1 - b2**v_count),
    computed here from the saved state; then zero3 steps on from it."""
    run = saved["zeropp-max"]
    zero3, onebit = trainer("zero3"), trainer("zeropp-max")
    meta = Checkpointer(run["dir"]).metadata()
    assert meta["optimizer"] == {"name": "onebit_adam", "b1": B1, "b2": B2, "eps": EPS,
                                 "clip_norm": 1.0}
    with pytest.warns(UserWarning, match="FOLDED the error-feedback carries"):
        restored = Checkpointer(run["dir"]).restore(zero3)
    assert not [r for r in caplog.records if "FOLDED" in r.getMessage()]  # said once
    inner, qgz = run["state"].opt_state.inner, run["state"].opt_state.qgz
    count, v_count = int(inner.count), int(inner.v_count)
    assert (count, v_count) == (ONEBIT_STEPS, 5)  # v last updated by the refresh (step 4)
    adam = adam_state(restored)
    assert int(adam.count) == count
    for name in inner.m:
        old, new = onebit.layout.unit(name), zero3.layout.unit(name)
        m, v = real(inner.m[name][0], old), real(inner.v[name][0], old)
        carry = real(qgz.carry[name], old).mean(axis=0)
        if name in inner.receiver_carry:  # only the two-hop share keeps one
            carry = carry + real(inner.receiver_carry[name], old)
        assert np.abs(carry).max() > 0, name  # a compressed step left something deferred
        d = np.sqrt(v / (1 - B2**v_count)) + EPS
        np.testing.assert_allclose(real(adam.mu[name], new), m + d * carry / B1,
                                   rtol=1e-6, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(real(adam.nu[name], new),
                                   v * (1 - B2**count) / (1 - B2**v_count),
                                   rtol=1e-6, atol=1e-20, err_msg=name)
    losses, after = continue_run(zero3, restored, ONEBIT_STEPS, ONEBIT_STEPS + 2)
    # The same parameters: the same first loss; then optax's full-precision
    # step from the converted state lands close to 1-bit Adam's compressed one.
    np.testing.assert_allclose(losses[0], run["losses"][0], rtol=1e-6)
    # (within 2%: measured 0.8% with the hadamard code, 0.4% with the sign code;
    # 1.1% since stop 49 holds 1-bit Adam's update within Adam's own bound,
    # which is tight this early: v frozen after a few steps lags more)
    np.testing.assert_allclose(losses[1], run["losses"][1], rtol=2e-2)
    # Two steps move the parameters about as far as 1-bit Adam's, in about
    # the same direction (1-bit Adam's compressed steps differ from Adam's).
    got, want, before = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (
        zero3.gather_params(after), run["after"], run["before"]))
    assert np.isfinite(got).all()
    moved, reference = got - before, want - before
    ratio = np.linalg.norm(moved) / np.linalg.norm(reference)
    cosine = moved @ reference / (np.linalg.norm(moved) * np.linalg.norm(reference))
    assert 0.5 < ratio < 2 and cosine > 0.7, (ratio, cosine)


@pytest.mark.slow
def test_zero3_restores_into_onebit_adam_and_back(saved, tmp_path):
    """optax Adam -> 1-bit Adam is exact: m = mu, v = nu, v_count = count;
    its next full-precision step (a clipped Adam step, as in its warm-up) is
    zero3's, and saved again it restores into zero3 as it was."""
    run = saved["zero3"]
    zero3, onebit = trainer("zero3"), trainer("zeropp-max")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # exact: nothing to warn about
        restored = Checkpointer(run["dir"]).restore(onebit)
    adam = adam_state(run["state"])
    inner = jax.device_get(restored.opt_state.inner)
    assert int(inner.count) == int(inner.v_count) == ADAM_STEPS
    for name in inner.m:
        old, new = zero3.layout.unit(name), onebit.layout.unit(name)
        for rows, flat in ((inner.m[name], adam.mu[name]), (inner.v[name], adam.nu[name])):
            assert rows.shape[0] == onebit.nodes
            for row in rows:
                np.testing.assert_array_equal(real(row, new), real(flat, old), err_msg=name)
        assert name not in inner.receiver_carry  # zeropp-max's one-hop share keeps none
        assert not np.asarray(restored.opt_state.qgz.carry[name]).any()
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(ADAM_STEPS, restored, onebit)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        back = jax.device_get(Checkpointer(tmp_path).restore(zero3))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(run["state"])):
        np.testing.assert_array_equal(a, b)
    state, metrics = onebit.step(restored, tiny_batches().batch_at(ADAM_STEPS), compress=False)
    np.testing.assert_allclose(float(metrics["loss"]), run["losses"][0], rtol=1e-6)
    _, after = continue_run(zero3, Checkpointer(run["dir"]).restore(zero3),
                            ADAM_STEPS, ADAM_STEPS + 1)
    for a, b in zip(jax.tree.leaves(onebit.gather_params(state)),
                    jax.tree.leaves(zero3.gather_params(after))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _init_checkpoint(directory, tr):
    """A step-0 checkpoint of ``tr``'s initial state (no step compiled)."""
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.save(0, tr.init(params()), tr)
    return directory


def test_apply_if_finite_around_adam_converts_either_way(tmp_path, caplog):
    """``optax.apply_if_finite`` (the counterpart of ``skip_non_finite``):
    its counters, which 1-bit Adam does not keep, are dropped (named in the
    log) one way and start afresh the other."""
    guarded = optax.apply_if_finite(optimizer(), max_consecutive_errors=5)
    zero3, onebit = trainer("zero3", guarded), trainer("zeropp-max")
    state = zero3.init(params())
    counters = dict(notfinite_count=2, last_finite=False, total_notfinite=3)
    state = state._replace(opt_state=state.opt_state._replace(inner=state.opt_state.inner._replace(
        **{k: jax.device_put(np.asarray(v, getattr(state.opt_state.inner, k).dtype),
                             getattr(state.opt_state.inner, k).sharding)
           for k, v in counters.items()})))
    with Checkpointer(tmp_path / "guarded", async_save=False) as ckpt:
        ckpt.save(0, state, zero3)
    with caplog.at_level("WARNING", logger="zeropp_jax.checkpoint.convert"):
        restored = Checkpointer(tmp_path / "guarded").restore(onebit)
    assert int(restored.opt_state.inner.count) == 0
    assert ("dropped optax.apply_if_finite's counters {'last_finite': False, "
            "'notfinite_count': 2, 'total_notfinite': 3}") in caplog.text
    onebit_dir = _init_checkpoint(tmp_path / "onebit", onebit)
    back = jax.device_get(Checkpointer(onebit_dir).restore(zero3).opt_state.inner)
    assert (int(back.notfinite_count), bool(back.last_finite), int(back.total_notfinite)) == (
        0, True, 0)
    assert int(back.inner_state[1][0].count) == 0


def test_adams_betas_are_read_back_through_weight_decay_and_a_bf16_momentum(tmp_path):
    """The probe runs on zero parameters (a weight decay in front of Adam
    adds nothing) and allows a moment dtype's rounding: these Adams have
    1-bit Adam's betas and take its checkpoint; other betas are still told apart."""
    from zeropp_jax.checkpoint.convert import optax_adam_betas

    same = {
        "bf16 mu": optax.adam(3e-3, mu_dtype=jax.numpy.bfloat16),
        "L2 in front": optax.chain(optax.add_decayed_weights(1e-2), optax.adam(3e-3)),
    }
    for name, opt in same.items():
        b1, b2, tolerance = optax_adam_betas(opt)
        assert abs(b1 - B1) <= tolerance and abs(b2 - B2) <= tolerance, (name, b1, b2)
    b1, _, tolerance = optax_adam_betas(optax.adam(3e-3, b1=0.95, mu_dtype=jax.numpy.bfloat16))
    assert abs(b1 - 0.95) <= tolerance < abs(b1 - B1)
    onebit_dir = _init_checkpoint(tmp_path / "onebit", trainer("zeropp-max"))
    restored = Checkpointer(onebit_dir).restore(trainer("zero3", optax.chain(
        optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-2),
        optax.adam(3e-3, mu_dtype=jax.numpy.bfloat16))))
    adam = restored.opt_state.inner[2][0]  # chain(clip, decay, adam)
    assert adam.mu["blocks"].dtype == jax.numpy.bfloat16 and int(adam.count) == 0


def test_an_optimizer_that_rejects_the_beta_probe_is_named_with_its_error(tmp_path):
    """An optimizer that refuses the probe's ``(4,)`` tree (here one keyed by
    the unit names) converts with 1-bit Adam's betas, and the notice says why
    they could not be read; an error that is no rejection (a bug) is raised."""
    from zeropp_jax.checkpoint.convert import optax_adam_betas

    adam = optax.adam(3e-3)

    def init(params):
        if "probe" in params:
            raise KeyError("no label for 'probe'")
        return adam.init(params)

    labelled = optax.GradientTransformation(init, adam.update)
    assert optax_adam_betas(labelled) is None
    onebit_dir = _init_checkpoint(tmp_path / "onebit", trainer("zeropp-max"))
    with pytest.warns(UserWarning, match=r"could not read b1 and b2 back from the trainer's optax "
                                         r"optimizer \(its update of a \(4,\) probe tree raised "
                                         r"KeyError: .no label for 'probe'.\); converting"):
        Checkpointer(onebit_dir).restore(trainer("zero3", labelled))

    def buggy(params):
        raise ZeroDivisionError("a bug in the optimizer")

    with pytest.raises(ZeroDivisionError, match="a bug in the optimizer"):
        optax_adam_betas(optax.GradientTransformation(buggy, adam.update))


def test_conversion_is_refused_where_it_does_not_fit(tmp_path):
    onebit_dir = _init_checkpoint(tmp_path / "onebit", trainer("zeropp-max"))
    clipped_sgd = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    with pytest.raises(CheckpointMismatchError,
                       match=r"qgz_target='momentum'.*has 0 ScaleByAdamState.*exactly one"):
        Checkpointer(onebit_dir).restore(trainer("zero3", clipped_sgd))
    other_b2 = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3, b2=0.99))
    with pytest.raises(CheckpointMismatchError, match=r"b2=0.999 .* b2=0.99 \(") as refused:
        Checkpointer(onebit_dir).restore(trainer("zero3", other_b2))
    # It names the checkpoint's config (a front end names its flags from it),
    # and survives a copy or a trip through pickle (e.g. to another process).
    assert refused.value.stored_config["qgz_target"] == "momentum"
    again = pickle.loads(pickle.dumps(refused.value))
    assert (type(again), str(again)) == (type(refused.value), str(refused.value))
    assert again.stored_config == refused.value.stored_config
    sgd_dir = _init_checkpoint(tmp_path / "sgd", trainer("zero3", clipped_sgd))
    with pytest.raises(CheckpointMismatchError,
                       match=r"optax state has 0 Adam states .* exactly one"):
        Checkpointer(sgd_dir).restore(trainer("zeropp-max"))


def test_export_of_node_replicated_checkpoint_drops_the_node_axis(tmp_path):
    """zeropp-max stores one equal row per node: the export holds one copy,
    the model's parameters as they are; copies that differ are refused."""
    import flax.serialization

    from zeropp_jax.checkpoint import export_params
    from zeropp_jax.checkpoint.export import _stored_state_dict

    onebit = trainer("zeropp-max")
    assert onebit.config.node_replicated and onebit.nodes == 2
    directory = _init_checkpoint(tmp_path / "onebit", onebit)
    info = export_params(directory, tmp_path / "p.msgpack")
    assert info["params"] == gpt.count_params(TINY)
    exported = flax.serialization.msgpack_restore((tmp_path / "p.msgpack").read_bytes())
    assert jax.tree.structure(exported) == jax.tree.structure(params())
    jax.tree.map(np.testing.assert_array_equal, exported, jax.device_get(params()))
    export_params(onebit.init(params()), tmp_path / "live.msgpack", trainer=onebit)
    assert (tmp_path / "live.msgpack").read_bytes() == (tmp_path / "p.msgpack").read_bytes()

    with Checkpointer(directory, read_only=True) as ckpt:
        units, meta = ckpt.read_params()
    name = meta["layout"]["units"][0]["name"]
    units[name] = np.array(units[name])
    assert units[name].shape[0] == 2
    units[name][1, ..., 0] += 1.0
    with pytest.raises(ValueError, match=rf"unit '{name}' .* node 1's copy differs"):
        _stored_state_dict(units, meta["layout"], meta["step"])


def test_an_older_onebit_checkpoint_is_checked_before_its_conversion_is_announced(tmp_path):
    """A 1-bit Adam checkpoint written before its b1, b2 and eps were recorded
    converts with the trainer's optax Adam's betas and says so, but only once
    the restore's ``check`` has passed: a refused restore prints nothing."""
    import warnings

    onebit_dir = _init_checkpoint(tmp_path / "onebit", trainer("zeropp-max"))
    path = onebit_dir / "0" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    del meta["optimizer"]  # as written before the field
    path.write_text(json.dumps(meta))

    def refuse(meta):
        raise CheckpointMismatchError("refused by the command's check")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointMismatchError, match="refused by the command's check"):
            Checkpointer(onebit_dir).restore_with_metadata(trainer("zero3"), check=refuse)
    assert not [w for w in caught if "1-bit Adam" in str(w.message)], caught
    with pytest.warns(UserWarning, match=r"does not record 1-bit Adam's hyperparameters: "
                      r"taking b1, b2 = the trainer's optax Adam's \(0\.8999"):
        Checkpointer(onebit_dir).restore(trainer("zero3"))


@pytest.mark.slow
def test_a_stateless_step_around_adam_may_come_and_go_on_restore(saved, tmp_path):
    """zero3's checkpoint of ``chain(clip, adam)`` restores into plain Adam
    (its state a tuple shallower) with Adam's moments and count as saved,
    and that into ``chain(clip, adam)`` again: the states are paired leaf by
    leaf whatever the nesting. A checkpoint without ``state_flat`` (written
    before stop 51) still needs the same nesting."""
    plain = trainer("zero3", optax.adam(3e-3))
    restored = Checkpointer(saved["zero3"]["dir"]).restore(plain)
    ours, theirs = restored.opt_state.inner[0], adam_state(saved["zero3"]["state"])
    assert int(ours.count) == int(theirs.count) == ADAM_STEPS
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((ours.mu, ours.nu)),
                 (theirs.mu, theirs.nu))
    with Checkpointer(tmp_path / "plain", async_save=False) as ckpt:
        ckpt.save(ADAM_STEPS, restored, plain)
    back = Checkpointer(tmp_path / "plain").restore(trainer("zero3"))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(adam_state(back)), theirs)

    # a state that is not a tuple at the top (inject_hyperparams) under a clip too
    inject = optax.inject_hyperparams(optax.adam)(learning_rate=3e-3)
    inject_dir = _init_checkpoint(tmp_path / "inject", trainer("zero3", inject))
    clipped = trainer("zero3", optax.chain(optax.clip_by_global_norm(1.0), inject))
    assert float(Checkpointer(inject_dir).restore(clipped).opt_state.inner[1]
                 .hyperparams["learning_rate"]) == pytest.approx(3e-3)

    path = tmp_path / "plain" / str(ADAM_STEPS) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    del meta["optimizer"]["state_flat"]  # as written before the field
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointMismatchError, match="written with another optimizer"):
        Checkpointer(tmp_path / "plain").restore(trainer("zero3"))


def test_another_optimizer_of_the_same_kind_is_refused_on_restore(tmp_path):
    """No conversion asked for: an optax state another chain of transformations
    wrote (AdaBelief for Adam: the same leaves; a schedule's count added) and
    1-bit Adam's state under other betas are refused, naming both; the
    learning rate may change, stateless transformations (AdamW's weight
    decay) may be added, and a checkpoint that does not record the state
    restores."""
    clip = functools.partial(optax.chain, optax.clip_by_global_norm(1.0))
    adam_dir = _init_checkpoint(tmp_path / "adam", trainer("zero3"))
    for other, name in ((optax.adabelief(3e-3), r"ScaleByBeliefState.*schedule in place"),
                        (optax.adam(optax.linear_schedule(0.0, 1e-3, 10)),
                         r"ScaleByScheduleState")):
        with pytest.raises(CheckpointMismatchError, match=r"written with another optimizer: its "
                           r"optax state is \(\(ScaleByAdamState\(count=\*, "
                           rf"mu=\{{units: \*\}}, nu=\{{units: \*\}}\)\)\), .*{name}"):
            Checkpointer(adam_dir).restore(trainer("zero3", clip(other)))
    Checkpointer(adam_dir).restore(trainer("zero3", clip(optax.adam(1e-2))))  # another rate
    Checkpointer(adam_dir).restore(trainer("zero3", clip(optax.adamw(1e-3, weight_decay=0.1))))

    path = adam_dir / "0" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    del meta["optimizer"]["state"]  # as written before the field
    path.write_text(json.dumps(meta))
    Checkpointer(adam_dir).restore(trainer("zero3"))

    onebit_dir = _init_checkpoint(tmp_path / "onebit", trainer("zeropp-max"))
    with pytest.raises(CheckpointMismatchError, match=r"1-bit Adam with b2=0.999, the trainer's "
                       r"has b2=0.99: .* Build zeropp_jax.onebit_adam with b2=0.999"):
        Checkpointer(onebit_dir).restore(
            trainer("zeropp-max", zp.onebit_adam(3e-3, b2=0.99, clip_norm=1.0)))
    Checkpointer(onebit_dir).restore(trainer("zeropp-max", zp.onebit_adam(1e-3, clip_norm=1.0)))
