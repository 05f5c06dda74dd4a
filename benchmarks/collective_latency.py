"""What one collective costs on the simulated mesh: one process, or one process per node.

The emulated cluster (``zeropp-cluster-bench``) runs one process per node with
gloo collectives. XLA:CPU then runs every collective through gloo, also those
whose devices all live in one process (a group along ``local``), while one
process with 8 devices rendezvouses in memory. This times a chain of
all-gathers (tiled, along ``local``, ``node`` and both) of a small and a large
operand both ways, so that the fixed cost per collective that the emulation
adds to every step, and that a GPU node's NVLink does not have, is measured
rather than guessed.

Prints one JSON object on stdout (per axis and size: milliseconds per
all-gather, one process and two), progress on stderr::

  python benchmarks/collective_latency.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from zeropp_jax.cli.cluster_bench import LOCAL, NODES  # the emulated cluster's shape

AXES = {"local": "local", "node": "node", "node+local": ("node", "local")}
SIZES = (16, 65536)  # float32 elements per device: latency-bound, then 256 KiB
CHAIN = 20  # all-gathers per compiled call, each depending on the one before
CALLS = 5  # timed calls after one warm-up call


def measure() -> dict:
    """Milliseconds per all-gather in this process's view of the ``(node, local)`` mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import zeropp_jax as zp
    from zeropp_jax import distributed

    distributed.initialize()  # joins the launch's processes; nothing on a single process
    mesh = zp.make_mesh(NODES, LOCAL)
    spec = P(("node", "local"))
    out = {}
    for name, axis in AXES.items():
        for n in SIZES:
            def body(x, axis=axis):
                for _ in range(CHAIN):
                    x = jax.lax.all_gather(x, axis, tiled=True)[: x.shape[0]] * 1.0001
                return x

            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
            x = jax.device_put(jnp.ones((NODES * LOCAL * n,), jnp.float32),
                               NamedSharding(mesh, spec))
            f(x).block_until_ready()
            start = time.perf_counter()
            for _ in range(CALLS):
                f(x).block_until_ready()
            out[f"{name}/{n}"] = (time.perf_counter() - start) / CALLS / CHAIN * 1e3
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        result = measure()
        import jax

        if jax.process_index() == 0:
            print(json.dumps(result), flush=True)
        return 0
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    one = _run("one process", [sys.executable, __file__, "--worker"],
               dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={NODES * LOCAL}"))
    two = _run("two processes (gloo)",
               [sys.executable, "-m", "zeropp_jax.cli.launch", "-n", str(NODES),
                "--devices-per-process", str(LOCAL), "--", sys.executable, __file__, "--worker"],
               env)
    # zeropp-launch prefixes each line with the process index.
    line = next(l for l in two.stdout.splitlines() if l.startswith("[0] {"))
    single, multi = json.loads(one.stdout.strip().splitlines()[-1]), json.loads(line[4:])
    from zeropp_jax import provenance

    print(json.dumps({
        "what": "milliseconds per tiled all-gather of SIZE float32 elements per device, "
                f"chains of {CHAIN}, mean of {CALLS} calls",
        "mesh": f"{NODES}x{LOCAL}",
        "rows": [{"axis": k.split("/")[0], "elements_per_device": int(k.split("/")[1]),
                  "one_process_ms": round(single[k], 3),
                  "process_per_node_gloo_ms": round(multi[k], 3)} for k in single],
        # the timed devices are the workers' (mesh above), not this launcher's
        "provenance": provenance.record(devices=False),
    }))
    return 0


def _run(what: str, cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """Runs one measurement; a failed one exits with its stderr shown."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"collective_latency: the {what} run failed (exit {done.returncode}):\n"
                 f"{done.stderr}")
    print(f"collective_latency: {what} done", file=sys.stderr, flush=True)
    return done


if __name__ == "__main__":
    sys.exit(main())
