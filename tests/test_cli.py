"""End-to-end tests of the console scripts ``zeropp-train`` and ``zeropp-comm``.

Each training run is a fresh subprocess (``python -m zeropp_jax.cli.<name>``): the CLI
fixes the simulated host device count from ``--mesh`` before JAX starts, which
cannot happen inside this pytest process (conftest already fixed 8 devices).
Runs that several assertions share are module-scoped fixtures. Rejected
flags are checked by calling ``main`` in this process (they stop before any
compilation, and the one that depends on the device count expects conftest's
8), and two of them again through the script.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import tempfile
import threading
import time

import numpy as np
import pytest

from _util import COMM, TINY_ARGS, TRAIN, read_jsonl, run_cli

pytestmark = pytest.mark.slow  # the console scripts run as subprocesses

EQUIVALENCE_STEPS = 20
DEFAULT_MODEL_STEPS = 30
# Argument checks need no compilation; interpreter and JAX start-up are
# allowed, a compiled train step is not (no metrics, no summary, checked too).
# On CI's 2 loaded cores start-up alone took 21 s once (stop 31), so the bound
# is generous: a wall-clock limit only backs up those checks.
QUICK_FAILURE_S = 45.0


def _ok(proc) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )


def _summary(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1, f"expected one summary line in:\n{stdout}"
    return json.loads(lines[0][len("summary: "):])


def _header(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("zeropp-train: preset=")]
    assert len(lines) == 1, f"expected one header line in:\n{stdout}"
    return lines[0]


def _train(tmp_dir, name, *args, env_devices=None, default_codegen=False):
    """Runs zeropp-train; returns (process, per-step metrics or None)."""
    metrics = tmp_dir / f"{name}.jsonl"
    proc = run_cli(
        *TRAIN, "--no-progress", "--metrics-out", str(metrics), *args,
        env_devices=env_devices, default_codegen=default_codegen,
    )
    return proc, (read_jsonl(metrics) if metrics.exists() else None)


# --- 1. the mesh shape does not change the losses ---------------------------


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh_runs")
    runs = {}
    for mesh in ("1x1", "2x4", "1x8"):
        runs[mesh] = _train(
            tmp, mesh, *TINY_ARGS, "--mesh", mesh, "--preset", "zero3",
            "--steps", str(EQUIVALENCE_STEPS),
        )
    return runs


@pytest.mark.parametrize("mesh", ["1x1", "2x4", "1x8"])
def test_train_runs_and_writes_one_metrics_line_per_step(mesh_runs, mesh):
    proc, metrics = mesh_runs[mesh]
    _ok(proc)
    assert f"mesh={mesh}" in _header(proc.stdout)
    assert [m["step"] for m in metrics] == list(range(EQUIVALENCE_STEPS))
    assert all(math.isfinite(m["loss"]) for m in metrics)


@pytest.mark.parametrize("mesh", ["2x4", "1x8"])
def test_sharded_losses_match_single_device(mesh_runs, mesh):
    _, reference = mesh_runs["1x1"]
    _, sharded = mesh_runs[mesh]
    np.testing.assert_allclose(
        [m["loss"] for m in sharded], [m["loss"] for m in reference], rtol=1e-5
    )


@pytest.mark.parametrize("mesh", ["1x1", "2x4", "1x8"])
def test_summary_line_reports_first_and_final_loss(mesh_runs, mesh):
    proc, metrics = mesh_runs[mesh]
    summary = _summary(proc.stdout)
    assert summary["preset"] == "zero3"
    assert summary["mesh"] == mesh
    assert summary["steps"] == EQUIVALENCE_STEPS
    assert summary["first_loss"] == pytest.approx(metrics[0]["loss"], rel=1e-7)
    assert summary["final_loss"] == pytest.approx(metrics[-1]["loss"], rel=1e-7)
    assert summary["final_loss"] < summary["first_loss"]
    # where it came from: every flag, the code's commit (None outside a checkout), the machine
    assert summary["flags"]["preset"] == "zero3" and summary["flags"]["mesh"] == mesh
    assert {"git", "host", "jax", "date", "devices"} <= set(summary["provenance"])
    assert "cli/train.py --no-progress --metrics-out" in summary["provenance"]["command"]


# --- 2. the default model learns the default data ---------------------------


def test_default_model_loss_falls(tmp_path):
    """The Quickstart's job, shortened, compiled as a user's is (XLA's default
    code generation: 30 steps of the default model are bound by run time)."""
    proc, metrics = _train(
        tmp_path, "default", "--steps", str(DEFAULT_MODEL_STEPS), default_codegen=True
    )
    _ok(proc)
    header = _header(proc.stdout)
    assert "mesh=2x4" in header  # the simulated default on a CPU-only host
    assert "vocab=256" in header
    # the zeropp preset's 100-step warm-up outlasts this run, and it says so
    assert (f"warm-up (100 steps) is not shorter than --steps {DEFAULT_MODEL_STEPS}: no step "
            "will be compressed") in proc.stderr
    losses = np.array([m["loss"] for m in metrics])
    assert len(losses) == DEFAULT_MODEL_STEPS
    # 1-bit Adam's count of updates held at Adam's bound: none in a warm-up
    assert [m["bounded"] for m in metrics] == [0] * DEFAULT_MODEL_STEPS
    assert _summary(proc.stdout)["bounded"] == {"steps": 0, "coordinates": 0}
    # Byte tokens start near ln(256) = 5.55 nats.
    assert abs(losses[0] - math.log(256)) < 0.5, losses[0]
    drop = losses[0] - losses[-10:].mean()
    assert drop >= 1.5, f"loss fell only {drop:.3f} nats: {losses.round(3).tolist()}"


# --- 3. bad input fails fast with a clear message ---------------------------


def _error_lines(stderr: str) -> str:
    """The ``error:`` lines (argparse also prints a usage block with digits)."""
    return "\n".join(line for line in stderr.splitlines() if "error:" in line)


BAD_INPUTS = {
    # 8 devices forced through XLA_FLAGS, so 3x3 cannot be derived from --mesh.
    "mesh_3x3_on_8_devices": (("--mesh", "3x3"), 8, [r"\b9\b", r"\b8\b", "3x3"]),
    "batch_not_divisible": (
        ("--mesh", "2x4", "--batch-size", "12"), None, [r"\b12\b", r"\b8\b", "batch"]
    ),
    "batch_not_divisible_by_micro_batches": (
        ("--mesh", "2x4", "--batch-size", "8", "--grad-accum", "2"), None,
        [r"--batch-size 8", r"8 x 2 = 16"]
    ),
    "unknown_preset": (("--preset", "zero4"), None, ["zero4", "preset"]),
    "zero_steps": (("--steps", "0"), None, ["--steps", r"\b0\b"]),
    "negative_layers": (("--layers", "-1"), None, ["--layers", "-1"]),
    "heads_do_not_divide_width": (
        ("--d-model", "30", "--heads", "4"), None, [r"\b30\b", r"\b4\b", "heads"]
    ),
    "missing_data": (("--data", "/nonexistent"), None, ["/nonexistent"]),
    "empty_data": (("--data", "{empty}"), None, ["{empty}", "empty"]),
    "malformed_mesh": (("--mesh", "banana"), None, ["banana", "NODESxLOCAL"]),
    # ZeroConfig's own checks, reached through its generated flags.
    "unknown_dtype": (("--dtype", "fp64"), None, ["--dtype must be one of", "fp64", "or auto"]),
    "dither_with_error_feedback": (
        ("--preset", "zeropp", "--qgz-code", "dither"), None, ["dither", "error feedback"]
    ),
    "refresh_every_step": (
        ("--preset", "zeropp", "--qgz-refresh-every", "1"), None,
        ["qgz_refresh_every=1", "no step would be compressed", "2 or more"],
    ),
    "infinite_gate": (
        ("--preset", "qgz", "--qgz-target", "gradient", "--qgz-min-grad-rms", "inf"), None,
        ["--qgz-min-grad-rms", "finite number >= 0", "'inf'"],
    ),
    "negative_seed": (("--seed", "-1"), None, ["--seed", "integer from 0", "-1"]),
    "seed_beyond_uint32": (("--seed", str(2**32)), None, ["--seed", r"2\*\*32 - 1", str(2**32)]),
    "lr_warmup_outlasts_the_run": (("--lr-warmup", "3"), None, ["--lr-warmup 3", "--steps 3"]),
    "data_shorter_than_a_window": (("--data", "{short}"), None, ["--seq-len 16", "17 tokens"]),
    "metrics_out_is_the_data": (("--data", "{short}", "--metrics-out", "{short}"), None,
                                ["is the --data file"]),
    "metrics_out_links_to_the_data": (("--data", "{short}", "--metrics-out", "{link}"), None,
                                      ["is the --data file"]),
    "not_an_integer": (("--qgz-warmup", "abc"), None, ["--qgz-warmup", "'abc'"]),
    # XLA:CPU cannot compile the GPT's float16 logits (a GPU can)
    "fp16_on_cpu": (("--dtype", "fp16"), None, ["--dtype fp16 does not run on a CPU", "bf16"]),
    # Multi-host flags: a usage error naming the flag, not a traceback.
    "coordinator_without_port": (
        ("--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"), None,
        ["--coordinator", "localhost", "HOST:PORT"],
    ),
    "process_id_out_of_range": (
        ("--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "5"),
        None, ["--process-id", r"\b5\b", r"\[0, 2\)"],
    ),
    "two_of_three_multihost_flags": (
        ("--coordinator", "localhost:1234", "--num-processes", "2"), None,
        ["--process-id", "missing"],
    ),
}


def _bad_args(case, tmp_path):
    """The case's flags after the tiny model's (so they override), and its needles."""
    args, env_devices, needles = BAD_INPUTS[case]
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_bytes(b"")
    short.write_bytes(b"ten bytes.")
    (tmp_path / "link.txt").symlink_to(short)
    args = [a.replace("{empty}", str(empty)).replace("{short}", str(short))
            .replace("{link}", str(tmp_path / "link.txt")) for a in args]
    needles = [n.replace("{empty}", re.escape(str(empty))) for n in needles]
    metrics = tmp_path / f"{case}.jsonl"
    argv = ["--no-progress", "--metrics-out", str(metrics), *TINY_ARGS, "--steps", "3", *args]
    return argv, env_devices, needles, metrics


def _assert_rejected(argv, needles, stdout, stderr, metrics):
    message = _error_lines(stderr)
    assert message, f"no error line in stderr:\n{stderr}"
    for needle in needles:
        assert re.search(needle, message), f"{needle!r} not in {message!r}"
    assert "zeropp-train: " not in stdout, f"accepted {argv}"
    assert "summary:" not in stdout
    assert not metrics.exists() or not read_jsonl(metrics)  # no step ran


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_before_compiling(tmp_path, case, capsys):
    """``zeropp-train``'s ``main`` in this process (its 8 devices are the forced 8)."""
    from zeropp_jax.cli import train

    argv, _, needles, metrics = _bad_args(case, tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    out = capsys.readouterr()
    _assert_rejected(argv, needles, out.out, out.err, metrics)


@pytest.mark.parametrize("value, needles", [
    ("two", [r"ZEROPP_NUM_PROCESSES", "integer", "'two'"]),
    ("2", [r"ZEROPP_PROCESS_ID", "missing"]),
])
def test_bad_launcher_environment_is_a_usage_error(tmp_path, capsys, monkeypatch, value, needles):
    from zeropp_jax import distributed
    from zeropp_jax.cli import train

    monkeypatch.setenv(distributed.ENV_COORDINATOR, "localhost:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, value)
    monkeypatch.delenv(distributed.ENV_PROCESS_ID, raising=False)
    metrics = tmp_path / "m.jsonl"
    argv = ["--no-progress", "--metrics-out", str(metrics), *TINY_ARGS, "--steps", "3"]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    out = capsys.readouterr()
    _assert_rejected(argv, needles, out.out, out.err, metrics)


@pytest.mark.parametrize("flags", [
    ("--coordinator", "127.0.0.1:29999", "--num-processes", "2", "--process-id", "0"),
    ("--process-id", "0"),  # the message names only the flags given
])
def test_multihost_flags_under_the_launcher_are_a_usage_error(tmp_path, capsys, monkeypatch,
                                                              flags):
    """A cluster command reused under zeropp-launch: its flags would give every
    process the same --process-id; refused, naming both."""
    from zeropp_jax import distributed
    from zeropp_jax.cli import train

    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
    metrics = tmp_path / "m.jsonl"
    argv = ["--no-progress", "--metrics-out", str(metrics), *TINY_ARGS, "--steps", "3", *flags]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    out = capsys.readouterr()
    _assert_rejected(argv, ["process 1 of 2", f"passes {' '.join(flags)}, one value",
                            "leave those flags out"], out.out, out.err, metrics)


@pytest.mark.slow
def test_a_cluster_environment_jax_cannot_read_is_named(tmp_path, monkeypatch):
    """SLURM_NTASKS=2 outside srun (e.g. in an salloc shell): an error naming
    the variable and the flags to give, not JAX's traceback."""
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    proc = run_cli(*TRAIN, "--no-progress", *TINY_ARGS, "--steps", "1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("zeropp-train: error: the environment says this is one of several processes "
            "(SLURM_NTASKS=2)") in proc.stderr and "--process-id" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["unknown_dtype", "mesh_3x3_on_8_devices"])
def test_console_script_rejects_bad_input_quickly(tmp_path, case):
    """The same through the script in its own process: a flag rejected while
    parsing, before any device is used, and a mesh rejected once they are known.
    """
    argv, env_devices, needles, metrics = _bad_args(case, tmp_path)
    start = time.perf_counter()
    proc = run_cli(*TRAIN, *argv, env_devices=env_devices)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    _assert_rejected(argv, needles, proc.stdout, proc.stderr, metrics)
    assert elapsed < QUICK_FAILURE_S, f"took {elapsed:.1f}s to reject {argv}"


def test_zero_flags_build_the_config_of_their_fields():
    """The ZeRO flags are generated from ZeroConfig's fields (cli/common.py)."""
    import dataclasses

    from zeropp_jax.cli import common, train
    from zeropp_jax.config import ZeroConfig

    parser = train.build_parser()
    args = parser.parse_args([
        "--preset", "zeropp", "--dtype", "bf16", "--qwz-bits", "4", "--no-hpz",
        "--qgz-block", "64", "--qgz-warmup", "7", "--grad-accum", "2",
        "--scale-dtype", "bfloat16", "--implementation", "xla", "--seed", "3",
    ])
    assert common.build_config(args) == ZeroConfig.from_preset(
        "zeropp", compute_dtype="bf16", qwz_bits=4, hpz=False, qgz_block=64,
        qgz_warmup_steps=7, grad_accum=2, scale_dtype="bfloat16", implementation="xla",
        qgz_seed=3,
    )
    # Flags left out keep the preset's values; --dtype auto is compute_dtype=None.
    assert common.build_config(parser.parse_args(["--preset", "qgz"])) == (
        ZeroConfig.from_preset("qgz")
    )
    helps = {a.dest: a.help for a in parser._actions}
    for f in dataclasses.fields(ZeroConfig):
        if f.metadata["flag"] is not None:
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            assert helps[flag[2:].replace("-", "_")] == f.metadata["help"], f.name


def test_flags_of_a_feature_that_is_off_are_named_as_having_no_effect():
    """``--preset zero3 --qgz-warmup 100`` changes nothing: a warning says so,
    naming the switch that is off; flags of features that are on pass quietly."""
    from zeropp_jax.cli import common, train

    parser = train.build_parser()
    args = parser.parse_args([
        "--preset", "zero3", "--qwz-block", "512", "--qgz-warmup", "100",
        "--no-qgz-error-feedback", "--scale-dtype", "bfloat16", "--grad-accum", "2",
    ])
    assert common.idle_flag_warnings(parser, args) == [
        "--qwz-block 512 has no effect: qwZ is off (qwz_bits=0)",
        "--no-qgz-error-feedback has no effect: qgZ is off (qgz='off')",
        "--qgz-warmup 100 has no effect: qgZ is off (qgz='off')",
        "--scale-dtype bfloat16 has no effect: nothing is quantized (qwZ and qgZ are off)",
    ]
    on = parser.parse_args(["--preset", "zeropp", "--qwz-block", "512", "--qgz-warmup", "5",
                            "--scale-dtype", "float32", "--hpz-secondary", "quantized"])
    assert common.idle_flag_warnings(parser, on) == []
    # a preset's own fields for a feature switched off are not the user's flags
    assert common.idle_flag_warnings(
        parser, parser.parse_args(["--preset", "zeropp", "--qgz", "off"])) == []
    off = parser.parse_args(["--preset", "qwz", "--hpz-secondary", "decoded", "--qgz-block", "64",
                             "--qgz-target", "gradient"])
    assert [w.split(":")[0] for w in common.idle_flag_warnings(parser, off)] == [
        "--hpz-secondary decoded has no effect", "--qgz-target gradient has no effect",
        "--qgz-block 64 has no effect",
    ]


def test_simulate_says_its_dtype_changes_no_prediction():
    """zeropp-simulate counts float payloads at --float-bytes, so a --dtype given
    is named as changing nothing (help and a warning), not silently ignored."""
    from zeropp_jax.cli import simulate

    parser = simulate.build_parser()
    assert simulate.dtype_warnings(parser, parser.parse_args([])) == []
    (warning,) = simulate.dtype_warnings(parser, parser.parse_args(["--dtype", "fp32"]))
    assert warning.startswith("no prediction depends on it") and "--dtype fp32" in warning
    assert "no prediction depends on it" in " ".join(parser.format_help().split())
    # a block of a feature that is off leaves the step zero3's: profiled once
    zero3 = simulate.preset_config(parser.parse_args([]), "zero3")
    assert simulate._same_step(zero3.replace(qwz_block=512, scale_dtype="bfloat16"), zero3)
    assert not simulate._same_step(zero3.replace(qwz_bits=8), zero3)


def test_lr_warmup_applies_to_the_constant_schedule():
    """--lr-warmup with --lr-schedule constant: linear warm-up, then --lr
    (optax Adam's first updates; 1-bit Adam's rate per step)."""
    import jax.numpy as jnp

    from zeropp_jax.cli.common import make_optimizer

    def first_updates(warmup, steps=3):
        opt = make_optimizer(1.0, schedule="constant", total_steps=100, warmup=warmup)
        params = {"w": jnp.ones(4)}
        state, out = opt.init(params), []
        for _ in range(steps):
            updates, state = opt.update({"w": jnp.full(4, 0.1)}, state, params)
            out.append(float(updates["w"][0]))
        return out

    warm = first_updates(50)
    assert warm[0] == 0.0 and -0.05 < warm[2] < 0  # lr 0, then 2/50 of the peak
    assert first_updates(None)[0] == pytest.approx(-1.0, rel=1e-3)  # no warm-up asked
    onebit = make_optimizer(1.0, schedule="constant", total_steps=100, warmup=50,
                            qgz_target="momentum")
    rates = [float(onebit.lr_at(jnp.asarray(c))) for c in (0, 25, 50, 80)]
    assert rates == pytest.approx([0.0, 0.5, 1.0, 1.0])


def test_device_count_follows_mesh_when_not_forced(tmp_path):
    """Without a device count in XLA_FLAGS the CLI asks XLA for NODES*LOCAL host devices.

    Plain ZeRO-3 (one compiled step): the device count is the point here.
    """
    proc, metrics = _train(
        tmp_path, "3x3", *TINY_ARGS, "--mesh", "3x3", "--batch-size", "9", "--steps", "2",
        "--preset", "zero3",
    )
    _ok(proc)
    assert "mesh=3x3" in _header(proc.stdout)
    assert len(metrics) == 2


# --- 4. zeropp-comm ---------------------------------------------------------


@pytest.fixture(scope="module")
def comm_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comm")
    hlo = tmp / "zero3.hlo"
    base = (*COMM, *TINY_ARGS, "--mesh", "2x4")
    return {
        "zero3": run_cli(*base, "--preset", "zero3", "--json", "--dump-hlo", str(hlo)),
        "zeropp": run_cli(*base, "--preset", "zeropp", "--json"),
        "table": run_cli(*base, "--preset", "zero3"),
        "hlo_path": hlo,
    }


@pytest.mark.parametrize("where, expected", [
    ("missing/x.hlo", "--dump-hlo .*missing/x.hlo: the directory .* does not exist"),
    (".", "--dump-hlo .* is a directory; give a file name"),
])
def test_comm_refuses_an_unwritable_dump_hlo_before_compiling(tmp_path, capsys, where, expected):
    from zeropp_jax.cli import comm

    with pytest.raises(SystemExit) as exit_info:
        comm.main([*TINY_ARGS, "--mesh", "2x4", "--dump-hlo", str(tmp_path / where)])
    out = capsys.readouterr()
    assert exit_info.value.code == 2 and re.search(expected, _error_lines(out.err)), out.err
    assert not out.out  # no report: nothing was compiled


def _comm_json(proc) -> dict:
    _ok(proc)
    return json.loads(proc.stdout)


def test_comm_json_zero3_crosses_nodes(comm_runs):
    result = _comm_json(comm_runs["zero3"])
    assert result["inter_node_bytes"] > 0
    assert result["intra_node_bytes"] > 0
    assert result["trainer"]["config"]["preset"] == "zero3"
    assert set(result["variants"]) == {"step"}  # no qgZ: one compiled variant


def test_comm_json_zeropp_cuts_inter_node_bytes(comm_runs):
    zero3 = _comm_json(comm_runs["zero3"])
    zeropp = _comm_json(comm_runs["zeropp"])
    assert zeropp["trainer"]["config"]["preset"] == "zeropp"
    assert zeropp["schedule_inter_node_bytes"] == zeropp["schedule"]["inter_node_bytes"]
    assert 0 < zeropp["inter_node_bytes"] <= zero3["inter_node_bytes"] / 5, (
        zeropp["inter_node_bytes"], zero3["inter_node_bytes"]
    )
    # 1-bit Adam's refresh steps (every 40th) included: the mean per step
    assert zeropp["refresh_every"] == 40
    assert zeropp["inter_node_bytes"] < zeropp["cycle_inter_node_bytes"] <= zero3["inter_node_bytes"] / 5
    # Same model in both reports.
    assert zeropp["model"]["params"] == zero3["model"]["params"]


def test_comm_dump_hlo(comm_runs):
    _ok(comm_runs["zero3"])
    text = comm_runs["hlo_path"].read_text()
    assert "HloModule" in text
    assert "all-gather" in text


def test_comm_table(comm_runs):
    proc = comm_runs["table"]
    _ok(proc)
    assert proc.stdout.startswith("zeropp-comm: preset=zero3 mesh=2x4")
    assert "inter" in proc.stdout
    assert "memory" in proc.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(proc.stdout)


# --- 5. --data: a text file and a .npy of token ids -------------------------

# The data are the point: plain ZeRO-3 on the default 2x4 mesh, the program
# mesh_runs compiled for byte tokens (a text file's run loads it from the
# compilation cache instead of compiling it again).
DATA_RUN_ARGS = ("--preset", "zero3")


def _text(n_bytes: int) -> str:
    words = (
        "the quick brown fox jumps over a lazy dog while sharded parameters "
        "are gathered layer by layer and gradients are reduced across nodes"
    ).split()
    rng = np.random.default_rng(0)
    out, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choice(words, size=12)) + ".\n"
        out.append(line)
        size += len(line)
    return "".join(out)


def test_train_on_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(_text(4096))
    proc, metrics = _train(
        tmp_path, "text", *TINY_ARGS, *DATA_RUN_ARGS, "--data", str(path), "--steps", "3"
    )
    _ok(proc)
    header = _header(proc.stdout)
    assert "vocab=256" in header  # bytes
    assert f"tokens={path.stat().st_size:,}" in header
    assert "mesh=2x4" in header
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert _summary(proc.stdout)["steps"] == 3


def test_train_on_npy_token_ids(tmp_path):
    vocab = 50
    ids = np.random.default_rng(0).integers(0, vocab, size=5000).astype(np.int32)
    ids[0] = vocab - 1  # the vocabulary is max id + 1
    path = tmp_path / "ids.npy"
    np.save(path, ids)
    proc, metrics = _train(
        tmp_path, "npy", *TINY_ARGS, *DATA_RUN_ARGS, "--data", str(path), "--steps", "3"
    )
    _ok(proc)
    header = _header(proc.stdout)
    assert f"vocab={vocab}" in header
    assert "tokens=5,000" in header
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # An untrained model predicts near-uniformly over the 50 ids, not 256.
    assert abs(metrics[0]["loss"] - math.log(vocab)) < 0.3, metrics[0]["loss"]
    assert _summary(proc.stdout)["steps"] == 3


# --- 5. zeropp-simulate's flags (in this process; nothing compiles) ----------


@pytest.mark.parametrize("flags, shown", [
    (["--no-prefetch"], "--no-prefetch"),
    (["--hierarchical"], "--hierarchical"),
    (["--keep-activations"], "--keep-activations"),
    (["--implementation", "xla"], "--implementation"),
    (["--qgz-share", "gather"], "--qgz-share"),  # checked before ZeroConfig's own checks
    (["--node-replicated"], "--node-replicated"),
])
def test_simulate_published_refuses_every_config_flag_it_ignores(flags, shown, capsys):
    from zeropp_jax.cli import simulate

    with pytest.raises(SystemExit) as exit_info:
        simulate.main(["--published", *flags])
    err = _error_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2 and f"drop {shown}," in err and "qgz_target" not in err, err


def test_comm_refuses_training_flags_and_hides_them(capsys):
    from zeropp_jax.cli import comm

    with pytest.raises(SystemExit) as exit_info:
        comm.main(["--seed", "3", "--lr-warmup", "5"])
    err = _error_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2 and "--lr-warmup, --seed set the training run" in err, err
    assert "--lr-schedule" not in comm.build_parser().format_help()


def test_simulate_refuses_training_flags_and_uses_the_vocabulary_of_data(
    tmp_path, capsys, monkeypatch
):
    from zeropp_jax.analysis import cost_model
    from zeropp_jax.cli import simulate

    with pytest.raises(SystemExit) as exit_info:
        simulate.main(["--lr", "0.1", "--lr-schedule", "constant"])
    err = _error_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2 and "--lr, --lr-schedule set the training run" in err, err

    ids = np.arange(64, dtype=np.int32)
    ids[0] = 999  # vocabulary 1000
    np.save(tmp_path / "ids.npy", ids)
    seen = []

    def profile_config(config, *, model, **kwargs):
        seen.append(model.vocab_size)
        raise ValueError("profiled")  # stop before compiling

    monkeypatch.setattr(cost_model, "profile_config", profile_config)
    with pytest.raises(SystemExit):
        simulate.main([*TINY_ARGS, "--data", str(tmp_path / "ids.npy")])
    assert seen == [1000] and "profiled" in capsys.readouterr().err


def test_simulate_runs_zeropp_by_default_and_shows_the_baseline_once(capsys, monkeypatch):
    """Without --preset the target is zeropp, beside zero3; with --preset zero3
    the target is the baseline, profiled and shown once. (The profiles are
    stand-ins without collectives: what is compiled is not at stake here.)"""
    from zeropp_jax.analysis import cost_model
    from zeropp_jax.analysis.comm_profile import CommProfile
    from zeropp_jax.cli import simulate

    profiled = []

    def profile_config(config, *, label, mesh, **kwargs):
        profiled.append((config.preset, label))
        return CommProfile(label=label, mesh_shape=mesh.devices.shape, params=10**4,
                           collectives=())

    monkeypatch.setattr(cost_model, "profile_config", profile_config)
    assert simulate.main([*TINY_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["label"] for p in out["predictions"]] == ["zero3", "zeropp"]
    assert simulate.main([*TINY_ARGS, "--preset", "zero3", "--sweep-gbps", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert profiled == [("zero3", "zero3"), ("zeropp", "zeropp"), ("zero3", "zero3")]
    rows = [line.split()[0] for line in lines if re.match(r"zero\S*\s+[\d.]+\s", line)]
    assert rows == ["zero3"], lines
    assert "zero3 is averaged over every step (no qgZ schedule)." in lines


def test_output_files_are_written_through_links_and_into_streams(tmp_path):
    """A metrics file or export given as a symlink replaces the link's target
    (the link stays); a named pipe or a device is written as a stream, never
    renamed over (a reader of the pipe would wait forever)."""
    from zeropp_jax import files
    from zeropp_jax.cli import guards

    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    target.write_text('{"step": 0}\n{"step": 1}\n')
    link.symlink_to(target)
    guards.rewrite_metrics(str(link), 1)  # a resume at step 1 keeps step 0's line
    assert link.is_symlink() and target.read_text() == '{"step": 0}\n'
    files.write_file(link, b"exported")
    assert link.is_symlink() and target.read_bytes() == b"exported"

    fifo, received = tmp_path / "fifo", []
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    files.write_file(fifo, b"through the pipe")
    reader.join(timeout=30)
    assert received == [b"through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    guards.rewrite_metrics(str(fifo), 3)  # nothing to keep: not opened (it would block)
    assert files.output_problem("--metrics-out", str(fifo)) is None
    # /dev/stdout of a run redirected to a file names that file: written into
    # (a rename would have left the shell's file deleted and everything lost)
    with open(tmp_path / "run.log", "wb") as log:
        alias, inode = f"/proc/self/fd/{log.fileno()}", os.fstat(log.fileno()).st_ino
        assert files.is_stream(alias)
        files.write_file(alias, b"metrics")
    assert (tmp_path / "run.log").read_bytes() == b"metrics"
    assert os.stat(tmp_path / "run.log").st_ino == inode
    if os.path.isdir("/dev/shm"):  # an ordinary file under /dev: replaced atomically
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as shm:
            assert not files.is_stream(shm.name)
    target.chmod(0o600)  # a replaced file keeps its permissions
    files.write_file(link, b"again")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert files.output_problem("--metrics-out", os.devnull) is None
    assert files.output_problem("--metrics-out", str(tmp_path)).endswith("give a file name")
    assert "is the --data file" in files.output_problem("--dump-hlo", str(link),
                                                        {"--data": str(target)})
