"""Where a measurement came from: the code's commit, the machine and the date.

Every benchmark's JSON carries :func:`record`, so a figure can be traced to
the code and the machine that produced it (``benchmarks/RESULTS.md`` quotes
them). Nothing here needs a git checkout: without one (an installed wheel, a
copied tree on a device machine) the commit is ``None``.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

__all__ = ["code_version", "command_line", "record"]

_GIT_TIMEOUT_S = 10


def _git(root: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                             check=True, timeout=_GIT_TIMEOUT_S)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip()


def code_version() -> dict:
    """Where ``zeropp_jax`` was imported from and its commit.

    Returns:
      ``{"zeropp_jax": package directory, "git": short commit with
      ``+dirty`` when ``zeropp_jax/`` or ``pallas_kernels/`` has uncommitted
      changes, or None where the package is not the root of a git
      checkout (an installed copy, a copied tree)}``.
    """
    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    out = {"zeropp_jax": package, "git": None}
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(root):
        return out  # not a checkout of this project (e.g. installed inside another repo)
    head = _git(root, "rev-parse", "--short", "HEAD")
    if head:
        dirty = _git(root, "status", "--porcelain", "--", "zeropp_jax", "pallas_kernels")
        out["git"] = head + ("+dirty" if dirty else "")
    return out


def command_line() -> str:
    """The process's command line, shell-quoted: ``sys.argv``, a console script
    (``zeropp-train``, in the interpreter's ``bin``) by its name, a script or
    module by the path Python was given."""
    argv = list(sys.argv) or [""]
    if os.path.dirname(os.path.abspath(argv[0])) == os.path.dirname(sys.executable):
        argv[0] = os.path.basename(argv[0])
    return shlex.join(argv)


def record(devices: bool = True) -> dict:
    """:func:`code_version` plus the machine, the software and the UTC time.

    Args:
      devices: also name JAX's default backend and its devices (this
        initializes JAX's backends; a launcher of other processes passes
        False).

    Returns a JSON-ready dict: ``git``, ``zeropp_jax``, ``command``
    (:func:`command_line`: what re-runs the figure), ``host`` (``platform.node()``),
    ``cpus``, ``python``, ``jax``, ``date`` (ISO 8601, UTC, to the second),
    and with ``devices`` also ``backend`` and ``devices`` (count and kind of
    the default backend's devices).
    """
    import jax

    out = {
        **code_version(),
        "command": command_line(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if devices:
        found = jax.devices()
        out.update(backend=jax.default_backend(), devices=f"{len(found)} x {found[0].device_kind}")
    return out
