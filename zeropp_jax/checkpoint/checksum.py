"""Checksums of a checkpoint's arrays, and the finite-state check before a save.

Each stored leaf gets a 64-bit fingerprint of its bytes: two sums, modulo
``2**32``, of a per-element mix of the element's 32-bit words with its
row-major index.  A sum modulo ``2**32`` does not depend on the order of
the additions, so the fingerprint is the same whether it is computed by
XLA over an array sharded on any mesh (:func:`state_summary` at save;
restored leaves read into the trainer's shardings) or by numpy over a
host copy (restored leaves being converted, :func:`export_params
<zeropp_jax.checkpoint.export.export_params>`).  Each term is a bijection
of the element's word, so any change of a single element always changes
the first sum; other changes escape both sums with probability about
``2**-64``.

The checksums are stored in the metadata under ``"checksums"``
(item name -> ``"/"``-joined leaf key -> ``"<dtype>:<16 hex digits>"``);
checkpoints written without them are read without the check, and a leaf
restored in another dtype than it was stored in is not checked.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.checkpoint.errors import CheckpointError, NonFiniteStateError
from zeropp_jax.checkpoint.metadata import flat_with_keys

_M1, _M2, _M3 = np.uint32(0x9E3779B1), np.uint32(0x85EBCA77), np.uint32(0xC2B2AE3D)
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}

# The qgZ state's last gradient RMS is ``inf`` before the first step by design.
_NOT_CHECKED_FOR_FINITE = ("qgz", "grad_rms")


def _terms(w, idx, xp):
    """The two per-element terms (uint32) of words ``w`` at flat indices ``idx``."""
    one, thirteen = xp.uint32(1), xp.uint32(13)
    a = ((w * _M1) ^ idx) * (idx * xp.uint32(2) + one)
    b = (w ^ (idx * _M2)) * _M3
    return a, b ^ (b >> thirteen)


def _device_fingerprint(x: jax.Array) -> jax.Array:
    """uint32 ``(2,)`` fingerprint of ``x`` (traced; any sharding)."""
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    w = jax.lax.bitcast_convert_type(x, _WORD[size]).astype(jnp.uint32)
    idx = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * np.uint32(stride % 2**32)
        stride *= w.shape[d]
    a, b = _terms(w, idx, jnp)
    return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])


def host_fingerprint(x: np.ndarray) -> str:
    """``"<dtype>:<16 hex digits>"``: the fingerprint of a host array (same as on devices)."""
    x = np.ascontiguousarray(x)
    dtype = x.dtype  # the label: a bool's words are its bytes, as on devices
    if dtype == np.bool_:
        x = x.astype(np.uint8)
    w = x.view(_WORD[x.dtype.itemsize]).astype(np.uint32).reshape(-1)
    idx = (np.arange(w.size, dtype=np.uint64) % 2**32).astype(np.uint32)
    a, b = _terms(w, idx, np)
    return _hex(dtype, np.sum(a, dtype=np.uint32), np.sum(b, dtype=np.uint32))


def _hex(dtype, a, b) -> str:
    return f"{np.dtype(dtype).name}:{int(a):08x}{int(b):08x}"


@functools.partial(jax.jit, static_argnums=1)
def _summarize(leaves: list, check: tuple[bool, ...]) -> tuple[jax.Array, jax.Array]:
    """uint32 ``(len(leaves), 2)`` fingerprints; whether the ``check`` leaves are finite."""
    prints = [_device_fingerprint(x) for x in leaves]
    prints = jnp.stack(prints) if prints else jnp.zeros((0, 2), jnp.uint32)
    finite = [jnp.all(jnp.isfinite(x)) for x, c in zip(leaves, check) if c]
    return prints, jnp.all(jnp.stack(finite)) if finite else jnp.asarray(True)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def state_summary(items: dict[str, Any]) -> tuple[dict[str, dict[str, str]], dict[str, bool]]:
    """Checksums and finiteness of the array items of a save, in one compiled pass.

    Args:
      items: item name -> pytree of ``jax.Array`` (e.g. ``{"params": ...,
        "opt_state": ...}``), sharded in any way.

    Returns:
      ``(checksums, finite)``: item -> leaf key -> ``"<dtype>:<16 hex
      digits>"``, and item -> whether every floating-point leaf is finite (qgZ's
      ``grad_rms``, ``inf`` before the first step, is not checked).
    """
    keys, leaves, check = [], [], []
    for name, tree in items.items():
        for k, x in flat_with_keys(tree).items():
            keys.append((name, k))
            leaves.append(x)
            check.append(_is_float(x) and k[-2:] != _NOT_CHECKED_FOR_FINITE)
    checksums: dict[str, dict[str, str]] = {name: {} for name in items}
    finite = {}
    for name in items:  # one pass per item, so a failure names the item
        sel = [i for i, (n, _) in enumerate(keys) if n == name]
        prints, ok = jax.device_get(
            _summarize([leaves[i] for i in sel], tuple(check[i] for i in sel))
        )
        for row, i in zip(prints, sel):
            checksums[name]["/".join(keys[i][1])] = _hex(leaves[i].dtype, *row)
        finite[name] = bool(ok)
    return checksums, finite


_WHAT = {"params": "parameters", "opt_state": "optimizer state"}


def checksums_of_finite(items: dict[str, Any], where: str) -> dict[str, dict[str, str]]:
    """:func:`state_summary`'s checksums, or :class:`NonFiniteStateError` if an item is not finite.

    ``where`` names the step and directory in the message.
    """
    checksums, finite = state_summary(items)
    bad = [name for name, ok in finite.items() if not ok]
    if bad:
        raise NonFiniteStateError(
            f"{where}: the {' and the '.join(_WHAT.get(b, b) for b in bad)} hold inf or nan; "
            "not saved"
        )
    return checksums


def verify(stored: dict | None, values: dict[str, Any], where: str) -> None:
    """Raises :class:`CheckpointError` unless ``values`` match their checksums.

    Args:
      stored: the metadata's ``"checksums"`` (``None``: not recorded, no check).
      values: item name -> restored tree; leaves are ``jax.Array``s (stored
        shape, any sharding) or numpy arrays; other leaves (placeholders of
        leaves that were not read) are skipped.
      where: names the checkpoint in the message.
    """
    if stored is None:
        return
    for name, tree in values.items():
        flat = {
            "/".join(k): x for k, x in flat_with_keys(tree).items()
            if isinstance(x, (jax.Array, np.ndarray))
        }
        expected = {  # leaves read in the dtype they were stored in
            k: v for k, v in stored.get(name, {}).items()
            if k in flat and v.split(":")[0] == np.dtype(flat[k].dtype).name
        }
        on_device = [k for k in expected if isinstance(flat[k], jax.Array)]
        got = {}
        if on_device:
            prints, _ = jax.device_get(_summarize([flat[k] for k in on_device], ()))
            got.update({k: _hex(flat[k].dtype, *row) for k, row in zip(on_device, prints)})
        for k in expected:
            if isinstance(flat[k], np.ndarray):
                got[k] = host_fingerprint(flat[k])
        bad = [k for k, value in got.items() if value != expected[k]]
        if bad:
            raise CheckpointError(
                f"{where}: the data of {name}/{bad[0]}"
                f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''} do not match "
                "the checksum saved with it; the checkpoint is corrupted"
            )
