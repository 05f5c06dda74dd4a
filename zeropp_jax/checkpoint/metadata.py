"""The JSON stored with a checkpoint, and the checks that a trainer fits it.

The ``meta`` item describes what was saved: format version, step, mesh,
config, the per-unit layout (:func:`layout_to_json`: enough to unpad the
parameters without the model code) and whatever the caller adds.  Its keys
are the checkpoint format: keep them stable.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from zeropp_jax.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    QgzTargetMismatchError,
)
from zeropp_jax.layout import LeafSpec, ParamLayout, UnitLayout
from zeropp_jax.mesh import mesh_shape
from zeropp_jax.step.adam import OneBitAdam
from zeropp_jax.step.trainer import Trainer

FORMAT = "zeropp_jax.checkpoint"
FORMAT_VERSION = 1


# ------------------------------------------------------------ tree paths
def key_name(key: Any) -> str:
    """A key path entry as Orbax and ``flax.serialization`` name it."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    raise TypeError(f"unsupported pytree key {key!r} ({type(key).__name__})")


def flat_with_keys(tree: Any) -> dict[tuple[str, ...], Any]:
    """``{("inner", "1", "0", "mu", "blocks"): leaf, ...}`` in tree order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(key_name(k) for k in path): leaf for path, leaf in leaves}


def _unit_leaf_keys(unit: UnitLayout) -> list[list[str]]:
    """State-dict key path of each leaf inside its unit, in tree order."""
    skeleton = jax.tree_util.tree_unflatten(unit.treedef, list(range(len(unit.leaves))))
    return [list(k) for k in flat_with_keys(skeleton)]


# ---------------------------------------------------------------- layout
def layout_to_json(layout: ParamLayout) -> dict:
    """The parameter layout as plain data (enough to unpad without the model)."""
    units = []
    for u in layout.units:
        leaves = [
            {
                "path": spec.path,
                "keys": keys,
                "shape": list(spec.shape),
                "dtype": np.dtype(spec.dtype).name,
                "offset": spec.offset,
                "size": spec.size,
            }
            for spec, keys in zip(u.leaves, _unit_leaf_keys(u))
        ]
        units.append({
            "name": u.name, "numel": u.numel, "padded": u.padded, "stack": u.stack,
            "leaves": leaves,
        })
    return {"whole_model": layout.whole_model, "n_devices": layout.n_devices, "units": units,
            "paths": [list(p) for p in layout.paths]}


def unit_from_json(unit: Mapping) -> UnitLayout:
    """A stored unit (one entry of :func:`layout_to_json`'s ``units``) as a
    :class:`~zeropp_jax.layout.UnitLayout`.

    The pytree structure is not stored: ``treedef`` is ``None``, so the
    result serves the flat-vector functions (``global_shape``,
    :func:`~zeropp_jax.layout.unit_leaves`, leaf offsets), not
    :func:`~zeropp_jax.layout.unflatten_unit`.
    """
    leaves = tuple(
        LeafSpec(leaf["path"], tuple(leaf["shape"]), jnp.dtype(leaf["dtype"]),
                 leaf["offset"], leaf["size"])
        for leaf in unit["leaves"]
    )
    return UnitLayout(unit["name"], None, leaves, unit["stack"], unit["numel"], unit["padded"])


# ------------------------------------------------------------- describe
def describe_checkpoint(trainer: Trainer, step: int, extra_metadata: Mapping | None = None,
                        opt_state: Any = None) -> dict:
    """The JSON stored with a checkpoint.

    Args:
      trainer: the trainer the state belongs to.
      step: the optimizer step of the state.
      extra_metadata: JSON-serializable caller data (model config, seed,
        data position, ...), stored under ``"extra"``.
      opt_state: the optimizer's own state (``ZeroOptState.inner``), whose
        structure is recorded for an optax optimizer (:func:`optimizer_to_json`).

    Returns:
      A dict with ``format``, ``version``, ``step``, ``mesh``,
      ``process_count``, ``config``, ``error_feedback``, ``layout`` (see
      :func:`layout_to_json`), ``optimizer`` (:func:`optimizer_to_json`),
      ``extra``, ``time`` and library versions.
    """
    nodes, local = mesh_shape(trainer.mesh)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "mesh": {"node": nodes, "local": local},
        "process_count": jax.process_count(),
        "config": trainer.config.describe(),
        "qgz_active": trainer.qgz_active,
        "error_feedback": trainer.error_feedback,
        "layout": layout_to_json(trainer.layout),
        "optimizer": optimizer_to_json(trainer.optimizer, opt_state, trainer.layout.names),
        "extra": dict(extra_metadata or {}),
        "time": time.time(),
        "versions": {"jax": jax.__version__, "orbax": getattr(ocp, "__version__", "?")},
    }
    try:
        json.dumps(meta)
    except TypeError as e:
        raise ValueError(f"extra_metadata must be JSON-serializable: {e}") from None
    return meta


# ---------------------------------------------------------------- checks
def check_meta(meta: Any, step: int, path: str) -> dict:
    """Raises :class:`CheckpointError` unless ``meta`` (read from ``path``)
    is this format's metadata, in the version this code reads, of ``step``."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint step {step}: {path} is not {FORMAT} metadata"
        )
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint step {step}: format version {meta.get('version')} in {path}; "
            f"this zeropp_jax reads version {FORMAT_VERSION}"
        )
    if meta.get("step") != step:
        raise CheckpointError(
            f"checkpoint step {step}: {path} says step {meta.get('step')}"
        )
    return meta


def check_layout(saved: dict, layout: ParamLayout, where: str) -> None:
    """Raises :class:`CheckpointMismatchError` unless the models agree.

    The parameters are compared first, leaf by leaf over the whole model
    (the first that differs is named); then, for the same parameters, how
    they are cut into units (``per_layer``, ``stacked``, a wrap policy).
    """
    current = layout_to_json(layout)
    old, new = _model_leaves(saved), _model_leaves(current)
    for key, leaf in new.items():
        if key not in old:
            raise CheckpointMismatchError(
                f"{where}: the trainer's model has the parameter {_show(key, leaf)}, which the "
                "checkpoint does not; was it written for another model?")
        if old[key][0] != leaf[0]:  # the shape (stored as float32 whatever the dtype)
            raise CheckpointMismatchError(
                f"{where}: parameter {_joined(key)} is {_array(old[key])} in the checkpoint "
                f"but {_array(leaf)} in the trainer's model; build the model with the "
                "checkpoint's configuration (its shapes), or start a new run")
    for key, leaf in old.items():
        if key not in new:
            raise CheckpointMismatchError(
                f"{where}: the checkpoint has the parameter {_show(key, leaf)}, which the "
                "trainer's model does not; was it written for another model?")
    if _units(saved) != _units(current):
        raise CheckpointMismatchError(
            f"{where}: the same parameters, cut into other units: the checkpoint has "
            f"{_describe_units(saved)}, the trainer {_describe_units(current)}. Build the "
            "trainer with the unit layout of the checkpoint (make_trainer's per_layer, "
            "stacked and wrap as when it was written)")


def _model_leaves(layout: Mapping) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """Every parameter leaf of a stored layout: model key path -> (full shape, dtype)."""
    paths = [tuple(p) for p in layout.get("paths", [])]
    out = {}
    for i, unit in enumerate(layout["units"]):
        if layout["whole_model"]:
            prefix: tuple[str, ...] = ()
        elif paths:
            prefix = paths[i]
        else:
            prefix = (unit["name"],)
        stack = (unit["stack"],) if unit["stack"] else ()
        for leaf in unit["leaves"]:
            keys = tuple(leaf["keys"]) if "keys" in leaf else (leaf["path"],)
            out[prefix + keys] = (stack + tuple(leaf["shape"]), leaf["dtype"])
    return out


def _array(leaf: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = leaf
    return f"{dtype}{list(shape)}"


def _show(key: tuple[str, ...], leaf: tuple[tuple[int, ...], str]) -> str:
    return f"{_joined(key)} {_array(leaf)}"


def _joined(key: tuple) -> str:
    """A model key path as ``a/b/0`` (a unit path may hold ``nnx.List`` int keys)."""
    return "/".join(map(str, key))


def _units(layout: Mapping) -> dict:
    """The unit layout: each unit's stacking and leaves (not padding), by
    name. A restore goes by name, so the units' order (the params' key order:
    ``model.init``'s creation order, ``jax.eval_shape``'s sorted keys) does
    not matter."""
    return {u["name"]: (u["stack"], [leaf["path"] for leaf in u["leaves"]])
            for u in layout["units"]}


def _describe_units(layout: Mapping) -> str:
    if layout["whole_model"]:
        return "one unit (per_layer=False)"
    names = [u["name"] + (f" (stacked x{u['stack']})" if u["stack"] else "")
             for u in layout["units"]]
    how = "a wrap policy's" if layout.get("paths") else "per_layer=True"
    return f"{how} units {names}"


def check_qgz_target(meta: dict, trainer: Trainer, where: str) -> None:
    """Refuses a switch between 1-bit Adam's state and optax's.

    Used where no conversion is planned (:mod:`~zeropp_jax.checkpoint.convert`
    converts 1-bit Adam <-> optax Adam on restore)."""
    if meta["config"].get("qgz_target", "gradient") != trainer.config.qgz_target:
        raise qgz_target_mismatch(meta, trainer, where, "no conversion was asked for.")


def qgz_target_mismatch(meta: dict, trainer: Trainer, where: str, why: str) -> QgzTargetMismatchError:
    """The error for a checkpoint of the other ``qgz_target`` that cannot be converted.

    Args:
      why: the reason the conversion does not apply (one sentence).
    """
    stored = meta["config"].get("qgz_target", "gradient")  # written before the field
    return QgzTargetMismatchError(
        f"{where} was written with qgz_target={stored!r} (preset "
        f"{meta['config'].get('preset')!r}) and the trainer has "
        f"qgz_target={trainer.config.qgz_target!r}: their optimizer states differ (1-bit "
        "Adam's per-node m and v and two carries vs an optax state). Restore converts "
        "1-bit Adam's state into an optax Adam's (optax.adam inside the chain, same b1 and "
        f"b2) and back, but not here: {why} Build the trainer with "
        f"{_same_optimizer(meta['config'])}; the presets qgz and zeropp meant "
        "qgz_target='gradient' before they ran 1-bit Adam",
        stored_config=meta["config"],
    )


def _same_optimizer(stored: dict) -> str:
    """The optimizer and ZeroConfig fields that give a trainer the stored config's optimizer."""
    if stored.get("qgz_target", "gradient") == "momentum":  # qgZ on and a warm-up
        return (f"zeropp_jax.onebit_adam and ZeroConfig(qgz={stored.get('qgz')!r}, "
                f"qgz_target='momentum', qgz_warmup_steps={stored.get('qgz_warmup_steps')}, "
                f"qgz_refresh_every={stored.get('qgz_refresh_every')}) (e.g. "
                f"ZeroConfig.from_preset({stored.get('preset')!r}))")
    return "an optax optimizer and ZeroConfig(qgz_target='gradient')"


# ------------------------------------------------------------- optimizer
def optimizer_to_json(optimizer: Any, opt_state: Any = None, units: tuple[str, ...] = ()) -> dict:
    """What the checkpoint records of the optimizer.

    1-bit Adam: its ``b1``, ``b2``, ``eps`` and ``clip_norm`` (a conversion
    needs them, see :mod:`~zeropp_jax.checkpoint.convert`, and a restore
    checks them). An optax optimizer keeps its hyperparameters in closures:
    its name, and with ``opt_state`` (its state, ``ZeroOptState.inner``) the
    state's structure (:func:`state_structure`; ``units``: the parameter
    units' names): the types of its states, which tell stateful
    transformations apart where their states differ (Adam from AdaBelief, a
    schedule added), not where they share one (optax's adam, adamax, nadam,
    radam and yogi all keep a ``ScaleByAdamState``), nor stateless ones
    (AdamW's weight decay) or hyperparameters.
    """
    if isinstance(optimizer, OneBitAdam):
        return {"name": "onebit_adam", "b1": optimizer.b1, "b2": optimizer.b2,
                "eps": optimizer.eps, "clip_norm": optimizer.clip_norm}
    if opt_state is None:
        return {"name": "optax"}
    return {"name": "optax", "state": state_structure(opt_state, units),
            "state_flat": state_structure(opt_state, units, flat=True)}


def state_structure(tree: Any, units: tuple[str, ...] = (), flat: bool = False) -> str:
    """A pytree's structure as text: node type names, fields and keys, ``*``
    for a leaf, ``{units: ...}`` for a dict keyed by the names ``units`` (the
    same per unit), e.g. ``(ScaleByAdamState(count=*, mu={units: *}, nu={units: *}))``.
    Nodes that hold no array (optax's ``EmptyState`` of a stateless
    transformation, a weight-decay mask's ``MaskedState``) are left out: they
    restore under any optimizer. Independent of shapes, shardings and JAX's
    own repr. ``flat``: the whole state is read as a tuple, and a tuple
    inside a tuple is spliced into it, so that
    ``optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))``, whose
    Adam state sits a tuple deeper than ``optax.adam(lr)``'s, reads the same
    (and so do ``chain(clip, inject_hyperparams(adam)(lr))`` and the bare
    ``inject_hyperparams`` state)."""
    text = _node_text(jax.tree.structure(tree), sorted(units), flat) or "()"
    return text if not flat or text.startswith("(") else f"({text})"


def _node_text(treedef: Any, units: list[str], flat: bool = False) -> str:
    """:func:`state_structure` of one node; ``""`` for a node without leaves."""
    if treedef.num_leaves == 0:
        return ""
    data = treedef.node_data()
    if data is None:
        return "*"
    kind, aux = data
    kids = [_node_text(c, units, flat) for c in treedef.children()]
    if flat and kind is tuple:  # only a tuple's text starts with "("
        kids = [c[1:-1] if c.startswith("(") else c for c in kids]
    if kind is dict:
        if units and sorted(aux) == units and len(set(kids)) == 1:  # e.g. Adam's mu
            return f"{{units: {kids[0]}}}"
        return "{" + ", ".join(f"{k}: {c}" for k, c in zip(aux, kids) if c) + "}"
    if kind in (tuple, list):
        inner = ", ".join(c for c in kids if c)
        return f"({inner})" if kind is tuple else f"[{inner}]"
    fields = getattr(kind, "_fields", None)
    if fields is not None and len(fields) == len(kids):
        inner = ", ".join(f"{f}={c}" for f, c in zip(fields, kids) if c)
        return f"{kind.__name__}({inner})"
    return f"{kind.__name__}(" + ", ".join(c for c in kids if c) + ")"


_ONEBIT_STATE_HYPER = ("b1", "b2", "eps")  # what m, v and v's bias correction follow


def check_optimizer(meta: dict, trainer: Trainer, opt_state: Any, where: str) -> None:
    """Refuses a checkpoint whose optimizer state another optimizer wrote.

    For the same ``qgz_target`` (no conversion): 1-bit Adam's ``b1``, ``b2``
    and ``eps`` must be the checkpoint's; an optax optimizer's state
    structure must be (``opt_state``: the trainer's, abstract), up to how
    its chains nest (``state_flat``, recorded by checkpoints since stop 51:
    a stateless step such as clipping may be put in front of Adam). The learning
    rate, its schedule's values and ``clip_norm`` may change. A checkpoint
    written before the optimizer was recorded is not checked.
    """
    stored = meta.get("optimizer") or {}
    if isinstance(trainer.optimizer, OneBitAdam):
        if stored.get("name") != "onebit_adam":
            return
        ours = trainer.optimizer
        changed = [k for k in _ONEBIT_STATE_HYPER if float(stored[k]) != float(getattr(ours, k))]
        if changed:
            old = ", ".join(f"{k}={stored[k]}" for k in changed)
            new = ", ".join(f"{k}={getattr(ours, k)}" for k in changed)
            raise CheckpointMismatchError(
                f"{where} was written by 1-bit Adam with {old}, the trainer's has {new}: its "
                "m and v (and v's bias correction 1 - b2**v_count) were accumulated with "
                f"the checkpoint's. Build zeropp_jax.onebit_adam with {old} (the learning "
                "rate and clip_norm may change)")
        return
    recorded, flat = stored.get("state"), stored.get("state_flat")
    current = state_structure(opt_state, trainer.layout.names)
    if flat is not None and flat == state_structure(opt_state, trainer.layout.names, True):
        return  # the same states, chains nested otherwise (the restore pairs them)
    if recorded is not None and recorded != current:
        raise CheckpointMismatchError(
            f"{where} was written with another optimizer: its optax state is {recorded}, "
            f"the trainer's optimizer makes {current} (states without arrays left out). "
            "Build the trainer with the checkpoint's optimizer: the same stateful "
            "transformations in the same order. The learning rate and a schedule's values "
            "may change, but a schedule in place of a constant learning rate (or the other "
            "way round) adds (or removes) a step count in the state")
