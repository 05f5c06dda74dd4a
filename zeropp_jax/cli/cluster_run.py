"""Measured runs of ``zeropp-cluster-bench`` on the emulated cluster: a two-process training job, or the link probe.

:func:`run_once` starts ``zeropp-train`` as one process per network
namespace of a :class:`zeropp_jax.cli.netns.TwoNodeCluster` (``NODES`` nodes
x ``LOCAL`` CPU devices, ``jax.distributed`` coordinator on node 0's veth
address, gloo collectives over the veth), and while it trains reads each
step's time from the metrics file and both namespaces' veth counters
whenever a metrics line appears. :func:`probe_link` runs the link probe
(:mod:`zeropp_jax.cli.link_probe`) the same way.
:mod:`zeropp_jax.cli.cluster_bench` runs a training job for every preset
and rate and a probe for every rate, in every round, and
:mod:`zeropp_jax.cli.cluster_report` turns them into records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Sequence

from zeropp_jax.cli import netns
from zeropp_jax.cli._processes import _set_parent_death_signal, _stop, describe_status, process_env

NODES, LOCAL = 2, 4
# How often the metrics file and the counters are read while a run trains.
POLL_S = 0.02
# How long a stopped run's processes get to exit before they are killed.
KILL_GRACE_S = 3.0
# The link probe's large gather: this many seconds of traffic at the capped
# rate (long against a collective's fixed cost and the token bucket's
# burst), at least PROBE_MIN_BYTES; uncapped, PROBE_BYTES_UNLIMITED.
PROBE_SECONDS = 0.25
PROBE_MIN_BYTES = 1 << 20
PROBE_BYTES_UNLIMITED = 64 << 20


class RunFailed(RuntimeError):
    """One training run failed; the message ends with the tail of its log."""


def run_once(cluster: netns.TwoNodeCluster, flags: Sequence[str], *, warmup: int, steps: int,
             log_dir: str, run_id: str, port: int, timeout_s: float) -> dict:
    """Runs one two-process training job on ``cluster``; returns its measurements.

    Returns:
      ``step_times_s`` and ``compressed`` (0 or 1) of the timed steps, and
      ``link_rx_bytes``: per timed step, the bytes each node received.
    """
    metrics = os.path.join(log_dir, f"{run_id}.jsonl")
    logs = _logs(log_dir, run_id)
    procs: list[subprocess.Popen] = []
    try:
        _start(cluster, procs, ["zeropp_jax.cli.train", *flags, "--metrics-out", metrics],
               logs, port)
        return _measure(cluster, procs, metrics, logs, warmup, steps, timeout_s)
    finally:
        _stop(procs, KILL_GRACE_S)


def probe_link(cluster: netns.TwoNodeCluster, rate_mbit: float, *, log_dir: str, run_id: str,
               port: int, timeout_s: float) -> dict:
    """The payload rate the link carries at its present cap (:mod:`zeropp_jax.cli.link_probe`).

    The large probe gather moves :data:`PROBE_SECONDS` of traffic at
    ``rate_mbit`` (0: :data:`PROBE_BYTES_UNLIMITED`), at least
    :data:`PROBE_MIN_BYTES`, into each node.

    Returns:
      ``rate_mbit``, ``payload_gbits_per_s`` (per node and direction; ``None``
      when the large gather was not slower than the small one), ``fixed_ms``
      and ``bytes_per_node``.
    """
    size = PROBE_BYTES_UNLIMITED if not rate_mbit else max(
        PROBE_MIN_BYTES, int(rate_mbit * 1e6 / 8 * PROBE_SECONDS))
    logs = _logs(log_dir, run_id)
    procs: list[subprocess.Popen] = []
    try:
        _start(cluster, procs, ["zeropp_jax.cli.link_probe", "--bytes-per-node", str(size),
                                "--nodes", str(NODES), "--local", str(LOCAL)], logs, port)
        deadline = time.monotonic() + timeout_s
        while True:
            for node, p in enumerate(procs):
                if p.poll() not in (None, 0):  # the other node would wait for it
                    raise RunFailed(f"link probe: node {node} {describe_status(p.returncode)} "
                                    f"(log {logs[node]}):\n{_tail(logs[node])}")
            if all(p.poll() == 0 for p in procs):
                break
            if time.monotonic() > deadline:
                raise RunFailed(f"link probe timed out after {timeout_s:g} s "
                                f"(log {logs[0]}):\n{_tail(logs[0])}")
            time.sleep(POLL_S)
    finally:
        _stop(procs, KILL_GRACE_S)
    with open(logs[0]) as f:
        line = next((l for l in f.read().splitlines() if l.startswith("{")), None)
    if line is None:
        raise RunFailed(f"link probe printed no result (log {logs[0]}):\n{_tail(logs[0])}")
    return {"rate_mbit": rate_mbit, **json.loads(line)}


def _logs(log_dir: str, run_id: str) -> list[str]:
    """One log file per node of run ``run_id``."""
    return [os.path.join(log_dir, f"{run_id}.node{n}.log") for n in range(NODES)]


def _start(cluster, procs: list, module_args: Sequence[str], logs: Sequence[str],
           port: int) -> None:
    """Starts ``python -m MODULE ARGS`` on every node of ``cluster`` (appended to ``procs``)."""
    for node in range(NODES):
        env = process_env(
            os.environ, coordinator=f"{cluster.addresses[0]}:{port}",
            num_processes=NODES, process_id=node, devices_per_process=LOCAL,
        )
        cmd = [*cluster.exec_prefix(node), sys.executable, "-m", *module_args]
        with open(logs[node], "wb") as log:
            procs.append(subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_set_parent_death_signal,
            ))


def _measure(cluster, procs, metrics, logs, warmup, steps, timeout_s) -> dict:
    deadline = time.monotonic() + timeout_s
    rx: dict[int, list[int]] = {}  # metrics lines seen -> counters then
    lines: list[dict] = []

    def read():
        nonlocal lines
        lines = _read_lines(metrics)
        if len(lines) >= warmup and len(lines) not in rx:
            now = _rx(cluster)
            for seen in range(max(rx, default=warmup - 1) + 1, min(len(lines), steps) + 1):
                rx[seen] = now

    while steps not in rx or any(p.poll() is None for p in procs):
        if steps not in rx:
            read()
        if steps not in rx and any(p.poll() == 0 for p in procs):
            read()  # the last line may have come just before the exit
        for node, p in enumerate(procs):
            if p.poll() not in (None, 0) or (p.poll() == 0 and steps not in rx):
                status = describe_status(p.returncode)
                raise RunFailed(f"node {node} {status} (log {logs[node]}):\n{_tail(logs[node])}")
        if time.monotonic() > deadline:
            raise RunFailed(f"timed out after {timeout_s:g} s (log {logs[0]}):\n{_tail(logs[0])}")
        time.sleep(POLL_S)
    times = [line["time"] for line in lines[:steps]]
    deltas = [[(e.rx_bytes - s.rx_bytes, e.rx_frames - s.rx_frames)
               for s, e in zip(rx[k], rx[k + 1])] for k in range(warmup, steps)]
    return {
        "step_times_s": [b - a for a, b in zip(times[warmup - 1:], times[warmup:])],
        "compressed": [int(line.get("compressed", 0)) for line in lines[warmup:steps]],
        "link_rx_bytes": [[b for b, _ in step] for step in deltas],
        "link_rx_frames": [[f for _, f in step] for step in deltas],
    }


def _rx(cluster) -> list[netns.LinkCounters]:
    return [cluster.link_counters(node) for node in range(NODES)]


def _read_lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    # a line being written has no newline yet
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"
