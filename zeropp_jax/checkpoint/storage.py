"""The three Orbax items of one step directory: write them, read them back.

``DIR/<step>/{params, opt_state, meta}``: two PyTree items and one JSON
item.  Every read failure becomes a :class:`CheckpointError` naming the
step directory, so callers can tell "unreadable" from "does not fit".
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from zeropp_jax.checkpoint.errors import CheckpointError
from zeropp_jax.checkpoint.metadata import check_meta, flat_with_keys, key_name
from zeropp_jax.step.state import TrainState

PARAMS = "params"
OPT = "opt_state"
META = "meta"

# Restore args reading a stored leaf to host numpy (whatever its sharding).
NUMPY = ocp.RestoreArgs(restore_type=np.ndarray)


def item_handlers() -> dict:
    """Orbax handlers of the three items (for ``CheckpointManager``)."""
    return {
        PARAMS: ocp.PyTreeCheckpointHandler(),
        OPT: ocp.PyTreeCheckpointHandler(),
        META: ocp.JsonCheckpointHandler(),
    }


def save_items(manager: ocp.CheckpointManager, step: int, state: TrainState, meta: dict) -> bool:
    """Starts writing ``state`` and ``meta`` as step ``step``; ``False`` if Orbax declined."""
    return manager.save(
        step,
        args=ocp.args.Composite(**{
            PARAMS: ocp.args.PyTreeSave(state.params),
            OPT: ocp.args.PyTreeSave(state.opt_state),
            META: ocp.args.JsonSave(meta),
        }),
        force=True,
    )


def read_meta(manager: ocp.CheckpointManager, step: int, step_dir: str) -> dict:
    """The checked JSON metadata of step ``step`` (see :func:`check_meta`)."""
    path = os.path.join(step_dir, META)
    try:
        meta = manager.restore(
            step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        )[META]
    except Exception as e:  # noqa: BLE001 - any read failure means unreadable
        raise _unreadable(step, step_dir, f"its metadata {path}", e) from e
    return check_meta(meta, step, path)


def read_item_trees(manager: ocp.CheckpointManager, step: int, step_dir: str) -> dict[str, Any]:
    """Orbax's stored metadata tree (shapes, dtypes) of each array item."""
    try:
        items = manager.item_metadata(step)
        trees = {name: items[name].tree for name in (PARAMS, OPT)}
    except Exception as e:  # noqa: BLE001
        raise _unreadable(step, step_dir, "the array metadata of its params/opt_state", e) from e
    return trees


def read_arrays(
    manager: ocp.CheckpointManager, step: int, step_dir: str, restore_args: dict
) -> dict:
    """Reads array items.

    Args:
      restore_args: item name -> ``(stored tree, keyed args)``; ``keyed``
        maps each stored leaf's key (:func:`flat_with_keys
        <zeropp_jax.checkpoint.metadata.flat_with_keys>`) to its Orbax
        restore args, or to ``None`` to skip it.

    Returns:
      item name -> the restored tree (skipped leaves are placeholders).
    """
    composite = {}
    for name, (stored_tree, keyed) in restore_args.items():
        item, args = _item_and_args(stored_tree, keyed)
        composite[name] = ocp.args.PyTreeRestore(item=item, restore_args=args)
    try:
        return manager.restore(step, args=ocp.args.Composite(**composite))
    except Exception as e:  # noqa: BLE001
        drop_late_read_callbacks()
        raise _unreadable(step, step_dir, "its array data", e) from e


def drop_late_read_callbacks() -> None:
    """Keeps the reads a failed restore left in flight from printing tracebacks.

    When one array of a step cannot be read, Orbax's restore raises at once
    and closes its event loop while TensorStore's other reads of that step
    are still running; each one that completes later posts its result into
    the closed loop, and Python prints "RuntimeError: Event loop is closed"
    through ``sys.unraisablehook`` (several tracebacks after the one-line
    warning, about every other run). Installed after the first failed read,
    for the rest of the process (the late reads may complete at any time): a
    hook that drops exactly those errors (:func:`is_late_read_callback`: a
    callback posted with ``call_soon_threadsafe`` to a loop already closed,
    which no code can receive any more; the error reports nothing but that)
    and hands every other unraisable exception to the hook it replaced.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_late_read_callbacks", False):
        return

    def hook(unraisable):
        if not is_late_read_callback(unraisable):
            previous(unraisable)

    hook.drops_late_read_callbacks = True
    sys.unraisablehook = hook


def is_late_read_callback(unraisable) -> bool:
    """Whether an unraisable exception is asyncio refusing a callback of a closed
    loop (``loop.call_soon_threadsafe`` after ``loop.close()``)."""
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(unraisable.exc_traceback)]
    return "call_soon_threadsafe" in frames


def read_to_host(manager: ocp.CheckpointManager, step: int, step_dir: str, name: str) -> Any:
    """Reads every leaf of array item ``name`` to host numpy (its stored shapes)."""
    tree = read_item_trees(manager, step, step_dir)[name]
    args = {k: NUMPY for k in flat_with_keys(tree)}
    return read_arrays(manager, step, step_dir, {name: (tree, args)})[name]


def _unreadable(step: int, step_dir: str, what: str, cause: Exception) -> CheckpointError:
    """One line for a step that cannot be read; Orbax's own error (often a
    whole TensorStore spec) is only chained to it, as its cause."""
    return CheckpointError(
        f"checkpoint step {step} ({step_dir}): {what} cannot be read "
        f"({type(cause).__name__}, chained as the cause): its files are missing, "
        "truncated or corrupted. Restore an earlier step (without a step, restore "
        f"takes the newest readable one), or move {step_dir} aside")


def _item_and_args(stored_tree: Any, keyed: dict[tuple[str, ...], Any]):
    """Orbax ``item`` and ``restore_args`` shaped like the stored tree.

    ``keyed`` maps each stored leaf's key to its restore args, or to ``None``
    to skip reading it (the leaf comes back as a placeholder).
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(stored_tree)
    items, args = [], []
    for path, leaf in leaves:
        a = keyed[tuple(key_name(k) for k in path)]
        items.append(ocp.PLACEHOLDER if a is None else leaf)
        args.append(ocp.PLACEHOLDER if a is None else a)
    return (
        jax.tree_util.tree_unflatten(treedef, items),
        jax.tree_util.tree_unflatten(treedef, args),
    )
