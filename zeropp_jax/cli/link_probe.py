"""The probe collective of ``zeropp-cluster-bench``: what the emulated link carries per second.

The cost model's step time at a link rate needs the rate the training step's
collectives get, not the figure given to ``tc``: every frame carries
Ethernet, IP and TCP headers, gloo adds messages of its own, and the
unlimited veth is fast but finite. This module is the program that measures
it, run like a training job (one process per network namespace, ``LOCAL``
CPU devices each, gloo collectives over the veth;
:func:`zeropp_jax.cli.cluster_run.probe_link` starts it).

It times chains of tiled all-gathers of ``uint8`` along ``node``, the
collective a two-level step crosses the link with (one device per node in
each of ``LOCAL`` groups), at a small and a large payload. The payload rate
per node is the difference of the bytes a node takes in over the difference
of the times, so each collective's fixed cost (which a step's unlimited-rate
time already holds) is left out. Process 0 prints one JSON line::

  {"payload_gbits_per_s": ..., "fixed_ms": ..., "bytes_per_node": ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# Per-device bytes of the small gather (its time is the fixed cost).
SMALL_BYTES_PER_DEVICE = 1024
# All-gathers per compiled call, each depending on the one before, and timed calls.
CHAIN = 4
CALLS = 3


def measure(bytes_per_node: int, nodes: int, local: int) -> dict:
    """Times the chains on this process's view of the ``(node, local)`` mesh.

    Args:
      bytes_per_node: what one large all-gather brings into each node (from
        the other nodes, over all ``local`` groups).
      nodes, local: the mesh; every process holds ``local`` devices.

    Returns:
      ``payload_gbits_per_s`` (per node and direction), ``fixed_ms`` (one
      small gather) and the large gather's ``bytes_per_node``.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import zeropp_jax as zp
    from zeropp_jax import distributed

    distributed.initialize()
    mesh = zp.make_mesh(nodes, local)
    spec = P(("node", "local"))
    remote = (nodes - 1) * local  # chunks a node takes in per gather
    large = max(SMALL_BYTES_PER_DEVICE + 1, bytes_per_node // remote)

    def body(x):
        for _ in range(CHAIN):
            # the next gather sends what this one brought: a chain, not a batch
            x = jax.lax.all_gather(x, "node", tiled=True)[-x.shape[0]:] + jnp.uint8(1)
        return x

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    seconds = {}
    for per_device in (SMALL_BYTES_PER_DEVICE, large):
        x = jax.device_put(jnp.zeros((nodes * local * per_device,), jnp.uint8),
                           NamedSharding(mesh, spec))
        step(x).block_until_ready()  # compiles, and drains the link's token bucket
        calls = []
        for _ in range(CALLS):
            start = time.perf_counter()
            step(x).block_until_ready()
            calls.append((time.perf_counter() - start) / CHAIN)
        seconds[per_device] = statistics.median(calls)
    extra_bytes = remote * (large - SMALL_BYTES_PER_DEVICE)
    extra_s = seconds[large] - seconds[SMALL_BYTES_PER_DEVICE]
    return {
        "payload_gbits_per_s": extra_bytes * 8 / extra_s / 1e9 if extra_s > 0 else None,
        "fixed_ms": seconds[SMALL_BYTES_PER_DEVICE] * 1e3,
        "bytes_per_node": remote * large,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zeropp_jax.cli.link_probe",
        description="One process of the emulated cluster's link probe (started by "
        "zeropp-cluster-bench, one per node).")
    parser.add_argument("--bytes-per-node", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--local", type=int, required=True)
    options = parser.parse_args(argv)
    result = measure(options.bytes_per_node, options.nodes, options.local)
    import jax

    if jax.process_index() == 0:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
