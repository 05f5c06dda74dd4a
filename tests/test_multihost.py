"""Real multi-process runs: ``zeropp-launch`` simulates hosts on this machine.

Each simulated host is a process with its own CPU devices; they join one
``jax.distributed`` job (coordinator on 127.0.0.1, collectives over gloo) and
build the ``(node, local)`` mesh with one node per process. A multi-process run
must train exactly like one process holding all the devices, compile the same
collectives, and end -- never hang -- when a process is lost.

The expensive runs (each a few processes compiling and training a tiny GPT)
start together in a small thread pool as soon as the first test that needs
them runs; the cheap launcher tests that come first overlap with them. Every
subprocess has a timeout, so nothing can hang the suite.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from _util import COMM, TINY_ARGS, TRAIN, child_env
from zeropp_jax import distributed
from zeropp_jax.cli._processes import _Output

pytestmark = pytest.mark.slow  # every test here starts processes

LAUNCH = ("-m", "zeropp_jax.cli.launch")
STEPS = 10
# zeropp's qgZ warms up at full precision; compress from step 4 on, so both
# compiled step variants run (and switch) in the multi-process run.
ZEROPP_ARGS = ("--preset", "zeropp", "--qgz-warmup", "4")
# Multi-process losses differ from one process's because gloo sums in another
# order than the in-process collectives. Measured over 10 steps of the tiny
# model: zero3 <= 1e-7 relative. 1-bit gradients turn a last-bit difference
# into a sign flip now and then, which training carries on: zeropp 1e-7 to
# 1.3e-6 over seeds 0-2 and LLVM levels 0 and 2 (stop 38).
LOSS_RTOL = {"zero3": 1e-6, "zeropp": 1e-5}
# Any one subprocess; the launcher's own --timeout is a bit shorter.
RUN_TIMEOUT_S = 600
# A lost process must end the whole run within this.
LOST_PROCESS_BOUND_S = 60
# The expensive runs at once (2 cores: compiles overlap with start-up waits).
WORKERS = 3


def _env(devices: int | None = None) -> dict[str, str]:
    env = child_env(devices)
    for name in (
        distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
    ):
        env.pop(name, None)
    return env


def _run(*args, devices=None, timeout=RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=_env(devices),
        timeout=timeout,
    )


def _launch(n: int, *command: str, options=(), timeout=RUN_TIMEOUT_S):
    """``zeropp-launch -n N [options] -- python COMMAND...``."""
    return _run(
        *LAUNCH, "-n", str(n), "--timeout", str(timeout - 60), *options, "--",
        sys.executable, *command, timeout=timeout,
    )


def _ok(proc) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n"
        f"--- stderr\n{proc.stderr[-5000:]}"
    )


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _complete_lines(path) -> int:
    try:
        with open(path) as f:
            return f.read().count("\n")
    except FileNotFoundError:
        return 0


def _wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def _lines_of(stdout: str, process: int) -> list[str]:
    prefix = f"[{process}] "
    return [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]


# --- the expensive runs ------------------------------------------------------------
#
# Six multi-process runs would be too slow here, so the two fault runs double as
# equivalence runs: they train with a constant learning rate (the default cosine
# schedule depends on --steps), log STEPS steps, and only then lose process 1.


def _train_args(mesh, preset_args, metrics, steps=STEPS, constant_lr=False, extra=()):
    return (
        *TRAIN, "--mesh", mesh, *preset_args, *TINY_ARGS, "--steps", str(steps),
        "--no-progress", "--metrics-out", str(metrics),
        *(("--lr-schedule", "constant") if constant_lr else ()), *extra,
    )


def _held_out(tmp):
    """``--eval-data`` flags: 24 windows of TINY_ARGS' 17 tokens, 3 global batches
    (so the multi-process run keeps them all), every 5 steps."""
    path = tmp / "held_out.txt"
    rng = np.random.default_rng(5)
    path.write_bytes(bytes(rng.integers(32, 127, 24 * 17).astype(np.uint8)))
    return ("--eval-data", str(path), "--eval-every", "5", "--eval-rows", "24")


def _train_job(tmp, name, mesh, preset_args, processes=None, constant_lr=False, extra=()):
    """Trains STEPS steps, in `processes` processes or in one; returns (proc, metrics)."""
    metrics = tmp / f"{name}.jsonl"
    args = _train_args(mesh, preset_args, metrics, constant_lr=constant_lr, extra=extra)
    nodes, local = map(int, mesh.split("x"))
    if processes:
        proc = _launch(processes, *args, options=("--devices-per-process", str(local)))
    else:
        proc = _run(*args, devices=nodes * local)
    return proc, (_read_jsonl(metrics) if metrics.exists() else None)


def _comm_job(processes=None):
    args = (*COMM, "--json", "--mesh", "2x4", "--preset", "zeropp", *TINY_ARGS)
    if processes:
        return _launch(processes, *args, options=("--devices-per-process", "4"))
    return _run(*args, devices=8)


def _lost_process_job(tmp, name, preset_args, lose):
    """A long 2x4 run under the launcher; after STEPS logged steps, ``lose``
    process 1 (SIGKILL: a crash; SIGSTOP: a frozen host). Returns what happened."""
    metrics, out, err = tmp / f"{name}.jsonl", tmp / f"{name}.out", tmp / f"{name}.err"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(
            [sys.executable, *LAUNCH, "-n", "2", "--devices-per-process", "4",
             "--kill-grace", "5", "--", sys.executable,
             *_train_args("2x4", preset_args, metrics, steps=100_000, constant_lr=True)],
            stdout=fo, stderr=fe, env=_env(),
        )
    try:
        match = _wait_for(
            lambda: re.search(r"\[0\]=(\d+) \[1\]=(\d+)", err.read_text()), 60,
            "the launcher's pids line",
        )
        pids = int(match.group(1)), int(match.group(2))
        _wait_for(lambda: _complete_lines(metrics) >= STEPS or proc.poll() is not None,
                  RUN_TIMEOUT_S - 120, f"{STEPS} logged steps")
        assert proc.poll() is None, f"launch ended early:\n{err.read_text()[-5000:]}"
        os.kill(pids[1], lose)
        lost_at = time.monotonic()
        try:
            returncode = proc.wait(timeout=LOST_PROCESS_BOUND_S)
        except subprocess.TimeoutExpired:
            returncode = None
        elapsed = time.monotonic() - lost_at
    finally:
        if proc.poll() is None:
            proc.kill()  # its children get SIGTERM (parent-death signal)
            proc.wait()
        for pid in pids if "pids" in locals() else ():
            try:
                os.kill(pid, signal.SIGKILL)  # only if the launcher failed to
            except ProcessLookupError:
                pass
    with open(metrics) as f:
        lines = f.read().splitlines()[:STEPS]
    return dict(
        returncode=returncode, elapsed=elapsed, pids=pids, stdout=out.read_text(),
        stderr=err.read_text(), metrics=[json.loads(line) for line in lines],
    )


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Starts every expensive run in a thread pool; maps name -> future."""
    tmp = tmp_path_factory.mktemp("multihost")
    zero3 = ("--preset", "zero3")
    held_out = _held_out(tmp)  # written before the runs start
    work = {  # longest first
        "comm-mp": lambda: _comm_job(processes=2),
        "killed": lambda: _lost_process_job(tmp, "killed", ZEROPP_ARGS, signal.SIGKILL),
        "frozen": lambda: _lost_process_job(tmp, "frozen", zero3, signal.SIGSTOP),
        "zero3-4x2-mp": lambda: _train_job(tmp, "z3_4x2_mp", "4x2", zero3, processes=4,
                                           extra=held_out),
        "comm-sp": lambda: _comm_job(),
        "zeropp-2x4-sp": lambda: _train_job(tmp, "zpp_2x4_sp", "2x4", ZEROPP_ARGS, constant_lr=True),
        "zero3-2x4-sp": lambda: _train_job(tmp, "z3_2x4_sp", "2x4", zero3, constant_lr=True),
        "zero3-4x2-sp": lambda: _train_job(tmp, "z3_4x2_sp", "4x2", zero3, extra=held_out),
    }
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS)
    futures = {name: pool.submit(fn) for name, fn in work.items()}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module", autouse=True)
def _start_jobs_early(request):
    """Starts the pool with the first test of this module if any test needs it."""
    if any("jobs" in item.fixturenames for item in request.session.items
           if item.module is request.module):
        request.getfixturevalue("jobs")


def _result(jobs, name):
    return jobs[name].result(timeout=2 * RUN_TIMEOUT_S)


# --- 1. the launcher ---------------------------------------------------------------

# Process 1 fails only after process 0 has written its lines (a marker file
# says so): otherwise the launcher may rightly stop process 0 before it prints.
PY_EXIT_3_IN_1 = """
import os, pathlib, sys, time
i = os.environ['ZEROPP_PROCESS_ID']
marker = pathlib.Path(sys.argv[1])
if i == '1':
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
print('hello from', i)
print('note from', i, file=sys.stderr)
if i == '0':
    sys.stdout.flush(); sys.stderr.flush()
    marker.touch()
    time.sleep(30)  # still running when process 1 fails: the launcher stops it
sys.exit(3 if i == '1' else 0)
"""


def test_launcher_names_the_failed_process_and_its_exit_code(tmp_path):
    proc = _launch(2, "-c", PY_EXIT_3_IN_1, str(tmp_path / "printed"), timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "process 1" in proc.stderr and "exited with code 3" in proc.stderr
    assert "FAILED: process 1 exited with code 3" in proc.stderr
    # Each line carries its process's prefix, on the stream it was written to,
    # including what the stopped process wrote before it was stopped.
    assert sorted(_lines_of(proc.stdout, 0) + _lines_of(proc.stdout, 1)) == [
        "hello from 0", "hello from 1",
    ]
    assert "[0] note from 0" in proc.stderr.splitlines()
    assert "[1] note from 1" in proc.stderr.splitlines()


def test_launcher_sets_the_environment_of_each_process():
    code = (
        "import json, os; print(json.dumps({k: os.environ.get(k) for k in "
        "('ZEROPP_COORDINATOR', 'ZEROPP_NUM_PROCESSES', 'ZEROPP_PROCESS_ID', "
        "'JAX_PLATFORMS', 'XLA_FLAGS', 'PYTHONUNBUFFERED')}))"
    )
    proc = _launch(3, "-c", code, options=("--devices-per-process", "2"), timeout=120)
    _ok(proc)
    envs = [json.loads(_lines_of(proc.stdout, i)[0]) for i in range(3)]
    assert [e["ZEROPP_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
    assert {e["ZEROPP_NUM_PROCESSES"] for e in envs} == {"3"}
    coordinators = {e["ZEROPP_COORDINATOR"] for e in envs}
    assert len(coordinators) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", coordinators.pop())
    assert {e["JAX_PLATFORMS"] for e in envs} == {"cpu"}
    # The device count replaces the launcher's own; its other XLA flags pass on.
    kept = child_env()["XLA_FLAGS"]
    assert {e["XLA_FLAGS"] for e in envs} == {
        f"{kept} --xla_force_host_platform_device_count=2".strip()
    }
    assert {e["PYTHONUNBUFFERED"] for e in envs} == {"1"}


def test_launcher_devices_per_process_follows_the_mesh_flag():
    code = "import os; print(os.environ['XLA_FLAGS'])"
    proc = _launch(2, "-c", code, "--mesh", "2x3", timeout=120)
    _ok(proc)
    assert _lines_of(proc.stdout, 1) == [
        f"{child_env()['XLA_FLAGS']} --xla_force_host_platform_device_count=3".strip()
    ]


def test_launcher_stops_the_others_when_one_fails():
    code = (
        "import os, sys, time; i = os.environ['ZEROPP_PROCESS_ID']\n"
        "if i == '1': time.sleep(1); sys.exit(5)\n"
        "time.sleep(300)"
    )
    start = time.monotonic()
    proc = _launch(3, "-c", code, timeout=120)
    assert proc.returncode == 5, proc.stderr
    assert time.monotonic() - start < 60
    assert "process 1" in proc.stderr and "stopping the other 2 process(es)" in proc.stderr
    assert "[0] was killed by signal 15 (SIGTERM) (stopped by zeropp-launch)" in proc.stderr


def test_launcher_kills_a_process_that_ignores_sigterm(tmp_path):
    # Process 1 dies only once process 0 ignores SIGTERM (a marker file says so).
    code = """
import os, pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
if os.environ['ZEROPP_PROCESS_ID'] == '0':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    marker.touch()
    time.sleep(300)
deadline = time.monotonic() + 60
while not marker.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = _launch(2, "-c", code, str(tmp_path / "ignoring"),
                   options=("--kill-grace", "1"), timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "process 1" in proc.stderr and "killed by signal 9 (SIGKILL)" in proc.stderr
    assert "[0] was killed by signal 9 (SIGKILL)" in proc.stderr


def test_launcher_timeout():
    start = time.monotonic()
    proc = _run(*LAUNCH, "-n", "2", "--timeout", "2", "--", "sleep", "300", timeout=120)
    assert proc.returncode == 124
    assert "timed out after 2 s" in proc.stderr
    assert time.monotonic() - start < 60


def _signal_the_launcher(tmp_path, sig) -> tuple[int, str, list[int]]:
    """``zeropp-launch -n 2 -- sleep 300`` sent ``sig`` once it has started
    both: its exit status, its stderr and the two processes' pids."""
    err = tmp_path / "err"
    with open(err, "w") as fe:
        proc = subprocess.Popen(
            [sys.executable, *LAUNCH, "-n", "2", "--", "sleep", "300"],
            stdout=subprocess.DEVNULL, stderr=fe, env=_env(),
        )
    try:
        match = _wait_for(lambda: re.search(r"\[0\]=(\d+) \[1\]=(\d+)", err.read_text()),
                          60, "the pids line")
        proc.send_signal(sig)
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return status, err.read_text(), [int(pid) for pid in match.groups()]


def test_launcher_ctrl_c_stops_all_processes(tmp_path):
    status, err, pids = _signal_the_launcher(tmp_path, signal.SIGINT)
    assert status == 130 and "interrupted" in err, err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launcher_sigterm_stops_all_processes_and_exits_143(tmp_path):
    """A scheduler's SIGTERM to the launcher: 128 + SIGTERM, as a preempted
    run, and a line saying how each process ended."""
    status, err, _ = _signal_the_launcher(tmp_path, signal.SIGTERM)
    assert status == 128 + signal.SIGTERM, err
    assert "got SIGTERM; stopping all 2 process(es)" in err, err
    assert "stopped: [0] " in err and "[1] " in err and "(stopped by zeropp-launch)" in err


def test_launcher_prefixes_every_line_and_progress_bar_redraw():
    out, lock = io.BytesIO(), threading.Lock()
    _Output(io.BytesIO(b"start\n\rbar 1\rbar 2\r\nlast, unterminated"), out, b"[3] ", lock).thread.join(10)
    assert out.getvalue() == (
        b"[3] start\n[3] \r[3] bar 1\r[3] bar 2\r[3] \n[3] last, unterminated\n"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (("-n", "0", "--", "true"), "expected an integer >= 1, got 0"),
        (("-n", "2", "--"), "missing the command to run after '--'"),
        (("-n", "2", "true"), "missing the command to run"),
        (("--", "true"), "required: -n"),
        (("-n", "2", "--devices-per-process", "0", "--", "true"), ">= 1"),
    ],
)
def test_launcher_bad_arguments(args, message):
    proc = _run(*LAUNCH, *args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "usage: zeropp-launch" in proc.stderr


def test_uncaught_exception_in_one_process_ends_the_launch_quickly():
    """The failing process exits at once instead of waiting at JAX's
    shutdown barrier (60 s) for a peer that is blocked waiting for it."""
    code = (
        "import sys, time\n"
        "from zeropp_jax import distributed\n"
        "distributed.initialize()\n"
        "import jax\n"
        "from jax.experimental import multihost_utils\n"
        "multihost_utils.sync_global_devices('start')\n"
        "if jax.process_index() == 1:\n"
        "    print('raising', flush=True)\n"
        "    raise RuntimeError('boom')\n"
        "time.sleep(1); multihost_utils.sync_global_devices('never')\n"
    )
    start = time.monotonic()
    proc = _launch(2, "-c", code, timeout=300)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-5000:]
    assert "FAILED: process 1 exited with code 1" in proc.stderr
    assert "[1] RuntimeError: boom" in proc.stderr
    assert "process 1 of 2 failed" in proc.stderr
    assert elapsed < distributed.DEFAULT_SHUTDOWN_TIMEOUT_S, proc.stderr[-5000:]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(coordinator="127.0.0.1:1234"), "needs all of --coordinator"),
        (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=2), "must be in [0, 2)"),
        (dict(coordinator="localhost", num_processes=2, process_id=0), "HOST:PORT"),
    ],
)
def test_initialize_rejects_inconsistent_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        distributed.initialize(**kwargs)


def test_initialize_reads_the_launcher_environment(monkeypatch):
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
    monkeypatch.delenv(distributed.ENV_NUM_PROCESSES, raising=False)
    with pytest.raises(ValueError, match=distributed.ENV_NUM_PROCESSES):
        distributed.initialize()
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "1")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    assert distributed.initialize() is False  # one process: nothing to join


def test_initialize_without_a_multi_process_setting_is_a_no_op(monkeypatch):
    for name in (distributed.ENV_COORDINATOR, "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False


# --- 2. a multi-process run trains like one process with all devices -------------

# name -> (multi-process run, single-process run)
EQUIVALENT_RUNS = {
    "zeropp-2x4": ("killed", "zeropp-2x4-sp"),
    "zero3-2x4": ("frozen", "zero3-2x4-sp"),
    "zero3-4x2": ("zero3-4x2-mp", "zero3-4x2-sp"),
}


def _metrics(run):
    if isinstance(run, dict):  # a fault run: its first STEPS steps
        return run["metrics"]
    proc, metrics = run
    _ok(proc)
    return metrics


@pytest.mark.parametrize("name", list(EQUIVALENT_RUNS))
def test_multi_process_losses_match_one_process(jobs, name):
    multi, single = (_metrics(_result(jobs, run)) for run in EQUIVALENT_RUNS[name])
    assert [m["step"] for m in multi] == [m["step"] for m in single] == list(range(STEPS))
    np.testing.assert_allclose(
        [m["loss"] for m in multi], [m["loss"] for m in single],
        rtol=LOSS_RTOL[name.split("-")[0]],
    )
    assert [m["compressed"] for m in multi] == [m["compressed"] for m in single]
    if name == "zero3-4x2":  # --eval-data: each process its share of every held-out batch
        held = [[m.get("eval_loss") for m in run] for run in (multi, single)]
        assert [x is not None for x in held[0]] == [s in (4, 9) for s in range(STEPS)]
        np.testing.assert_allclose(*[[x for x in run if x is not None] for run in held],
                                   rtol=LOSS_RTOL["zero3"])
    if name.startswith("zeropp"):
        assert [m["compressed"] for m in multi] == [0] * 4 + [1] * (STEPS - 4)


def test_only_process_0_prints(jobs):
    proc, _ = _result(jobs, "zero3-4x2-mp")
    _ok(proc)
    main = [line for line in _lines_of(proc.stdout, 0)
            if line.startswith(("zeropp-train:", "summary:"))]
    # the header, the report's compile notice, the JSON summary and its bytes
    # lines (a float32 run's, then at bf16)
    assert [line.split(":")[0] for line in main] == [
        "zeropp-train", "zeropp-train", "summary", "zeropp-train", "zeropp-train"]
    assert "float32 as this run" in main[3] and "at bfloat16" in main[4]
    assert "mesh=4x2" in main[0]
    assert "compiling the step's variants for the communication report" in main[1]
    for i in (1, 2, 3):
        assert not [line for line in _lines_of(proc.stdout, i)
                    if line.startswith(("zeropp-train:", "summary:"))]
    summary = json.loads(main[2][len("summary: "):])
    assert summary["steps"] == STEPS and summary["mesh"] == "4x2"


# --- 3. the same compiled collectives -----------------------------------------------


def _comm_json(stdout: str) -> dict:
    text = "\n".join(stdout.splitlines())
    start = text.index("{")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def _collectives(report: dict) -> list[tuple]:
    return sorted(
        (c["kind"], c["dtype"], c["axis"], c["group_size"], c["count"])
        for c in report["collectives"]
    )


def test_multi_process_compiles_the_same_collectives(jobs):
    mp, sp = _result(jobs, "comm-mp"), _result(jobs, "comm-sp")
    _ok(mp)
    _ok(sp)
    multi = _comm_json("\n".join(_lines_of(mp.stdout, 0)))
    single = _comm_json(sp.stdout)
    assert multi["trainer"]["mesh"] == single["trainer"]["mesh"]
    assert set(multi["variants"]) == set(single["variants"]) == {"compressed", "full_precision"}
    for variant in single["variants"]:
        m, s = multi["variants"][variant]["report"], single["variants"][variant]["report"]
        assert _collectives(m) == _collectives(s), variant
        assert {c[2] for c in _collectives(s)} >= {"local", "node"}
        assert m["inter_node_bytes"] == s["inter_node_bytes"]
        assert m["intra_node_bytes"] == s["intra_node_bytes"]


# --- 4. a lost process ends the run ------------------------------------------------


def _assert_ended_in_time(run):
    assert run["returncode"] is not None, (
        f"the launch did not end within {LOST_PROCESS_BOUND_S} s of losing process 1:\n"
        + run["stderr"][-5000:]
    )
    assert run["returncode"] != 0
    assert run["elapsed"] < LOST_PROCESS_BOUND_S
    for pid in run["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launch_ends_when_a_process_is_killed(jobs):
    """Its sockets close: the launcher sees the exit, names it, stops the rest."""
    run = _result(jobs, "killed")
    _assert_ended_in_time(run)
    assert run["returncode"] == 128 + signal.SIGKILL
    pid1 = run["pids"][1]
    assert f"process 1 (pid {pid1}) was killed by signal 9 (SIGKILL)" in run["stderr"]
    assert "FAILED: process 1 was killed by signal 9 (SIGKILL)" in run["stderr"]


def test_launch_ends_when_a_process_hangs(jobs):
    """A frozen process (SIGSTOP) neither exits nor closes its connections:
    its heartbeat to the launcher stops, and the launcher names it as stalled
    (also when JAX's own heartbeats made process 0 give up first), then
    stops the rest."""
    run = _result(jobs, "frozen")
    _assert_ended_in_time(run)
    assert "FAILED: process 1 stalled (no heartbeat for" in run["stderr"], run["stderr"][-5000:]


def test_sigterm_checkpoints_and_stops_every_process(tmp_path):
    """A preemption notice (SIGTERM to every process, as a scheduler sends it):
    JAX's notifier catches it, the processes agree on a step, save a
    checkpoint of it, say so and exit 143 -- no step after it."""
    metrics, ckpt, err = tmp_path / "m.jsonl", tmp_path / "ckpt", tmp_path / "err"
    with open(err, "w") as fe:
        proc = subprocess.Popen(
            [sys.executable, *LAUNCH, "-n", "2", "--devices-per-process", "4",
             "--kill-grace", "30", "--", sys.executable,
             *_train_args("2x4", ("--preset", "zero3"), metrics, steps=100_000,
                          constant_lr=True), "--checkpoint-dir", str(ckpt)],
            stdout=subprocess.DEVNULL, stderr=fe, env=_env(),
        )
    try:
        match = _wait_for(lambda: re.search(r"\[0\]=(\d+) \[1\]=(\d+)", err.read_text()), 60,
                          "the launcher's pids line")
        _wait_for(lambda: _complete_lines(metrics) >= 3 or proc.poll() is not None,
                  RUN_TIMEOUT_S - 120, "3 logged steps")
        assert proc.poll() is None, f"launch ended early:\n{err.read_text()[-5000:]}"
        for pid in map(int, match.groups()):
            os.kill(pid, signal.SIGTERM)
        returncode = proc.wait(timeout=LOST_PROCESS_BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()  # its children get SIGKILL (parent-death signal)
            proc.wait()
    stderr = err.read_text()
    assert returncode == distributed.PREEMPTED_EXIT, stderr[-5000:]
    assert "exited with code 143; others: [0] exited with code 143" in stderr or (
        "exited with code 143; others: [1] exited with code 143" in stderr), stderr[-5000:]
    steps = [m["step"] for m in _read_jsonl(metrics)]
    stop = len(steps)
    assert steps == list(range(stop)) and stop >= 3
    assert os.listdir(ckpt) == [str(stop)]
    assert (f"[0] zeropp-train: stopped at step {stop} of 100000 on a preemption notice "
            f"(SIGTERM); checkpoint {ckpt}/{stop} holds it") in stderr


@pytest.mark.parametrize("commands, message", [
    ((TRAIN + ("--lr", "0.003"), TRAIN + ("--lr", "0.03")),
     "different flags: --lr (this process: 0.003; processes [1] differ"),
    ((TRAIN, COMM), "other flags: processes [1] compare other things"),
], ids=["lr", "another-tool"])
def test_processes_started_with_different_flags_are_refused_naming_the_flag(commands, message):
    """Hand-started processes (the README's "the same command on every host")
    with another --lr trained half the shards at each rate and exited 0;
    now every process compares its flags right after joining (another tool,
    with other flags, fails alike instead of aborting in gloo)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, *command, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i), "--mesh", "2x1", *TINY_ARGS,
         *(("--steps", "2", "--no-progress") if command[:2] == TRAIN else ())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(1))
        for i, command in enumerate(commands)]
    outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert message in outs[0][1], outs[0][1]
    assert "summary:" not in outs[0][0]
