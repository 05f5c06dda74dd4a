"""Checkpoints: exact resume, restore onto other meshes, crash safety, export, errors.

Trainers are cached per (preset, mesh) so each step function compiles once
for the whole file; the uninterrupted 2x4 runs (which also write the
checkpoints the other tests read) are module-scoped fixtures.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import warnings

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.checkpoint import (
    CheckpointError,
    Checkpointer,
    CheckpointMismatchError,
    export_params,
)
from zeropp_jax.models import gpt

import _util
from _util import TINY, gpt_loss, mesh_of, optimizer, run_cli, tiny_batches

# After a failed read of a corrupted checkpoint, a tensorstore read may finish
# later on Orbax's closed event loop ("Event loop is closed", reported from a
# background thread at any later moment): noise, not a failure.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEPS = 12
SAVE_AT = (2, 4, 6)  # with max_to_keep=2 only 4 and 6 remain
RESUME = SAVE_AT[-1]
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def params():
    return gpt.init_params(TINY, jax.random.key(0))


@functools.cache
def trainer(preset: str, nodes: int, local: int, model=TINY, opt=None) -> zp.Trainer:
    # qgz_warmup_steps=0: qgZ compresses (and the carry is live) from step 0.
    # The gradient target: its carry is re-summed onto other node counts
    # (1-bit Adam, the presets' default, is resumed in the CLI tests below).
    config = zp.ZeroConfig.from_preset(
        preset, qgz_warmup_steps=0, qgz_target="gradient", compute_dtype="float32")
    shapes = jax.eval_shape(lambda: gpt.init_params(model, jax.random.key(0)))
    return zp.make_trainer(
        gpt_loss(model), opt or optimizer(), shapes,
        mesh=mesh_of(nodes, local), config=config, per_layer=True, stacked=("blocks",),
    )


def continue_run(tr, state, start, stop=STEPS):
    return _util.continue_run(tr, state, start, stop)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted 2x4 runs that save (asynchronously) while they train."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for preset in ("zero3", "zeropp"):
        tr = trainer(preset, 2, 4)
        batches = tiny_batches()
        directory = root / preset
        state = tr.init(params())
        losses, snapshot = [], None
        with Checkpointer(directory, max_to_keep=2, async_save=True) as ckpt:
            for i in range(STEPS):
                state, m = tr.step(state, batches.batch_at(i))
                losses.append(float(m["loss"]))
                if i + 1 in SAVE_AT:
                    # The next step donates `state` while the save is written.
                    ckpt.save(i + 1, state, tr, {"seed": 0, "model": {"d_model": TINY.d_model}})
                    if i + 1 == RESUME:
                        snapshot = jax.device_get(state)
        out[preset] = dict(dir=str(directory), losses=np.array(losses), snapshot=snapshot)
    return out


def carry_sum(carry: dict, tr) -> dict:
    """Total deferred gradient per unit (sum over nodes), the leaves' elements only
    (a rotated code leaves a carry in the padding between leaves, too: nothing
    reads it, and a restore drops it)."""
    def leaves(x, unit):
        return np.concatenate([x[..., s.offset:s.offset + s.size] for s in unit.leaves], -1)

    return {k: leaves(np.asarray(v, np.float64), tr.layout.unit(k)).sum(axis=0)
            for k, v in carry.items()}


# --- exact resume -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["zero3", "zeropp"])
def test_resume_is_exact(runs, preset):
    run = runs[preset]
    tr = trainer(preset, 2, 4)
    ckpt = Checkpointer(run["dir"])
    assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == RESUME  # keeps the last 2
    state = ckpt.restore(tr)
    assert int(state.step) == RESUME
    # Restored straight into the trainer's shardings, bit for bit.
    expected = tr.abstract_state(jax.eval_shape(params))
    def same_sharding(x, a):
        assert x.sharding.mesh == tr.mesh
        assert x.sharding.spec == a.sharding.spec

    jax.tree.map(same_sharding, state, expected)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), run["snapshot"])
    if preset == "zeropp":
        carry = run["snapshot"].opt_state.qgz.carry
        assert any(np.abs(c).max() > 0 for c in jax.tree.leaves(carry))
    losses, _ = continue_run(tr, state, RESUME)
    np.testing.assert_array_equal(losses, run["losses"][RESUME:])


@pytest.mark.slow
def test_metadata(runs):
    meta = Checkpointer(runs["zeropp"]["dir"]).metadata()
    assert meta["step"] == RESUME and meta["mesh"] == {"node": 2, "local": 4}
    assert meta["extra"] == {"seed": 0, "model": {"d_model": TINY.d_model}}
    assert meta["config"]["preset"] == "zeropp" and meta["error_feedback"] is True
    units = {u["name"]: u for u in meta["layout"]["units"]}
    tr = trainer("zeropp", 2, 4)
    for u in tr.layout.units:
        assert (units[u.name]["numel"], units[u.name]["padded"], units[u.name]["stack"]) == (
            u.numel, u.padded, u.stack)


# --- another mesh -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(1, 8), (4, 2), (1, 1)])
def test_zero3_restores_onto_another_mesh(runs, mesh):
    run = runs["zero3"]
    tr = trainer("zero3", *mesh)
    state = Checkpointer(run["dir"]).restore(tr)
    source = trainer("zero3", 2, 4)
    jax.tree.map(
        np.testing.assert_array_equal,
        tr.gather_params(state), source.gather_params(run["snapshot"].params),
    )
    losses, _ = continue_run(tr, state, RESUME)
    np.testing.assert_allclose(losses, run["losses"][RESUME:], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(4, 2), (1, 8), (1, 1)])
def test_zeropp_restores_onto_another_mesh(runs, mesh, caplog):
    run = runs["zeropp"]
    tr = trainer("zeropp", *mesh)
    old_carry = run["snapshot"].opt_state.qgz.carry
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = Checkpointer(run["dir"]).restore(tr)
    dropped = [w for w in caught if "DROPPING the qgZ error-feedback carry" in str(w.message)]
    assert len(dropped) <= 1 and not [r for r in caplog.records if "DROPPING" in r.getMessage()]
    if tr.error_feedback:
        assert not dropped
        # Nothing lost: the deferred gradient, summed over nodes, is the same
        # and sits in node 0's row.
        new_carry = jax.device_get(state.opt_state.qgz.carry)
        old, new = carry_sum(old_carry, trainer("zeropp", 2, 4)), carry_sum(new_carry, tr)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12), old, new)
        for v in new_carry.values():
            assert not np.any(v[1:])
    else:  # a single node: no qgZ, the carry is dropped, loudly
        assert len(dropped) == 1 and "single node" in str(dropped[0].message)
        assert state.opt_state.qgz.carry == {}
    jax.tree.map(
        np.testing.assert_array_equal,
        tr.gather_params(state), trainer("zeropp", 2, 4).gather_params(run["snapshot"].params),
    )
    if mesh == (1, 1):
        return  # restore only: 1x1 runs like 1x8 (no node axis), saves a compile
    losses, _ = continue_run(tr, state, RESUME)
    # Another compressed path (4 nodes: measured 7e-4 after 6 steps) or full
    # precision (1 node: 1e-2): close, not equal.
    rtol = 5e-3 if tr.error_feedback else 3e-2
    np.testing.assert_allclose(losses, run["losses"][RESUME:], rtol=rtol)


def _history(k):
    """An optax transformation keeping the last ``k`` gradients, ``(k, *shape)``
    per leaf (a unit's is ``(k, [L,] U)``), and stepping along their mean."""
    def init(params):
        return (jax.tree.map(lambda p: jnp.stack([jnp.zeros_like(p)] * k), params),)

    def update(g, state, params=None):
        past = jax.tree.map(lambda h, x: jnp.concatenate([x[None], h[:-1]]), state[0], g)
        return jax.tree.map(lambda h: h.mean(0), past), (past,)

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("k", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_an_optimizer_history_moves_onto_another_padding(tmp_path, k):
    """A state leaf ``(k, [L,] U)`` is re-padded row by row. With ``k`` equal
    to the checkpoint's node count it was taken for one equal row per node
    (1-bit Adam's ``m``): row 0 was copied over the others, silently; with
    another ``k`` it was refused."""
    opt = optax.chain(_history(k), optax.adam(3e-3))
    source, target = trainer("qwz", 2, 4, opt=opt), trainer("qwz", 1, 4, opt=opt)
    assert [u.padded for u in source.layout.units] != [u.padded for u in target.layout.units]
    state = source.init(params())
    for i in range(k):
        state, _ = source.step(state, tiny_batches().batch_at(i))
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(k, state, source)
    restored = Checkpointer(tmp_path).restore(target)
    saved, got = jax.device_get((state.opt_state.inner[0][0], restored.opt_state.inner[0][0]))
    for unit in source.layout.units:
        old, new = unit, target.layout.unit(unit.name)
        assert saved[unit.name].shape[0] == k and np.abs(saved[unit.name][1]).max() > 0
        for a, b in zip(old.leaves, new.leaves):
            np.testing.assert_array_equal(got[unit.name][..., b.offset:b.offset + b.size],
                                          saved[unit.name][..., a.offset:a.offset + a.size])


@pytest.mark.slow
def test_a_typed_prng_key_in_the_optimizer_state_restores(tmp_path):
    """``optax.add_noise`` keeps a typed key (``key<fry>``), stored as its
    uint32 data: restored as it was (the next step's noise the same), on
    this mesh and onto another."""
    opt = optax.chain(optax.add_noise(0.01, 0.55, seed=0), optax.adam(3e-3))
    config = zp.ZeroConfig.from_preset("zero3", compute_dtype="float32")

    def make(nodes, local):  # add_noise's per-leaf noise looks like a mask to the check
        return zp.make_trainer(gpt_loss(), opt, params(), mesh=mesh_of(nodes, local),
                               config=config, per_layer=True, stacked=("blocks",),
                               check_optimizer=False)

    source = make(2, 4)
    state, _ = source.step(source.init(params()), tiny_batches().batch_at(0))
    key_type = state.opt_state.inner[0].rng_key.dtype
    saved = jax.device_get(jax.random.key_data(state.opt_state.inner[0].rng_key))
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, source)
    _, want = continue_run(source, state, 1, 2)
    for mesh in ((2, 4), (1, 8)):
        tr = make(*mesh)
        restored = Checkpointer(tmp_path).restore(tr)
        key = restored.opt_state.inner[0].rng_key
        assert key.dtype == key_type
        np.testing.assert_array_equal(jax.device_get(jax.random.key_data(key)), saved)
        _, got = continue_run(tr, restored, 1, 2)
        jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
                     tr.gather_params(got), source.gather_params(want))


@pytest.mark.slow
def test_carry_starts_at_zero_when_the_checkpoint_has_none(runs):
    tr = trainer("zeropp", 2, 4)
    state = Checkpointer(runs["zero3"]["dir"]).restore(tr)
    assert tr.error_feedback
    for v in jax.tree.leaves(state.opt_state.qgz.carry):
        assert not np.any(np.asarray(v))


@pytest.mark.slow
def test_zero3_checkpoint_moves_into_the_qwz_leaf_aligned_layout(runs):
    """qwZ aligns leaves to its block: a zero3 checkpoint's leaves are re-packed."""
    z3, zpp = trainer("zero3", 2, 4), trainer("zeropp", 2, 4)
    offsets = lambda tr: [s.offset for s in tr.layout.unit("blocks").leaves]
    assert offsets(z3) != offsets(zpp)
    want = z3.gather_params(Checkpointer(runs["zero3"]["dir"]).restore(z3, step=RESUME))
    got = zpp.gather_params(Checkpointer(runs["zero3"]["dir"]).restore(zpp, step=RESUME))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


# --- crash safety ---------------------------------------------------------------

KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp
import zeropp_jax as zp
from zeropp_jax.checkpoint import Checkpointer
from zeropp_jax.models import gpt
from _util import TINY, gpt_loss, mesh_of, optimizer

params = gpt.init_params(TINY, jax.random.key(0))
tr = zp.make_trainer(gpt_loss(), optimizer(), params, mesh=mesh_of(2, 4),
                     per_layer=True, stacked=("blocks",))
state = tr.init(params)
ckpt = Checkpointer(sys.argv[1], async_save=True)
ckpt.save(0, state, tr)
ckpt.wait()
bigger = jax.tree.map(lambda x: x + 1, state.params)
ckpt.save(1, state._replace(step=state.step + 1, params=bigger), tr)
os.kill(os.getpid(), signal.SIGKILL)  # while the background thread writes step 1
"""


@pytest.mark.slow
def test_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SAVE.format(tests=TESTS_DIR))
    proc = run_cli(str(script), str(directory), env_devices=8, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    names = sorted(os.listdir(directory))
    assert "0" in names and "1" not in names, names
    assert any(n.startswith("1.orbax-checkpoint-tmp") for n in names), names  # killed mid-write
    tr = trainer("zero3", 2, 4)
    ckpt = Checkpointer(directory)  # removes the temporary directory
    assert sorted(os.listdir(directory)) == ["0"] and ckpt.latest_step() == 0
    state = ckpt.restore(tr)
    jax.tree.map(
        np.testing.assert_array_equal, tr.gather_params(state), jax.device_get(params())
    )
    ckpt.save(1, state._replace(step=state.step + 1), tr)  # the step number is free again
    ckpt.close()
    assert not any("tmp" in n for n in os.listdir(directory))
    assert Checkpointer(directory).all_steps() == [0, 1]


def test_a_directory_opened_and_never_saved_to_ends_quietly(tmp_path):
    """Orbax cleaned an interrupted save's directory up on a thread that an
    exit right after met in the interpreter's shutdown: a traceback."""
    directory = tmp_path / "ckpt"
    (directory / "5.orbax-checkpoint-tmp-123").mkdir(parents=True)
    script = tmp_path / "opens.py"
    script.write_text("import sys\nfrom zeropp_jax.checkpoint import Checkpointer\n"
                      "Checkpointer(sys.argv[1])\n")
    proc = run_cli(str(script), str(directory), timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert os.listdir(directory) == []


@pytest.mark.slow
def test_a_save_the_script_never_waits_for_is_finished_at_exit(tmp_path):
    """A script that saves asynchronously and ends without wait() or close():
    its interpreter's exit waits for the commit (Orbax's thread pool would
    otherwise be shut first, leaving step 1 a temporary directory)."""
    directory = tmp_path / "ckpt"
    script = tmp_path / "ends.py"
    ends = KILLED_SAVE.replace("os.kill(os.getpid(), signal.SIGKILL)", "print('ends')")
    script.write_text(ends.format(tests=TESTS_DIR))
    proc = run_cli(str(script), str(directory), env_devices=8, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(os.listdir(directory)) == ["0", "1"]
    state = Checkpointer(directory).restore(trainer("zero3", 2, 4))
    assert int(state.step) == 1


def _corrupt_arrays(step_dir):
    """Truncates every array data file of the step's params."""
    hit = 0
    for root, _, files in os.walk(os.path.join(step_dir, "params")):
        for name in files:
            if os.path.basename(root) == "d":
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(7)
                hit += 1
    assert hit


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["arrays", "metadata", "item"])
def test_newest_corrupt_checkpoint_falls_back_to_the_newest_good_one(runs, tmp_path, damage):
    directory = tmp_path / "ckpt"
    shutil.copytree(runs["zero3"]["dir"], directory)
    bad = directory / str(RESUME)
    if damage == "arrays":
        _corrupt_arrays(bad)
    elif damage == "metadata":
        (bad / "meta" / "metadata").write_text("{ not json")
    else:
        shutil.rmtree(bad / "opt_state")
    tr = trainer("zero3", 2, 4)
    with pytest.raises(CheckpointError, match=rf"step {RESUME}.*{bad}|{bad}.*step {RESUME}"):
        Checkpointer(directory).restore(tr, step=RESUME)
    ckpt = Checkpointer(directory)
    with pytest.warns(UserWarning, match=rf"unreadable checkpoint {bad}"):
        state = ckpt.restore(tr)
    assert int(state.step) == 4
    # The bad one is moved aside, so training can save step 6 again.
    assert ckpt.all_steps() == [4] and (directory / f"{RESUME}.corrupt").is_dir()
    losses, state = continue_run(tr, state, 4, RESUME)
    np.testing.assert_array_equal(losses, runs["zero3"]["losses"][4:RESUME])
    ckpt.save(RESUME, state, tr)
    ckpt.close()
    assert Checkpointer(directory).all_steps() == [4, RESUME]


@pytest.mark.slow
def test_every_checkpoint_unreadable_is_an_error(runs, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(runs["zero3"]["dir"], directory)
    for step in (4, RESUME):
        _corrupt_arrays(directory / str(step))
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="no readable checkpoint"):
        Checkpointer(directory).restore(trainer("zero3", 2, 4))


def test_latest_step_warns_of_the_unreadable_steps_it_skips(tmp_path):
    """As :meth:`Checkpointer.restore` does: a loop that resumes from
    ``latest_step()`` would otherwise report an older step without a sign."""
    import re

    tr = trainer("zero3", 2, 4)
    state = tr.init(params())
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(0, state, tr)
        ckpt.save(1, state._replace(step=state.step + 1), tr)
    (tmp_path / "1" / "meta" / "metadata").write_text("{ not json")
    with Checkpointer(tmp_path) as ckpt:
        with pytest.warns(UserWarning, match=re.escape(f"skipping unreadable checkpoint "
                                                       f"{tmp_path / '1'}: ")):
            assert ckpt.latest_step() == 0
        assert ckpt.all_steps() == [0, 1]  # nothing moved aside by a look


# --- errors ---------------------------------------------------------------------


def test_bad_input_errors(runs, tmp_path):
    directory = runs["zero3"]["dir"]
    tr = trainer("zero3", 2, 4)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(tr)
    with pytest.raises(FileNotFoundError, match=r"step 5 .*available: \[4, 6\]"):
        Checkpointer(directory).restore(tr, step=5)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_params(tmp_path / "missing", tmp_path / "p.msgpack")

    wider = gpt.GPTConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=48, n_heads=2)
    with pytest.raises(CheckpointMismatchError, match=rf"{directory}/6: parameter "
                       r"blocks/attn/proj/bias is float32\[2, 32\] in the checkpoint but "
                       r"float32\[2, 48\] in the trainer's model"):
        Checkpointer(directory).restore(trainer("zero3", 2, 4, model=wider))
    deeper = gpt.GPTConfig(vocab_size=256, seq_len=16, n_layers=3, d_model=32, n_heads=2)
    with pytest.raises(CheckpointMismatchError, match=r"is float32\[2, 32\] in the checkpoint "
                       r"but float32\[3, 32\]"):
        Checkpointer(directory).restore(trainer("zero3", 2, 4, model=deeper))
    with pytest.raises(CheckpointMismatchError, match="another optimizer"):
        Checkpointer(directory).restore(trainer("zero3", 2, 4, opt=optax.sgd(0.1)))
    # gradient qgZ's state into 1-bit Adam (what the zeropp preset means now)
    onebit = zp.make_trainer(
        gpt_loss(), zp.onebit_adam(3e-3), jax.eval_shape(params), mesh=mesh_of(2, 4),
        config=zp.ZeroConfig.from_preset("zeropp", compute_dtype="float32"),
        per_layer=True, stacked=("blocks",))
    with pytest.raises(CheckpointMismatchError,
                       match=r"written with qgz_target='gradient' .* Build the trainer with an "
                       r"optax optimizer and ZeroConfig\(qgz_target='gradient'\)") as refused:
        Checkpointer(runs["zeropp"]["dir"]).restore(onebit)
    assert "--" not in str(refused.value)  # the library names config fields, not CLI flags

    ckpt = Checkpointer(tmp_path / "fresh")
    state = tr.init(params())
    with pytest.raises(ValueError, match="the state is at step 0"):
        ckpt.save(3, state, tr)
    with pytest.raises(ValueError, match="JSON-serializable"):
        ckpt.save(0, state, tr, {"bad": object()})
    ckpt.save(0, state, tr)
    with pytest.raises(ValueError, match="already holds a checkpoint at step 0"):
        ckpt.save(0, state, tr)
    ckpt.close()


# --- export ---------------------------------------------------------------------


@pytest.mark.slow
def test_export_round_trip(runs, tmp_path):
    run = runs["zeropp"]
    out = tmp_path / "params.msgpack"
    info = export_params(run["dir"], out)
    assert info["step"] == RESUME and info["params"] == gpt.count_params(TINY)
    with open(out, "rb") as f:
        exported = flax.serialization.msgpack_restore(f.read())  # plain Flax, no zeropp_jax
    expected = trainer("zeropp", 2, 4).gather_params(run["snapshot"].params)
    assert jax.tree.structure(exported) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, exported, expected)
    batch = jnp.asarray(tiny_batches().batch_at(0))
    assert np.isfinite(float(gpt.loss_fn(exported, batch, TINY)))

    # From a live state, and from the console script (another step).
    live = tmp_path / "live.msgpack"
    export_params(run["snapshot"], live, trainer=trainer("zeropp", 2, 4))
    assert live.read_bytes() == out.read_bytes()
    cli_out = tmp_path / "cli.msgpack"
    proc = run_cli("-m", "zeropp_jax.cli.export", run["dir"], str(cli_out), "--step", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 4" in proc.stdout
    # the directory is opened read-only on purpose: Orbax's notices about it are not shown
    assert "read only" not in proc.stderr and "read_only" not in proc.stderr, proc.stderr
    older = flax.serialization.msgpack_restore(cli_out.read_bytes())
    assert jax.tree.structure(older) == jax.tree.structure(expected)
    pairs = zip(jax.tree.leaves(older), jax.tree.leaves(exported))
    assert any(not np.array_equal(a, b) for a, b in pairs)


# --- multi-process save, single-process restore ----------------------------------

MULTI_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from zeropp_jax import distributed
distributed.initialize()
import jax
import zeropp_jax as zp
from zeropp_jax.checkpoint import Checkpointer
from zeropp_jax.models import gpt
from _util import TINY, gpt_loss, optimizer, tiny_batches

params = gpt.init_params(TINY, jax.random.key(0))
config = zp.ZeroConfig.from_preset("zeropp", qgz_warmup_steps=0, qgz_target="gradient",
                                   compute_dtype="float32")
tr = zp.make_trainer(gpt_loss(), optimizer(), params, mesh=zp.make_mesh(2, 4), config=config,
                     per_layer=True, stacked=("blocks",))
state = tr.init(params)
batches = tiny_batches()
losses = []
with Checkpointer(sys.argv[1]) as ckpt:
    for i in range({steps}):
        rows = batches.local_batch_at(i, process_index=jax.process_index(), process_count=2)
        state, m = tr.step(state, rows)
        losses.append(float(m["loss"]))
        if i + 1 == {save}:
            ckpt.save(i + 1, state, tr)
if jax.process_index() == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(losses, f)
"""


@pytest.mark.slow
def test_multi_process_save_restores_in_one_process(tmp_path):
    steps, save = 5, 3
    script = tmp_path / "mp.py"
    script.write_text(MULTI_PROCESS.format(tests=TESTS_DIR, steps=steps, save=save))
    directory, losses_file = tmp_path / "ckpt", tmp_path / "losses.json"
    proc = run_cli(
        "-m", "zeropp_jax.cli.launch", "-n", "2", "--devices-per-process", "4", "--timeout", "400",
        "--", sys.executable, str(script), str(directory), str(losses_file), timeout=450,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mp_losses = json.loads(losses_file.read_text())
    assert Checkpointer(directory).metadata()["process_count"] == 2

    tr = trainer("zeropp", 2, 4)
    state = Checkpointer(directory).restore(tr)
    restored = tr.gather_params(state)
    carry = jax.device_get(state.opt_state.qgz.carry)
    assert any(np.abs(c).max() > 0 for c in jax.tree.leaves(carry))
    losses, _ = continue_run(tr, state, save, steps)
    np.testing.assert_allclose(losses, mp_losses[save:], rtol=1e-5)
    # The same checkpoint onto one node (carry dropped, with a warning).
    with pytest.warns(UserWarning, match="DROPPING"):
        single = Checkpointer(directory).restore(trainer("zeropp", 1, 8))
    single_params = trainer("zeropp", 1, 8).gather_params(single)
    jax.tree.map(np.testing.assert_array_equal, single_params, restored)


# --- zeropp-train --checkpoint-dir / --resume -------------------------------------

CLI_TINY = (
    "-m", "zeropp_jax.cli.train", "--no-progress", "--mesh", "2x4", "--layers", "2",
    "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--dtype", "fp32",
)


def _cli_ok(proc):
    assert proc.returncode == 0, (
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# zeropp (1-bit Adam) with a warm-up of 6 and a resume at 4: the resumed run
# must switch to compressed steps at 6 from the restored step, with the
# restored m, frozen v and both carries. The CLI's resume path is the same for
# every preset; exact resumes of zero3 and of gradient qgZ's carry are
# test_resume_is_exact's.
@pytest.mark.slow
def test_cli_resume_matches_an_uninterrupted_run(tmp_path):
    ckpt, full, part = tmp_path / "ckpt", tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    args = (*CLI_TINY, "--preset", "zeropp", "--qgz-warmup", "6", "--steps", "8",
            "--checkpoint-dir", str(ckpt))
    _cli_ok(run_cli(*args, "--save-every", "4", "--keep", "2", "--metrics-out", str(full)))
    assert Checkpointer(ckpt).all_steps() == [4, 8]
    # As if the run had stopped after logging step 5, before saving step 8.
    shutil.rmtree(ckpt / "8")
    lines = _jsonl(full)
    part.write_text("".join(json.dumps(line) + "\n" for line in lines[:6]))
    proc = run_cli(*args)  # an existing directory without --resume is refused
    assert proc.returncode == 2 and "pass --resume" in proc.stderr
    proc = run_cli(*args, "--resume", "--metrics-out", str(part))
    _cli_ok(proc)
    assert f"resumed from {ckpt}/4" in proc.stdout
    assert "differs from the checkpoint's" not in proc.stderr  # the same flags
    resumed = _jsonl(part)
    assert [r["step"] for r in resumed] == list(range(8))
    for a, b in zip(resumed, lines):
        for key in ("loss", "grad_norm", "compressed"):
            assert a[key] == b[key], (a, b)
    assert [r["compressed"] for r in lines] == [0] * 6 + [1] * 2
    assert Checkpointer(ckpt).all_steps() == [4, 8]


@pytest.mark.slow
def test_cli_checkpoint_flags_need_a_directory():
    proc = run_cli(*CLI_TINY, "--resume")
    assert proc.returncode == 2 and "--resume needs --checkpoint-dir" in proc.stderr


def test_layout_mismatch_names_the_first_differing_leaf_or_the_unit_layout():
    """Parameters are compared before units: a changed leaf is named with both
    shapes; the same leaves cut into other units name the unit layout."""
    from zeropp_jax.checkpoint.metadata import check_layout, layout_to_json
    from zeropp_jax.layout import build_layout

    def layout(params, **kw):
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a, jnp.float32), params,
                              is_leaf=lambda x: isinstance(x, tuple))
        return build_layout(shapes, n_devices=8, align=1, **kw)

    model = {"enc": {"w": (4, 8), "b": (8,)}, "head": {"w": (8, 3)}}
    saved = layout_to_json(layout(model, per_layer=True))
    check_layout(saved, layout(model, per_layer=True), "ckpt")  # the same model fits,
    reordered = {"head": model["head"], "enc": model["enc"]}  # also with its keys in another
    check_layout(saved, layout(reordered, per_layer=True), "ckpt")  # order (jax.eval_shape's)
    wider = {"enc": {"w": (4, 8), "b": (8,)}, "head": {"w": (8, 5)}}
    with pytest.raises(CheckpointMismatchError, match=r"ckpt: parameter head/w is "
                       r"float32\[8, 3\] in the checkpoint but float32\[8, 5\] in the trainer's"):
        check_layout(saved, layout(wider, per_layer=True), "ckpt")
    extra = {**model, "bias": {"b": (3,)}}
    with pytest.raises(CheckpointMismatchError, match=r"has the parameter bias/b float32\[3\], "
                       "which the checkpoint does not"):
        check_layout(saved, layout(extra, per_layer=True), "ckpt")
    for other, how in ((layout(model, per_layer=False), r"one unit \(per_layer=False\)"),
                       (layout(model, units=[("enc",)]), r"a wrap policy's units \['rest', 'enc'\]")):
        with pytest.raises(CheckpointMismatchError, match=r"the same parameters, cut into other "
                           rf"units: the checkpoint has per_layer=True units \['enc', 'head'\], "
                           rf"the trainer {how}.*per_layer, stacked and wrap"):
            check_layout(saved, other, "ckpt")


def test_reads_left_in_flight_by_a_failed_restore_print_nothing(monkeypatch, capsys):
    """After a failed read, TensorStore's late completions into Orbax's closed
    event loop ("RuntimeError: Event loop is closed", about every other
    zeropp-export of a truncated step) are dropped; any other unraisable
    exception still reaches the hook that was installed before."""
    import asyncio
    import types

    from zeropp_jax.checkpoint import storage

    def unraisable(error):
        return types.SimpleNamespace(exc_type=type(error), exc_value=error,
                                     exc_traceback=error.__traceback__, err_msg=None,
                                     object=None)

    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError, match="Event loop is closed") as late:
        loop.call_soon_threadsafe(print)
    try:
        raise RuntimeError("something else")
    except RuntimeError as e:
        other = e
    passed_on = []
    monkeypatch.setattr(sys, "unraisablehook", passed_on.append)
    storage.drop_late_read_callbacks()
    storage.drop_late_read_callbacks()  # installed once, not stacked
    assert getattr(sys.unraisablehook, "drops_late_read_callbacks", False)
    sys.unraisablehook(unraisable(late.value))
    sys.unraisablehook(unraisable(other))
    assert [u.exc_value for u in passed_on] == [other]
    # the same message from elsewhere is not a late read
    assert not storage.is_late_read_callback(unraisable(RuntimeError("Event loop is closed")))


def test_a_python_without_threadings_exit_hook_warns_and_uses_atexit(monkeypatch, tmp_path):
    import atexit
    import threading

    from zeropp_jax.checkpoint import checkpointer

    registered = []
    monkeypatch.delattr(threading, "_register_atexit")
    monkeypatch.setattr(atexit, "register", registered.append)

    class Manager:
        waited = False

        def wait_until_finished(self):
            Manager.waited = True

    manager = Manager()
    with pytest.warns(UserWarning, match=r"no _register_atexit: a save .*Checkpointer.wait\(\)"):
        checkpointer._finish_at_exit(manager)
    (finish,) = registered
    finish()
    assert Manager.waited
