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

from zeropp_jax.checkpoint.errors import CheckpointError, CheckpointMismatchError
from zeropp_jax.layout import LeafSpec, ParamLayout, UnitLayout
from zeropp_jax.mesh import mesh_shape
from zeropp_jax.step.onebit_adam import OneBitAdam
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
def describe_checkpoint(trainer: Trainer, step: int, extra_metadata: Mapping | None = None) -> dict:
    """The JSON stored with a checkpoint.

    Args:
      trainer: the trainer the state belongs to.
      step: the optimizer step of the state.
      extra_metadata: JSON-serializable caller data (model config, seed,
        data position, ...), stored under ``"extra"``.

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
        "optimizer": optimizer_to_json(trainer.optimizer),
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
    """Raises :class:`CheckpointMismatchError` unless the models agree."""
    current = layout_to_json(layout)
    old = {u["name"]: u for u in saved["units"]}
    new = {u["name"]: u for u in current["units"]}
    if list(old) != list(new):
        missing, unexpected = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        raise CheckpointMismatchError(
            f"{where}: the checkpoint's parameter units {list(old)} do not match the "
            f"trainer's {list(new)} (missing in the checkpoint: {missing}, not in the "
            f"model: {unexpected}); was it written for another model?"
        )
    if saved["whole_model"] != current["whole_model"]:
        raise CheckpointMismatchError(
            f"{where}: the checkpoint was written with per_layer="
            f"{not saved['whole_model']}, the trainer uses per_layer={not current['whole_model']}"
        )
    for name, u in new.items():
        o = old[name]
        if (o["numel"], o["stack"]) != (u["numel"], u["stack"]):
            raise CheckpointMismatchError(
                f"{where}: unit {name!r} has {o['numel']} parameters per layer x "
                f"{o['stack'] or 1} layers in the checkpoint but {u['numel']} x "
                f"{u['stack'] or 1} in the trainer's model"
            )
        for lo, ln in zip(o["leaves"], u["leaves"]):
            if (lo["path"], lo["shape"]) != (ln["path"], ln["shape"]):
                raise CheckpointMismatchError(
                    f"{where}: unit {name!r}: checkpoint leaf {lo['path']} {tuple(lo['shape'])} "
                    f"does not match the model's leaf {ln['path']} {tuple(ln['shape'])}"
                )
        if len(o["leaves"]) != len(u["leaves"]):
            raise CheckpointMismatchError(
                f"{where}: unit {name!r} has {len(o['leaves'])} leaves in the checkpoint "
                f"but {len(u['leaves'])} in the model"
            )


def check_qgz_target(meta: dict, trainer: Trainer, where: str) -> None:
    """Refuses a switch between 1-bit Adam's state and optax's.

    Used where no conversion is planned (:mod:`~zeropp_jax.checkpoint.convert`
    converts 1-bit Adam <-> optax Adam on restore)."""
    if meta["config"].get("qgz_target", "gradient") != trainer.config.qgz_target:
        raise qgz_target_mismatch(meta, trainer, where, "no conversion was asked for.")


def qgz_target_mismatch(meta: dict, trainer: Trainer, where: str, why: str) -> CheckpointMismatchError:
    """The error for a checkpoint of the other ``qgz_target`` that cannot be converted.

    Args:
      why: the reason the conversion does not apply (one sentence).
    """
    stored = meta["config"].get("qgz_target", "gradient")  # written before the field
    return CheckpointMismatchError(
        f"{where} was written with qgz_target={stored!r} (preset "
        f"{meta['config'].get('preset')!r}) and the trainer has "
        f"qgz_target={trainer.config.qgz_target!r}: their optimizer states differ (1-bit "
        "Adam's per-node m and v and two carries vs an optax state). Restore converts "
        "1-bit Adam's state into an optax Adam's (optax.adam inside the chain, same b1 and "
        f"b2) and back, but not here: {why} Build the trainer with "
        f"{_same_optimizer_flags(meta['config'])}; the presets qgz and zeropp meant "
        "qgz_target='gradient' before they ran 1-bit Adam"
    )


def _same_optimizer_flags(stored: dict) -> str:
    """zeropp-train flags that give a trainer the stored config's optimizer."""
    target = stored.get("qgz_target", "gradient")
    if target == "momentum":  # 1-bit Adam needs qgZ on and a warm-up
        flags = (f"--qgz {stored.get('qgz')} --qgz-target momentum "
                 f"--qgz-warmup {stored.get('qgz_warmup_steps')} "
                 f"--qgz-refresh-every {stored.get('qgz_refresh_every')}")
        return f"1-bit Adam: --preset {stored.get('preset')}, or {flags}"
    return "qgz_target='gradient' (--qgz-target gradient)"


def optimizer_to_json(optimizer: Any) -> dict:
    """The optimizer's hyperparameters that a conversion needs (see
    :mod:`~zeropp_jax.checkpoint.convert`): 1-bit Adam's ``b1``, ``b2``,
    ``eps`` and ``clip_norm``; an optax optimizer keeps its hyperparameters
    in closures, so only its name."""
    if isinstance(optimizer, OneBitAdam):
        return {"name": "onebit_adam", "b1": optimizer.b1, "b2": optimizer.b2,
                "eps": optimizer.eps, "clip_norm": optimizer.clip_norm}
    return {"name": "optax"}
