"""Values every process of a multi-process run must agree on, compared.

:func:`differing` all-gathers an 8-byte hash per key (after one of the key
list, so that processes with other keys fail alike instead of gathering
rows of other sizes) and names the processes that differ from process 0:
``zeropp-train``'s flags, the tokens its data holds. No mesh axes: the
exchange is :func:`jax.experimental.multihost_utils.process_allgather`
over the processes; a single-process run exchanges nothing.
"""

from __future__ import annotations

import hashlib
from typing import Mapping


def differing(values: Mapping[str, str]) -> dict[str, list[int]]:
    """The processes whose value differs from process 0's, key by key.

    One all-gather of an 8-byte hash per key (e.g. a command's flags, the
    data's fingerprint), after one of the keys; every process must call it.
    A single-process run differs from nobody (``{}``, no collective).

    Returns:
      ``{key: [process, ...]}`` for the keys on which some process differs.

    Raises:
      ValueError: on every process, if the processes' keys differ.
    """
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return {}
    from jax.experimental import multihost_utils

    def hashed(texts):  # two uint32 per text
        return np.frombuffer(b"".join(
            hashlib.blake2b(t.encode(), digest_size=8).digest() for t in texts), np.uint32)

    keys = sorted(values)
    n = jax.process_count()
    # The keys first, at a size every process agrees on: per-key hashes of
    # other lengths (another tool, another version) would not gather.
    rows = np.asarray(multihost_utils.process_allgather(hashed(["\n".join(keys)])))
    other = differing_rows(rows.reshape(n, -1), ["keys"]).get("keys")
    if other:
        raise ValueError(f"processes {other} compare other things than process 0 ({len(keys)} "
                         "keys here): they run another program or another zeropp_jax")
    rows = np.asarray(multihost_utils.process_allgather(hashed(str(values[k]) for k in keys)))
    return differing_rows(rows.reshape(n, -1), keys)


def differing_rows(rows, keys: list[str]) -> dict[str, list[int]]:
    """:func:`differing` of gathered hashes ``rows`` (one row per process,
    two ``uint32`` per key, keys in ``keys``' order)."""
    out = {}
    for i, key in enumerate(keys):
        other = [p for p in range(1, len(rows))
                 if tuple(rows[p][2 * i:2 * i + 2]) != tuple(rows[0][2 * i:2 * i + 2])]
        if other:
            out[key] = other
    return out
