"""Export of the full, unpadded parameters as one plain msgpack file.

:func:`export_params` writes each leaf in its original dtype, in a file that
needs neither this library nor the model code::

  import flax.serialization
  with open("params.msgpack", "rb") as f:
      data = f.read()
  params = flax.serialization.msgpack_restore(data)  # nested dict of numpy arrays
  # or, to get the original container types back from a template pytree:
  params = flax.serialization.from_bytes(template_params, data)

The tree is nested dicts keyed as the parameters are: dict keys keep their
type (Flax Linen's ``str`` keys, and the ``int`` keys of ``nnx.List`` items in
``zp.nnx_loss`` parameters, so ``nnx.update(model, params)`` takes the tree
back), lists and tuples become dicts keyed by ``int`` index, named fields are
keyed by name.  ``from_bytes`` with a template needs ``str`` keys throughout
(it looks keys up as ``str``), e.g. Flax Linen parameters.  Export from a
checkpoint directory and from memory give the same tree.  Units appear in the
layout's order, leaves in tree order.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping

import jax
import numpy as np

from zeropp_jax.checkpoint.checkpointer import Checkpointer
from zeropp_jax.checkpoint.errors import CheckpointError
from zeropp_jax.checkpoint.metadata import key_name, unit_from_json
from zeropp_jax.files import write_file
from zeropp_jax.layout import split_units, unit_leaves
from zeropp_jax.step.trainer import Trainer


def export_params(
    source: Any,
    out_path: str | os.PathLike,
    *,
    step: int | None = None,
    trainer: Trainer | None = None,
    allow_nonfinite: bool = False,
) -> dict:
    """Writes the full, unpadded parameters as one msgpack file.

    Load it with plain Flax (see :mod:`zeropp_jax.checkpoint.export`)::

      params = flax.serialization.msgpack_restore(open(out_path, "rb").read())

    Args:
      source: a checkpoint directory (no trainer or model code needed: the
        layout comes from the checkpoint's metadata), or a
        :class:`TrainState` / its ``params`` dict together with ``trainer``.
      out_path: the file to write (replaced atomically; a symlink's target,
        a named pipe or ``/dev/stdout`` written through: :mod:`zeropp_jax.files`).
      step: the checkpoint step (default: the newest readable one); only
        with a directory.
      trainer: the trainer of an in-memory ``source``.
      allow_nonfinite: write parameters that hold ``inf`` or ``nan``
        (refused by default).

    Returns:
      ``{"path", "step", "params", "bytes"}``; ``step`` is ``None`` for an
      in-memory state.
    """
    import flax.serialization

    if isinstance(source, (str, os.PathLike)):
        if trainer is not None:
            raise ValueError("pass trainer only with an in-memory state, not a directory")
        ckpt = Checkpointer(source, read_only=True)
        try:
            units, meta = ckpt.read_params(step)
        finally:
            ckpt.close()
        tree, saved_step = _stored_state_dict(units, meta["layout"], meta["step"]), meta["step"]
    else:
        if trainer is None:
            raise ValueError("exporting an in-memory state needs its trainer")
        if step is not None:
            raise ValueError("step applies only to a checkpoint directory")
        tree, saved_step = _gathered_state_dict(trainer, source), None
    out_path = os.fspath(out_path)
    if os.path.isdir(out_path):
        raise ValueError(f"{out_path} is a directory; give the output file's name")
    if not allow_nonfinite:
        _check_finite(tree, saved_step)
    data = flax.serialization.msgpack_serialize(tree)
    write_file(out_path, data)
    count = sum(int(np.size(x)) for x in jax.tree.leaves(tree))
    return {"path": out_path, "step": saved_step, "params": count, "bytes": len(data)}


def _check_finite(tree: Any, step: int | None) -> None:
    """Raises ``ValueError`` naming the first parameter that holds ``inf`` or ``nan``."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, x in flat:
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
            where = "" if step is None else f" of step {step}"
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)}{where} holds "
                f"{int(x.size - np.isfinite(x).sum())} inf/nan values; not exported "
                "(allow_nonfinite=True, or zeropp-export --allow-nonfinite, writes them)"
            )


def _stored_state_dict(units: Mapping[str, np.ndarray], layout_json: dict, step: int) -> Any:
    """The state dict of padded host units read from a checkpoint.

    The layout and the key paths come from the stored metadata, so no model
    code is needed.  A node-replicated unit (``zeropp-max``) is stored with
    one equal row per node, ``(nodes, [L,] padded)``: its row 0 is exported.
    """

    paths = layout_json.get("paths") or ()

    def items():
        for i, u in enumerate(layout_json["units"]):
            prefix = _prefix(layout_json["whole_model"], paths, i, u["name"])
            unit = unit_from_json(u)
            flat = _one_copy(np.asarray(units[u["name"]]), unit, step)
            leaves = unit_leaves(flat, unit, "original")
            for leaf, x in zip(u["leaves"], leaves):
                yield prefix + _stored_keys(leaf, u["name"]), x

    return _nest(items())


def _one_copy(x: np.ndarray, unit: Any, step: int) -> np.ndarray:
    """A stored unit as ``([L,] padded)``: row 0 of node-replicated rows
    ``(nodes, [L,] padded)``, which must all be equal."""
    want = tuple(unit.global_shape)
    if x.shape == want:
        return x
    if x.ndim == len(want) + 1 and x.shape[1:] == want:
        for n in range(1, x.shape[0]):
            if not np.array_equal(x[n], x[0], equal_nan=True):
                raise CheckpointError(
                    f"unit {unit.name!r} of step {step} is stored node-replicated "
                    f"{x.shape}, but node {n}'s copy differs from node 0's; the copies "
                    "must be equal (a corrupt checkpoint: export another step)"
                )
        return x[0]
    raise CheckpointError(
        f"unit {unit.name!r} of step {step} is stored as {x.shape}; its layout "
        f"needs {want} or one copy per node (nodes, *{want})"
    )


def _gathered_state_dict(trainer: Trainer, state_or_params: Any) -> Any:
    """The state dict of a trainer's in-memory parameters (via ``gather_params``)."""
    trees = split_units(trainer.gather_params(state_or_params), trainer.layout)

    layout = trainer.layout

    def items():
        for i, u in enumerate(layout.units):
            prefix = _prefix(layout.whole_model, layout.paths, i, u.name)
            for path, x in jax.tree_util.tree_flatten_with_path(trees[u.name])[0]:
                yield prefix + [_export_key(k) for k in path], x

    return _nest(items())


def _export_key(key: Any) -> str | int:
    """A key path entry as the export keys it: a ``str`` or ``int`` dict key
    as it is (``nnx.List`` items keep ``int`` keys), a sequence index as its
    ``int``, any other as :func:`~zeropp_jax.checkpoint.metadata.key_name`
    names it (a ``str``)."""
    if isinstance(key, jax.tree_util.DictKey) and type(key.key) in (str, int):
        return key.key
    if isinstance(key, jax.tree_util.SequenceKey):
        return key.idx
    return key_name(key)


# One entry of a stored leaf path (``jax.tree_util.keystr``): ``['name']``,
# ``[0]`` (an int dict key or a sequence index), ``.field``, ``[<flat index 0>]``.
_ENTRY = re.compile(r"""\[(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\]]*)\]|\.[^.\[]+""")


def _stored_keys(leaf: Mapping, unit: str) -> list[str | int]:
    """A stored leaf's key path inside its unit, keyed as :func:`_export_key`
    keys it: its stored ``keys`` (``str``), as ``int`` where its stored path
    (``keystr``) shows an ``int`` (``[0]``, not ``['0']``)."""
    entries = _ENTRY.findall(leaf["path"])
    if "".join(entries) != leaf["path"] or len(entries) != len(leaf["keys"]):
        raise CheckpointError(
            f"unit {unit!r}: the stored leaf path {leaf['path']!r} does not split into its "
            f"{len(leaf['keys'])} stored keys {leaf['keys']}; the metadata should hold "
            "jax.tree_util.keystr of the path and one key per entry (a corrupt checkpoint?)"
        )
    return [int(k) if re.fullmatch(r"\[-?\d+\]", e) else k
            for e, k in zip(entries, leaf["keys"])]


def _prefix(whole_model: bool, paths: Any, index: int, name: str) -> list[str | int]:
    """Key path of unit ``index``'s sub-tree: nested units (a wrap policy)
    have their own path, top-level units their name, the whole model none."""
    if whole_model:
        return []
    return list(paths[index]) if paths else [name]


def _nest(items: Iterable[tuple[list[str | int], np.ndarray]]) -> Any:
    """Nested dicts from ``(key path, leaf)`` pairs, in their order.

    A single leaf with an empty key path (the whole model is one array) is
    returned as it is.
    """
    tree: dict = {}
    for keys, x in items:
        if not keys:
            return x
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = x
    return tree
