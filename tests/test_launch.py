"""``zeropp-launch`` names a stalled or never-started process, and its processes die with it.

The fast tests launch tiny Python commands that beat with
:func:`zeropp_jax.heartbeat.start` and never join ``jax.distributed``; a
process stops itself (SIGSTOP) to stall. The slow ones run real
``jax.distributed`` processes: a peer stopped while the other waits in a
collective, a peer that never reaches ``initialize`` under the default
timeouts.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from zeropp_jax.cli import _processes

# A process that beats from the start; ``i`` is its index.
BEATING = """
import os, signal, sys, time
from zeropp_jax import heartbeat
heartbeat.start()
i = os.environ['ZEROPP_PROCESS_ID']
"""


def test_a_mesh_of_another_number_of_nodes_than_processes_is_refused_before_starting(capsys):
    """A node is one process: --mesh 2x4 under -n 3 started three processes
    of one device each, which failed with C++ aborts; -n 1 takes all 8."""
    from zeropp_jax.cli import launch

    assert launch.main(["-n", "3", "--", "zeropp-train", "--mesh", "2x4"]) == 2
    assert "--mesh 2x4 has 2 nodes but -n 3" in capsys.readouterr().err
    assert launch.devices_for_mesh(["x", "--mesh=2x4"], 1) == 8
    assert launch.devices_for_mesh(["x", "--mesh", "2x4"], 2) == 4
    assert launch.devices_for_mesh(["x", "--mesh", "two"], 2) is None
    # --devices-per-process given: a --mesh of the command's own meaning is its business
    assert launch.main(["-n", "1", "--devices-per-process", "1", "--", sys.executable, "-c",
                        "pass", "--mesh", "4x2"]) == 0


def _launch(code: str, n: int = 2, **options) -> tuple[int, str, float]:
    """Runs ``python -c code`` as ``n`` processes in this process's launcher;
    returns (exit status, the launcher's stderr, seconds)."""
    out, err = io.BytesIO(), io.BytesIO()
    start = time.monotonic()
    rc = _processes.launch([sys.executable, "-c", code], n, kill_grace_s=1, stdout=out,
                           stderr=err, timeout_s=120, **options)
    return rc, err.getvalue().decode(), time.monotonic() - start


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def test_a_stopped_process_is_named_as_stalled():
    code = BEATING + "if i == '1':\n    os.kill(os.getpid(), signal.SIGSTOP)\ntime.sleep(60)"
    rc, err, seconds = _launch(code, stall_timeout_s=2, start_timeout_s=None)
    assert rc == _processes.STALL_EXIT, err
    assert re.search(r"FAILED: process 1 stalled \(no heartbeat for [23] s\); others: "
                     r"\[0\] was killed by signal 15", err), err
    assert seconds < 30


def test_a_failure_while_a_peer_is_silent_names_the_silent_peer(monkeypatch):
    """Peers abort when JAX declares a silent process dead; the silent one is the cause."""
    monkeypatch.setattr(_processes, "STALE_EVIDENCE_S", 1.0)
    code = BEATING + ("if i == '1':\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
                      "time.sleep(3)\nsys.exit(3)")
    rc, err, _ = _launch(code, stall_timeout_s=None, start_timeout_s=None)
    assert rc == _processes.STALL_EXIT, err
    assert re.search(r"process 0 \(pid \d+\) exited with code 3 after process 1 stalled", err), err
    assert re.search(r"FAILED: process 1 stalled \(no heartbeat for \d s\); others: "
                     r"\[0\] exited with code 3$", err, re.MULTILINE), err


def test_a_process_that_never_beats_is_named_as_not_started():
    code = ("import os, time\nif os.environ['ZEROPP_PROCESS_ID'] == '0':\n"
            "    from zeropp_jax import heartbeat; heartbeat.start()\ntime.sleep(60)")
    rc, err, seconds = _launch(code, start_timeout_s=1)
    assert rc == _processes.STALL_EXIT, err
    assert re.search(r"FAILED: process 1 did not start: no heartbeat \d s after process 0's "
                     "first", err), err
    assert seconds < 30


def test_a_process_that_finished_its_work_is_not_judged(tmp_path):
    """After the interpreter that beat exits, its shell may run on without beats."""
    out, err = io.BytesIO(), io.BytesIO()
    script = tmp_path / "beat.py"
    script.write_text(BEATING)
    rc = _processes.launch(["sh", "-c", f'"{sys.executable}" {script} && sleep 2'], 1,
                           stall_timeout_s=1, stdout=out, stderr=err, timeout_s=60)
    assert rc == 0, err.getvalue().decode()


def test_killing_the_launcher_kills_its_processes(tmp_path):
    """Process 0 is ``sleep`` (the parent-death signal ends it); process 1 is
    Python under a shell, whose shell the signal ends, and Python its broken
    heartbeat pipe."""
    code = BEATING + "print('pid', os.getpid(), flush=True)\ntime.sleep(120)"
    shell = ('if [ "$ZEROPP_PROCESS_ID" = 0 ]; then exec sleep 120; fi; '
             '"$1" -c "$0"; echo unreachable')
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as fo, open(err, "w") as fe:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "zeropp_jax.cli.launch", "-n", "2", "--", "sh", "-c", shell,
             code, sys.executable], stdout=fo, stderr=fe,
        )
    try:
        deadline = time.monotonic() + 60
        while "[1] pid" not in out.read_text() and time.monotonic() < deadline:
            assert launcher.poll() is None, err.read_text()
            time.sleep(0.1)
        pids = [int(p) for p in re.findall(r"\[\d\]=(\d+)", err.read_text())]
        pids += [int(re.search(r"\[1\] pid (\d+)", out.read_text()).group(1))]
        assert len(pids) == 3 and all(map(_alive, pids)), (pids, err.read_text())
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the launcher was killed: {left}"


# --- real jax.distributed processes ------------------------------------------------------

JOINED = """
import os, signal, sys, time
from zeropp_jax import distributed
i = os.environ['ZEROPP_PROCESS_ID']
"""
ALLGATHER = """
import jax.numpy as jnp
from jax.experimental import multihost_utils
gather = lambda: multihost_utils.process_allgather(jnp.ones(2))
"""


@pytest.mark.slow
def test_a_process_stopped_while_its_peer_waits_in_a_collective_is_named():
    """The peer blocked in the gloo collective keeps beating (XLA releases the GIL)."""
    code = JOINED + "distributed.initialize()\n" + ALLGATHER + (
        "gather()\nprint('joined', flush=True)\n"
        "if i == '1':\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "while True:\n    gather()"
    )
    rc, err, _ = _launch(code, stall_timeout_s=5)
    assert rc == _processes.STALL_EXIT, err
    assert "FAILED: process 1 stalled (no heartbeat for 5 s)" in err, err


@pytest.mark.slow
def test_a_peer_that_never_starts_is_named_within_60_s():
    """Process 0 waits in ``jax.distributed.initialize`` for process 1, which
    hangs before it; the default timeouts name process 1, without a C++ stack."""
    code = JOINED + ("if i == '1':\n    time.sleep(300)\n"
                     "distributed.initialize()\nprint('joined', flush=True)")
    rc, err, seconds = _launch(code)
    assert rc == _processes.STALL_EXIT, err
    assert "FAILED: process 1 did not start" in err and seconds < 60, (seconds, err)
    assert "stack trace" not in err and "Traceback" not in err, err
