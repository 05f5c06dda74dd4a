"""Never lose a good checkpoint: finite-state guard, checksums, divergence, resume checks.

The checkpoint tests need no train step (states come from ``init``, with a
step count or ``nan`` set by hand), so only small init/checksum programs
compile; the CLI tests run ``zeropp-train``'s ``main`` in this process on a
tiny model.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeropp_jax as zp
from zeropp_jax.checkpoint import CheckpointError, Checkpointer, NonFiniteStateError, export_params
from zeropp_jax.checkpoint import checksum
from zeropp_jax.models import gpt

from _util import TINY, gpt_loss, mesh_of, optimizer

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@functools.cache
def trainer() -> zp.Trainer:
    shapes = jax.eval_shape(lambda: gpt.init_params(TINY, jax.random.key(0)))
    config = zp.ZeroConfig.from_preset("zero3", compute_dtype="float32")
    return zp.make_trainer(gpt_loss(), optimizer(), shapes, mesh=mesh_of(2, 4), config=config,
                           per_layer=True, stacked=("blocks",))


def state_at(step: int, *, nan: str | None = None):
    """An initial state relabelled as step ``step``; ``nan`` poisons "params" or "opt_state"."""
    tr = trainer()
    state = tr.init(gpt.init_params(TINY, jax.random.key(0)))
    state = state._replace(step=state.step + step)
    poison = lambda t: jax.tree.map(lambda x: x * jnp.nan if x.dtype == jnp.float32 else x, t)
    if nan == "params":
        state = state._replace(params=poison(state.params))
    elif nan == "opt_state":
        state = state._replace(opt_state=state.opt_state._replace(inner=poison(state.opt_state.inner)))
    return state


def test_fingerprint_is_the_same_on_devices_and_on_the_host():
    x = np.random.default_rng(0).standard_normal((4, 48)).astype(np.float32)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh_of(2, 4), jax.P(None, ("local", "node"))))
    sums, finite = checksum.state_summary({"params": {"w": sharded}})
    assert sums["params"]["w"] == checksum.host_fingerprint(x) and finite == {"params": True}
    flipped = x.copy()
    flipped.view(np.uint32)[2, 5] ^= 1 << 9  # one bit
    assert checksum.host_fingerprint(flipped) != sums["params"]["w"]
    swapped = x.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]  # same values, another order
    assert checksum.host_fingerprint(swapped) != sums["params"]["w"]
    # every dtype a state holds, labels included (a bool was labelled uint8
    # on the host, so a converted optax.apply_if_finite state never restored)
    leaves = {"flag": np.asarray(False), "flags": x > 0, "count": np.asarray(7, np.int32),
              "codes": (x * 50).astype(np.int8), "half": x.astype(jnp.bfloat16)}
    sums, _ = checksum.state_summary({"s": {k: jax.device_put(v) for k, v in leaves.items()}})
    assert sums["s"] == {k: checksum.host_fingerprint(v) for k, v in leaves.items()}


@pytest.mark.parametrize("nan", ["params", "opt_state"])
def test_a_non_finite_state_is_never_saved_nor_counted_toward_keep(tmp_path, nan):
    with Checkpointer(tmp_path, max_to_keep=1) as ckpt:
        ckpt.save(1, state_at(1), trainer())
        what = "parameters" if nan == "params" else "optimizer state"
        with pytest.raises(NonFiniteStateError, match=f"step 2: the {what} hold inf or nan"):
            ckpt.save(2, state_at(2, nan=nan), trainer())
        ckpt.wait()
        assert ckpt.all_steps() == [1]
    assert int(Checkpointer(tmp_path).restore(trainer()).step) == 1


def _tamper_checksum(step_dir, item: str) -> str:
    """Changes one digit of a leaf's stored checksum (the data no longer match it)."""
    path = os.path.join(step_dir, "meta", "metadata")
    meta = json.load(open(path))
    key = sorted(meta["checksums"][item])[0]
    value = meta["checksums"][item][key]
    meta["checksums"][item][key] = value[:-1] + ("0" if value[-1] != "0" else "1")
    json.dump(meta, open(path, "w"))
    return key


@pytest.mark.parametrize("item", ["params", "opt_state"])
def test_data_that_do_not_match_their_checksum_are_a_corrupt_checkpoint(tmp_path, item):
    """The stored sums are tampered with (zstd-compressed data with flipped bytes
    mostly fail to decode, which was caught before; benchmarks/reliability.py
    flips the data)."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state_at(2), trainer())
        ckpt.save(3, state_at(3), trainer())
    key = _tamper_checksum(tmp_path / "3", item)
    if item == "params":  # export reads the parameters only, and leaves the files as they are
        with pytest.raises(CheckpointError, match=f"params/{key} do not match the checksum"):
            export_params(tmp_path, tmp_path / "p.msgpack", step=3)
    ckpt = Checkpointer(tmp_path)
    with pytest.warns(UserWarning, match=rf"{item}/{key} do not match the checksum"):
        state = ckpt.restore(trainer())
    assert int(state.step) == 2 and ckpt.all_steps() == [2]
    assert (tmp_path / "3.corrupt").is_dir()


# --- zeropp-train ---------------------------------------------------------------

TRAIN = ["--no-progress", "--mesh", "2x4", "--layers", "2", "--d-model", "32", "--heads", "2",
         "--seq-len", "16", "--batch-size", "8", "--dtype", "fp32", "--preset", "zero3"]


from zeropp_jax.cli.common import make_optimizer as _MAKE_OPTIMIZER  # noqa: E402


def _poison_from(monkeypatch, step: int) -> None:
    """The CLI's optimizer, turning its update into nan from optimizer step ``step`` on."""
    import optax

    from zeropp_jax.cli import common

    make = _MAKE_OPTIMIZER
    nan_from = lambda count: jnp.where(count >= step, jnp.nan, 1.0).astype(jnp.float32)
    monkeypatch.setattr(
        common, "make_optimizer",
        lambda *a, **k: optax.chain(make(*a, **k), optax.scale_by_schedule(nan_from)),
    )


def _train(argv, capsys) -> tuple[int, str, str]:
    from zeropp_jax.cli import train

    try:
        rc = train.main(TRAIN + argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in open(path)]


@pytest.mark.slow
def test_cli_stops_before_saving_a_non_finite_state_and_resumes_from_the_last_good_one(
    tmp_path, capsys, monkeypatch
):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run = ["--checkpoint-dir", str(ckpt), "--save-every", "2", "--keep", "2",
           "--metrics-out", str(metrics)]
    _poison_from(monkeypatch, 5)  # the update of step 5 writes nan into the parameters
    rc, _, err = _train(run + ["--steps", "8"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "step 6: the parameters hold inf or nan; not saved" in err
    assert "update of step 5" in err and "the newest checkpoint, step 4, stays" in err
    assert Checkpointer(ckpt).all_steps() == [2, 4] and _steps(metrics) == list(range(6))

    # A model of another shape, or another schedule, is refused before any step.
    for flags, expected in ((["--heads", "4"], "n_heads=2, the command's 4 (--heads)"),
                            (["--lr-schedule", "constant"], "pass --lr-schedule cosine")):
        rc, _, err = _train(run + ["--steps", "8", "--resume", *flags], capsys)
        assert rc == 2 and expected in err, err

    _poison_from(monkeypatch, 10**6)  # same optimizer state, never poisoned
    rc, out, err = _train(run + ["--steps", "10", "--resume"], capsys)
    assert rc == 0 and f"resumed from {ckpt}/4" in out, err
    assert "--steps 8 -> 10" in err  # the cosine schedule's length changed
    assert Checkpointer(ckpt).all_steps() == [8, 10] and _steps(metrics) == list(range(10))


def test_resume_compares_the_command_with_the_checkpoint_it_restores(tmp_path, capsys):
    """The newest checkpoint (recorded with another model) is corrupt: the
    resume falls back to the older one, and the command is compared with
    that one's run (another --lr: a warning), not the newest's."""
    ckpt = tmp_path / "ckpt"
    with Checkpointer(ckpt) as c:
        c.save(1, state_at(1), trainer(), {"lr": 0.5})
        c.save(2, state_at(2), trainer(), {"model": {"n_heads": 4}})
    _tamper_checksum(ckpt / "2", "params")
    with pytest.warns(UserWarning, match="do not match the checksum"):
        rc, out, err = _train(["--lr-schedule", "constant", "--checkpoint-dir", str(ckpt),
                               "--resume", "--steps", "1"], capsys)
    assert rc == 0 and f"resumed from {ckpt}/1" in out, (out, err)
    assert "--lr 0.5 -> 0.003" in err and "n_heads" not in err, err


def test_a_resume_without_a_checkpoint_warns_on_stderr(tmp_path, capsys):
    """A mistyped --checkpoint-dir under --resume starts over: said as a warning."""
    rc, out, err = _train(["--checkpoint-dir", str(tmp_path / "typo"), "--resume",
                           "--steps", "1"], capsys)
    assert rc == 0 and "summary:" in out, (out, err)
    assert (f"zeropp-train: warning: --resume: no checkpoint in {tmp_path / 'typo'} (a new "
            "directory); starting at step 0") in err


def test_cli_flags_that_cannot_work_fail_at_parsing(tmp_path, capsys):
    for argv, expected in (
        (["--lr", "inf"], "expected a finite positive number, got 'inf'"),
        (["--lr", "nan"], "expected a finite positive number, got 'nan'"),
        (["--metrics-out", str(tmp_path / "missing" / "m.jsonl")], "does not exist"),
        (["--metrics-out", str(tmp_path)], "is a directory"),
        (["--keep", "5"], "--keep needs --checkpoint-dir"),
    ):
        rc, _, err = _train(argv, capsys)
        assert rc == 2 and expected in err and "Traceback" not in err, err


@pytest.mark.slow
def test_cli_checkpoints_and_stops_on_sigterm(tmp_path, capsys, monkeypatch):
    """A preemption notice (SIGTERM, here sent during step 2's input) stops the
    run before step 3 with a checkpoint of 3 steps, which --resume continues."""
    import signal

    from zeropp_jax import distributed
    from zeropp_jax.cli import train

    local_rows = train._local_rows

    def rows(batches, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return local_rows(batches, step)

    monkeypatch.setattr(train, "_local_rows", rows)
    # Without zeropp-train's own handler this one notes the signal, and pytest lives on.
    ours = lambda *_: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, ours)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run = ["--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics), "--lr-schedule",
           "constant"]
    try:
        rc, out, err = _train(run + ["--steps", "6"], capsys)
        assert signal.getsignal(signal.SIGTERM) is ours  # put back as it was
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert rc == distributed.PREEMPTED_EXIT == 143, (out, err)
    assert f"stopped at step 3 of 6 on a preemption notice (SIGTERM); checkpoint {ckpt}/3" in err
    assert Checkpointer(ckpt).all_steps() == [3] and _steps(metrics) == [0, 1, 2]
    assert "summary:" not in out
    monkeypatch.setattr(train, "_local_rows", local_rows)
    rc, out, err = _train(run + ["--steps", "4", "--resume"], capsys)
    assert rc == 0 and f"resumed from {ckpt}/3" in out, (out, err)
    assert "compiling the step's variants for the communication report" in out
    assert _steps(metrics) == [0, 1, 2, 3]


def test_start_warnings_name_a_qgz_that_no_step_of_the_run_uses():
    from types import SimpleNamespace

    from zeropp_jax.cli import guards

    def trainer(qgz, nodes, warmup, hpz=False, local=4):
        active = qgz != "off" and nodes > 1
        return SimpleNamespace(config=SimpleNamespace(qgz=qgz, hpz=hpz), nodes=nodes,
                               local=local,
                               schedule=SimpleNamespace(active=active, warmup_steps=warmup))

    assert guards.start_warnings(trainer("1bit", 2, 100), 300) == []
    assert guards.start_warnings(trainer("off", 1, 0), 3) == []
    (hpz_one_node,) = guards.start_warnings(trainer("off", 1, 0, hpz=True), 3)
    assert hpz_one_node.startswith("one node: hpZ's per-layer gathers stay inside a node")
    (one_node,) = guards.start_warnings(trainer("1bit", 1, 100), 300)
    assert one_node.startswith("one node: qgZ (1bit) compresses only what crosses nodes")
    (short,) = guards.start_warnings(trainer("int4", 2, 100), 100)
    assert "warm-up (100 steps) is not shorter than --steps 100: no step will be" in short
    # hpZ with one device per node: the secondary is the whole model per device
    assert guards.start_warnings(trainer("off", 2, 0, hpz=True, local=4), 3) == []
    (whole,) = guards.start_warnings(trainer("off", 8, 0, hpz=True, local=1), 3)
    assert "hpZ's secondary partition" in whole and "whole model on every device" in whole


def test_divergence_rule():
    from zeropp_jax.cli.guards import diverged

    assert not diverged([5.0, 4.0, 3.0, 2.5])
    assert not diverged([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.5])  # < first
    assert diverged([5.0, 4.0, 3.0, 11.0])  # > first and > 2 x 5
    assert diverged([5.0, 4.0, float("nan")])


@pytest.mark.slow
def test_cli_finite_blow_up_is_flagged_and_exits_non_zero(capsys):
    rc, out, err = _train(["--steps", "6", "--lr", "30"], capsys)
    summary = json.loads(out.split("summary: ")[1].splitlines()[0])
    assert rc == 1 and summary["diverged"] is True and "the run diverged" in err, (out, err)


# --- zeropp-export ----------------------------------------------------------------


def test_export_refuses_a_directory_and_non_finite_parameters(tmp_path, capsys):
    from zeropp_jax.checkpoint import storage
    from zeropp_jax.checkpoint.metadata import describe_checkpoint
    from zeropp_jax.cli import export

    ckpt = Checkpointer(tmp_path / "ckpt")  # a nan state written past the guard
    storage.save_items(ckpt._manager, 1, state_at(1, nan="params"),
                       describe_checkpoint(trainer(), 1))
    ckpt.close()
    for argv, expected in (([str(tmp_path)], "is a directory"),
                           ([str(tmp_path / "p.msgpack")], "inf/nan values; not exported")):
        with pytest.raises(SystemExit) as e:
            export.main([str(tmp_path / "ckpt"), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("zeropp-export: error: "), err  # named like argparse's errors
    assert export.main([str(tmp_path / "ckpt"), str(tmp_path / "p.msgpack"), "--allow-nonfinite"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "p.msgpack"]  # no temporary file left


# --- zeropp-launch -----------------------------------------------------------------


def test_launch_refuses_a_coordinator_port_in_use(capsys):
    import socket

    from zeropp_jax.cli import launch

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = launch.main(["-n", "2", "--port", str(port), "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert rc == 2 and f"coordinator port {port} on 127.0.0.1 is in use" in err, err
    with pytest.raises(SystemExit) as exit_info:  # no TCP port, a usage error
        launch.main(["-n", "2", "--port", "70000", "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--port: expected an integer in 1..65535, got 70000" in err


def _truncate_largest_array_file(step_dir) -> None:
    """Cuts the largest data file of the step's params in half (a copy cut short)."""
    files = [os.path.join(root, name) for root, _, names in os.walk(step_dir / "params")
             for name in names if os.path.basename(root) == "d"]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)


@pytest.mark.slow
def test_a_truncated_checkpoint_is_one_line_naming_the_step_and_what_to_do(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state_at(1), trainer())
        ckpt.save(2, state_at(2), trainer())
    _truncate_largest_array_file(tmp_path / "2")
    with pytest.raises(CheckpointError) as unreadable:
        Checkpointer(tmp_path).restore(trainer(), step=2)
    message = str(unreadable.value)
    assert "\n" not in message and "TensorStore" not in message and len(message) < 400, message
    assert f"checkpoint step 2 ({tmp_path}/2): its array data cannot be read" in message
    assert "truncated or corrupted. Restore an earlier step" in message
    assert unreadable.value.__cause__ is not None  # Orbax's error, chained
    with pytest.warns(UserWarning, match=r"skipping unreadable checkpoint .*/2: checkpoint step 2"):
        assert int(Checkpointer(tmp_path).restore(trainer()).step) == 1


@pytest.mark.slow
def test_cli_checkpoints_and_stops_on_ctrl_c_and_a_second_one_stops_at_once(
    tmp_path, capsys, monkeypatch, request
):
    """One process: a first Ctrl-C (SIGINT during step 2's input) stops the run
    before step 3 with a checkpoint, exit status 130; two Ctrl-C raise
    KeyboardInterrupt at once, saving nothing; one in the last step, or while
    its checkpoint is finished, stops the run before its closing report; an
    ignored SIGINT (nohup) stays ignored."""
    import signal

    from zeropp_jax import distributed
    from zeropp_jax.cli import train

    local_rows = train._local_rows
    presses = {"n": 1, "at": 2}

    def rows(batches, step):
        if step == presses["at"]:
            for _ in range(presses["n"]):
                os.kill(os.getpid(), signal.SIGINT)
        return local_rows(batches, step)

    monkeypatch.setattr(train, "_local_rows", rows)
    # Ctrl-C as in a terminal, whatever the test runner inherited (a shell's
    # background job starts with SIGINT ignored, which the run respects).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, inherited))
    previous = signal.getsignal(signal.SIGINT)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run = ["--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics), "--lr-schedule",
           "constant"]
    rc, out, err = _train(run + ["--steps", "6"], capsys)
    assert signal.getsignal(signal.SIGINT) is previous  # put back as it was
    assert rc == distributed.INTERRUPTED_EXIT == 130, (out, err)
    assert (f"stopped at step 3 of 6 on Ctrl-C (SIGINT; a second one stops at once); "
            f"checkpoint {ckpt}/3") in err
    assert Checkpointer(ckpt).all_steps() == [3] and _steps(metrics) == [0, 1, 2]

    presses.update(n=2, at=4)
    with pytest.raises(KeyboardInterrupt):
        train.main(TRAIN + run + ["--steps", "6", "--resume"])
    assert signal.getsignal(signal.SIGINT) is previous
    assert Checkpointer(ckpt).all_steps() == [3]

    presses.update(n=1, at=5)  # in the last step: the run ends there, without its report
    rc, out, err = _train(run + ["--steps", "6", "--resume"], capsys)
    assert rc == 130 and "stopped at step 6 of 6 on Ctrl-C" in err and "summary:" not in out
    assert Checkpointer(ckpt).all_steps() == [3, 6]

    presses.update(n=0)  # while the last checkpoint is finished: the same
    close = Checkpointer.close

    def close_pressed(self):
        os.kill(os.getpid(), signal.SIGINT)
        close(self)

    monkeypatch.setattr(Checkpointer, "close", close_pressed)
    rc, out, err = _train(run + ["--steps", "7", "--resume"], capsys)
    assert rc == 130 and "stopped at step 7 of 7 on Ctrl-C" in err and "summary:" not in out
    assert Checkpointer(ckpt).all_steps() == [3, 6, 7]
    monkeypatch.setattr(Checkpointer, "close", close)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup: Ctrl-C stays ignored
    try:
        presses.update(n=1, at=1)
        rc, out, err = _train(run + ["--steps", "2", "--checkpoint-dir", str(tmp_path / "ign")],
                              capsys)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert rc == 0 and "summary:" in out, err


@pytest.mark.slow
def test_cli_resume_refuses_before_it_converts_and_names_its_flags(tmp_path, capsys, caplog):
    """A 1-bit Adam checkpoint resumed as zero3 under another --lr-schedule is
    refused for the schedule before the state is converted (no conversion
    notice); one of gradient qgZ with error feedback, resumed as 1-bit Adam,
    names the library's fields and zeropp-train's flags."""
    import warnings

    onebit, gradient = tmp_path / "onebit", tmp_path / "gradient"
    for directory, flags in ((onebit, []), (gradient, ["--qgz-target", "gradient"])):
        rc, out, err = _train(["--preset", "zeropp", "--steps", "1", "--checkpoint-dir",
                               str(directory), *flags], capsys)
        assert rc == 0, (out, err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc, _, err = _train(["--preset", "zero3", "--lr-schedule", "constant", "--resume",
                             "--checkpoint-dir", str(onebit), "--steps", "2"], capsys)
    assert rc == 2 and "pass --lr-schedule cosine" in err, err
    notices = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not any("restoring 1-bit Adam" in n for n in notices) and "restoring" not in err

    rc, _, err = _train(["--preset", "zeropp", "--resume", "--checkpoint-dir", str(gradient),
                         "--steps", "2"], capsys)
    # one error line, the last (the start warnings, on stderr too, come before it)
    lines = err.strip().splitlines()
    assert rc == 2 and [line for line in lines if "error:" in line] == lines[-1:], err
    assert "ZeroConfig(qgz_target='gradient')" in err
    assert err.strip().endswith("; with zeropp-train: pass --qgz-target gradient"), err


def test_the_reliability_benchmark_ends_with_its_json(monkeypatch, capsys):
    """benchmarks/reliability.py: a table, then one JSON line with every row, the
    seed and the provenance (with the command line); exit 1 when a probe fails."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "reliability.py"
    spec = importlib.util.spec_from_file_location("reliability_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "probes", lambda tmp, seed: iter(
        [("bad flag", "usage error", "exit 2", True), ("kill -9", "same losses", "differ", False)]))
    monkeypatch.setattr(sys, "argv", ["reliability.py", "--seed", "4"])
    assert bench.main(["--seed", "4"]) == 1
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["seed"] == 4 and result["passed"] is False
    assert [r["passed"] for r in result["rows"]] == [True, False]
    assert result["rows"][1] == {"probe": "kill -9", "expected": "same losses",
                                 "observed": "differ", "passed": False}
    assert result["provenance"]["command"] == "reliability.py --seed 4"
    # a console script by its name, other programs by the path Python was given
    from zeropp_jax import provenance

    script = os.path.join(os.path.dirname(sys.executable), "zeropp-train")
    monkeypatch.setattr(sys, "argv", [script, "--data", "my file.txt"])
    assert provenance.command_line() == "zeropp-train --data 'my file.txt'"
    monkeypatch.setattr(sys, "argv", ["benchmarks/presets.py", "--steps", "10"])
    assert provenance.command_line() == "benchmarks/presets.py --steps 10"
