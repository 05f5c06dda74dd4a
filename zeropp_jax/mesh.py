"""The 2-D ``(node, local)`` device mesh.

``node`` is the slow boundary (InfiniBand between hosts), ``local`` the fast
one (NVLink inside a host).  On a multi-process run the mesh follows the real
topology: one row per process (host), built with JAX's hybrid-mesh utility.
On one host any ``NODESxLOCAL`` whose product is the device count may be
asked for, to simulate several nodes.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeropp_jax.config_checks import is_int

NODE = "node"
LOCAL = "local"
AXES = (NODE, LOCAL)
# Parameter shards are laid out local-major: device (n, l) holds chunk
# l * nodes + n, so an all-gather over ``node`` of the primary shards yields
# the hpZ secondary shard of local rank l.
SHARD_AXES = (LOCAL, NODE)


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """Parses ``"NODESxLOCAL"`` (e.g. ``"2x4"``) into ``(nodes, local)``."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(text))
    if not match:
        raise ValueError(
            f"mesh shape {text!r} is not of the form NODESxLOCAL, e.g. '2x4'"
        )
    nodes, local = int(match.group(1)), int(match.group(2))
    if nodes < 1 or local < 1:
        raise ValueError(f"mesh shape {text!r} needs positive sizes, e.g. '2x4'")
    return nodes, local


def _processes_hint(nodes: int, local: int, n_proc: int, n_dev: int) -> str:
    """What to change when a multi-process run's devices do not fit the mesh:
    the number of processes (one per node) or the devices each one has."""
    have = f" ({n_proc} processes x {n_dev // n_proc} devices"
    if nodes != n_proc:
        return (f"{have}; a node is one process: with zeropp-launch pass -n {nodes} for "
                f"mesh {nodes}x{local}, or use mesh {n_proc}x{n_dev // n_proc}: --mesh, "
                f"make_mesh({n_proc}, {n_dev // n_proc}))")
    return f"{have}; with zeropp-launch pass --devices-per-process {local})"


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _simulate_hint(count: int) -> str:
    """How to simulate ``count`` CPU devices, given this process's ``XLA_FLAGS``."""
    given = re.search(rf"{_DEVICE_COUNT_FLAG}=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if given:
        return (f", or, to simulate {count} devices on the CPU, change {_DEVICE_COUNT_FLAG}"
                f"={given.group(1)} in XLA_FLAGS to {count} (the CLI tools set it from "
                "--mesh only where XLA_FLAGS does not)")
    return (f", or, to simulate {count} devices on the CPU, set XLA_FLAGS={_DEVICE_COUNT_FLAG}"
            f"={count} before JAX starts (the CLI tools do)")


def make_mesh(
    nodes: int | None = None,
    local: int | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds the ``(node, local)`` mesh.

    Args:
      nodes: size of the ``node`` axis. ``None``: the device count over
        ``local`` where ``local`` is given, else the process count (1 on one
        process).
      local: size of the ``local`` axis. ``None``: the devices per node.
      devices: devices to use (default: all of ``jax.devices()``).

    Returns:
      A ``jax.sharding.Mesh`` with axes ``("node", "local")``. On a
      multi-process run each ``node`` row holds exactly one process's devices.

    Raises:
      ValueError: if the shape does not fit the devices, naming both (with
        one size given, the divisors of the device count it must be one of).
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh got no devices: pass devices=None (all of jax.devices()) "
                         "or a non-empty list")
    n_dev = len(devices)
    n_proc = len({d.process_index for d in devices})
    for name, size in (("nodes", nodes), ("local", local)):
        if size is not None and not (is_int(size) and size >= 1):
            raise ValueError(f"{name} must be a positive integer or None, got {size!r}")
    if nodes is None and local is None:
        nodes = n_proc
    if (nodes is None) != (local is None):
        name, size = ("nodes", nodes) if local is None else ("local", local)
        if n_dev % size:
            divisors = [d for d in range(1, n_dev + 1) if n_dev % d == 0]
            raise ValueError(
                f"{n_dev} devices ({devices[0].platform}) do not split into {name}={size}: "
                f"{name} must divide {n_dev}, one of {divisors}"
            )
        nodes, local = (size, n_dev // size) if local is None else (n_dev // size, size)
    if nodes * local != n_dev:
        raise ValueError(
            f"mesh {nodes}x{local} needs {nodes * local} devices but "
            f"{n_dev} are available ({devices[0].platform}); choose NODESxLOCAL "
            f"with NODES*LOCAL == {n_dev}"
            + (_processes_hint(nodes, local, n_proc, n_dev) if n_proc > 1 else "")
            + (_simulate_hint(nodes * local) if devices[0].platform == "cpu" and n_proc == 1
               else "")
        )
    if n_proc > 1:
        if nodes != n_proc:
            raise ValueError(
                f"on a multi-process run the node axis is the process boundary: "
                f"mesh {nodes}x{local} has {nodes} nodes but {n_proc} processes "
                f"are running; use mesh {n_proc}x{n_dev // n_proc} (--mesh, or "
                f"make_mesh({n_proc}, {n_dev // n_proc}))"
            )
        grid = mesh_utils.create_hybrid_device_mesh(
            (1, local), (nodes, 1), devices=devices, process_is_granule=True
        )
    else:
        grid = np.asarray(devices, dtype=object).reshape(nodes, local)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """Returns ``(nodes, local)`` of a mesh built by :func:`make_mesh`.

    Raises:
      ValueError: for axes other than ``("node", "local")``, or not Explicit.
    """
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(
            f"expected a mesh with axes {AXES}, got {tuple(mesh.axis_names)}; "
            "build it with zeropp_jax.make_mesh"
        )
    other = [f"{name} ({kind.name})" for name, kind in zip(mesh.axis_names, mesh.axis_types)
             if kind != jax.sharding.AxisType.Explicit]
    if other:
        raise ValueError(
            f"the mesh's axes {', '.join(other)} are not Explicit; the trainer places every "
            "array with explicit axes: build the mesh with zeropp_jax.make_mesh (or pass "
            "axis_types=(jax.sharding.AxisType.Explicit,) * 2)"
        )
    return mesh.shape[NODE], mesh.shape[LOCAL]


def default_mesh_shape() -> tuple[int, int]:
    """The mesh the CLI uses when none is given.

    Multi-process: one node per process, ``(processes, devices // processes)``.
    One process: ``(1, devices)``, one node of all its devices (also a single
    device: ``1x1``). Several simulated nodes on one host must be asked for
    explicitly (e.g. ``--mesh 2x4`` with XLA set to 8 host devices).
    """
    n_proc = jax.process_count()
    n_dev = jax.device_count()
    if n_proc > 1:
        return n_proc, n_dev // n_proc
    return 1, n_dev


def replicated_on(tree: Any, mesh: Mesh) -> Any:
    """``tree`` with each ``jax.Array`` leaf not yet replicated on ``mesh``
    (committed to one device, sharded on ``mesh`` or on another mesh) put
    there replicated, as a host array would be; other leaves unchanged.

    What :meth:`zeropp_jax.Trainer.init` cuts into units: a parameter loaded
    or initialised already sharded is gathered whole on every device first,
    as host parameters are (moves the leaves it changes).
    """
    target = NamedSharding(mesh, P())

    def put(x):
        if not isinstance(x, jax.Array):
            return x
        sharding = x.sharding
        if (isinstance(sharding, NamedSharding) and sharding.mesh == mesh
                and sharding.is_equivalent_to(target, x.ndim)):
            return x
        return jax.device_put(x, target)

    return jax.tree.map(put, tree)
