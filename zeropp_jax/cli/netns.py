"""An emulated two-node cluster on one Linux machine: two network namespaces and a link.

:class:`TwoNodeCluster` creates namespaces ``A`` and ``B`` (names made unique
with this process's id), joins them with a veth pair (``10.213.0.1`` in A,
``10.213.0.2`` in B) and can cap the link's rate with a ``tbf`` qdisc on both
ends, so each direction (each node's inbound traffic) carries at most that
many bits per second. A command run with :meth:`TwoNodeCluster.exec_prefix`
sees only its namespace's loopback and veth: traffic between the two nodes
crosses the veth and nothing is routed anywhere else.

gloo (JAX's CPU collectives) binds the address the host name resolves to.
``ip netns exec NAME`` mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts``,
so each namespace gets a hosts file mapping the host name to its own veth
address; without it gloo would bind ``127.0.0.1`` and never reach the peer.

Everything is removed by :meth:`TwoNodeCluster.close` (the context manager
calls it): the namespaces (which takes the veth pair with them) and the
hosts files. Creating and removing namespaces needs root, ``ip`` and ``tc``
(:func:`unavailable_reason`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from typing import NamedTuple

NETNS_DIR = "/etc/netns"
SUBNET = "10.213.0"
# tbf's bucket: at least 256 KiB, and at least 10 ms of traffic at the rate
# (a bucket smaller than one timer tick of data caps the rate below the target).
MIN_BURST_BYTES = 256 * 1024
BURST_SECONDS = 0.01


# Headers each frame on the veth carries besides its payload: Ethernet (14),
# IPv4 (20) and TCP with Linux's default timestamp option (32). Pure ACKs
# are frames of headers only. The byte counters include them.
FRAME_HEADER_BYTES = 14 + 20 + 32


def burst_bytes(mbit: float) -> int:
    """The token bucket of a link capped at ``mbit`` Mbit/s: after an idle
    spell this many bytes pass at the link's own speed."""
    return max(MIN_BURST_BYTES, int(mbit * 1e6 / 8 * BURST_SECONDS))


class LinkCounters(NamedTuple):
    """A veth's counters (``/proc/net/dev``): bytes include every frame's headers."""

    rx_bytes: int
    rx_frames: int
    tx_bytes: int
    tx_frames: int


def unavailable_reason() -> str | None:
    """Why this machine cannot build the cluster (``None``: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. with sudo)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    if not os.path.isdir("/var/run") or not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces"
    return None


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip() or result.returncode}")


class TwoNodeCluster:
    """Two network namespaces joined by a (rate-limited) veth pair.

    Attributes:
      names: the two namespace names (node 0, node 1).
      addresses: their veth addresses (node 0's hosts the coordinator).
      links: their veth interface names.
      hostname: the host name both hosts files map (this machine's).
    """

    def __init__(self, tag: str | None = None):
        tag = tag or str(os.getpid())
        self.names = (f"zpA{tag}", f"zpB{tag}")
        self.links = (f"zpa{tag}"[:15], f"zpb{tag}"[:15])
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.hostname = socket.gethostname()
        self._created: list[str] = []  # namespaces
        self._hosts_dirs: list[str] = []
        self._made_netns_dir = False
        self._watchers: list[subprocess.Popen] = []  # one idle process per namespace

    def __enter__(self) -> "TwoNodeCluster":
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Creates the namespaces, the veth pair, the addresses and the hosts files."""
        for name in self.names:
            _run("ip", "netns", "add", name)
            self._created.append(name)
        a, b = self.links
        _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        try:
            for name, link, addr in zip(self.names, self.links, self.addresses):
                _run("ip", "link", "set", link, "netns", name)
                _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", link)
                _run("ip", "-n", name, "link", "set", link, "up")
                _run("ip", "-n", name, "link", "set", "lo", "up")
        finally:
            # a veth end still in the root namespace (a failed move) goes too
            subprocess.run(("ip", "link", "del", a), capture_output=True)
        if not os.path.isdir(NETNS_DIR):
            os.makedirs(NETNS_DIR)
            self._made_netns_dir = True
        for name, addr in zip(self.names, self.addresses):
            path = os.path.join(NETNS_DIR, name)
            os.makedirs(path, exist_ok=True)
            self._hosts_dirs.append(path)
            with open(os.path.join(path, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{addr} {self.hostname}\n")
        # An idle process in each namespace whose /proc/PID/net/dev shows the
        # namespace's counters (link_counters), however the measured programs run.
        for node in range(len(self.names)):
            self._watchers.append(subprocess.Popen(
                [*self.exec_prefix(node), "sleep", "infinity"], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))

    def set_rate(self, mbit: float) -> None:
        """Caps each direction of the link at ``mbit`` Mbit/s (0: no cap)."""
        for name, link in zip(self.names, self.links):
            subprocess.run(("tc", "-n", name, "qdisc", "del", "dev", link, "root"),
                           capture_output=True)  # none yet is fine
            if mbit:
                _run("tc", "-n", name, "qdisc", "add", "dev", link, "root", "tbf",
                     "rate", f"{mbit}mbit", "burst", str(burst_bytes(mbit)), "latency", "100ms")

    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program on node ``node`` (0 or 1)."""
        return ["ip", "netns", "exec", self.names[node]]

    def link_counters(self, node: int) -> LinkCounters:
        """Node ``node``'s veth counters so far (bytes and frames, each way).

        Read from ``/proc/PID/net/dev`` of an idle process inside that
        namespace (no process is started, so it can be read often).
        """
        pid = self._watchers[node].pid
        with open(f"/proc/{pid}/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == self.links[node]:
                    fields = [int(v) for v in counters.split()]
                    return LinkCounters(fields[0], fields[1], fields[8], fields[9])
        raise RuntimeError(f"no interface {self.links[node]} in the namespace of pid {pid}")

    def close(self) -> None:
        """Removes what :meth:`open` made (each step even if another fails)."""
        for watcher in self._watchers:
            watcher.kill()
            watcher.wait()
        self._watchers = []
        for name in self._created:
            subprocess.run(("ip", "netns", "del", name), capture_output=True)
        self._created = []
        for path in self._hosts_dirs:
            shutil.rmtree(path, ignore_errors=True)
        self._hosts_dirs = []
        if self._made_netns_dir:
            try:
                os.rmdir(NETNS_DIR)  # only if nothing else was put there meanwhile
            except OSError:
                pass
            self._made_netns_dir = False
