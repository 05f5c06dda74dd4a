"""Restoring 1-bit Adam's state as optax Adam's, and back.

A checkpoint of a 1-bit Adam preset (``qgz_target="momentum"``: ``qgz``,
``zeropp``, ``zeropp-max``) restores into a trainer whose optimizer is optax
Adam (``zero3``, ``hpz``, ... with ``optax.adam`` inside an
``optax.chain``), and the reverse, by converting the optimizer state on the
host while it is re-laid out (:mod:`~zeropp_jax.checkpoint.remesh`). The
conversion is announced once: a logged warning where it is exact, a
``UserWarning`` where a deferred quantity changes form; anything that does not fit is refused with
:class:`~zeropp_jax.checkpoint.errors.CheckpointMismatchError`.

Both optimizers divide the bias-corrected momentum by a preconditioner:
1-bit Adam's is ``d = sqrt(v / (1 - b2**v_count)) + eps`` (``v`` frozen
between full-precision steps, ``v_count`` the step of its last update),
optax Adam's ``sqrt(nu / (1 - b2**count)) + eps``.

1-bit Adam -> optax Adam (per unit; row 0 of the equal per-node rows):

* ``nu = v * (1 - b2**count) / (1 - b2**v_count)``: the same preconditioner;
* ``mu = m + d * c / b1``, with ``c = mean over nodes of the sender carry
  + the receiver carry``, the momentum that compression deferred, in units
  of the update ``u = m / d``. 1-bit Adam's next compressed step would send
  ``b1 * u + (1 - b1) * g / d + c``; optax's next momentum is
  ``b1 * mu + (1 - b1) * g``, which then holds the same ``d * c``. What
  differs: 1-bit Adam applies it through one more compressed exchange and
  only on its next compressed step (a refresh step keeps it waiting), so a
  non-zero carry is announced with a ``UserWarning`` naming its size. With
  ``b1 = 0`` there is no momentum to carry it and it is dropped (warned);
* ``count`` = 1-bit Adam's ``count``, also in a learning-rate schedule's
  state (``ScaleByScheduleState``), so the rate continues where it was.

optax Adam -> 1-bit Adam (exact): ``m = mu`` and ``v = nu`` on every node's
row, ``count = v_count = `` optax's count (so ``v``'s bias correction is
optax's), carries zero.

``optax.apply_if_finite`` around Adam (the counterpart of
``onebit_adam(skip_non_finite=True)``) converts either way: its counters,
which 1-bit Adam does not keep, start afresh (0 skips, last step finite)
or are dropped, named in the log line.

Hyperparameters. ``b1``, ``b2`` and ``eps`` are not in optax's state. 1-bit
Adam's are stored with the checkpoint (``meta["optimizer"]``); the target's
optax Adam's ``b1`` and ``b2`` are read back from two probe updates of its
optimizer on a 4-element tree (:func:`optax_adam_betas`) and must match
1-bit Adam's (the formulas above keep Adam's betas). ``eps`` cannot be read
from optax and is taken to be the same on both sides. In the other
direction none of them enters the formulas (``v = nu``); the new 1-bit Adam
runs on with its own, as any resume does.

Refused: an optax side without exactly one ``ScaleByAdamState`` (not Adam:
``optax.sgd``, AMSGrad, ...), optax state beyond Adam's and step counts,
a target whose Adam has other betas, and a checkpoint of gradient qgZ with
error feedback (its carry is deferred *gradient*, which 1-bit Adam's state
has no place for).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeropp_jax.checkpoint.errors import CheckpointMismatchError
from zeropp_jax.checkpoint.metadata import key_name, qgz_target_mismatch
from zeropp_jax.checkpoint.remesh import place, repack
from zeropp_jax.checkpoint.storage import NUMPY
from zeropp_jax.layout import params_shapes
from zeropp_jax.step.trainer import Trainer

log = logging.getLogger(__name__)

Key = tuple[str, ...]
_COUNT, _V_COUNT = ("inner", "count"), ("inner", "v_count")
_GRAD_RMS = ("qgz", "grad_rms")
_BETA_TOLERANCE = 1e-6  # the probe's float32 arithmetic; a coarser moment dtype widens it
# optax.apply_if_finite's counters (ApplyIfFiniteState) and their fresh values:
# 1-bit Adam's skip_non_finite keeps none, so they start afresh or are dropped.
_GUARD_FRESH = {"notfinite_count": 0, "last_finite": True, "total_notfinite": 0}


def converter_for(meta: dict, trainer: Trainer, where: str) -> Callable | None:
    """The optimizer-state planner for :func:`~zeropp_jax.checkpoint.remesh.plan_restore`.

    Returns:
      ``None`` when the checkpoint's ``qgz_target`` is the trainer's (no
      conversion), else ``convert(plan, stored, target, target_tree) ->
      (args, fill)``.

    Raises:
      CheckpointMismatchError: the conversion does not apply (see the
        module docstring).
    """
    stored = meta["config"].get("qgz_target", "gradient")
    if stored == trainer.config.qgz_target:
        return None
    if stored == "momentum":
        hyper, notices = _onebit_hyper(meta, trainer, where)
        return functools.partial(_onebit_to_adam, hyper, notices, where)
    if meta.get("error_feedback"):
        raise qgz_target_mismatch(
            meta, trainer, where, "its qgZ carry is gradient that compression deferred, "
            "which 1-bit Adam's state has no place for.")
    return functools.partial(_adam_to_onebit, meta, trainer, where)


# ------------------------------------------------------- hyperparameters
def optax_adam_betas(optimizer: optax.GradientTransformation) -> tuple[float, float, float] | None:
    """``(b1, b2, tolerance)`` of the one optax Adam in ``optimizer``, read back from its state.

    Two updates of a float32 ``(4,)`` probe tree with parameters of zeros: a
    gradient of ones, then zeros, so the second ``ScaleByAdamState`` holds
    ``b1 * mu`` and ``b2 * nu`` of the first (whatever clipping or rate
    comes around it; zero parameters give a weight decay in front of Adam
    nothing to add). ``tolerance`` is how far the read betas may be off:
    the probe's float32 arithmetic, or the rounding of a moment kept in a
    coarser dtype (``optax.adam(mu_dtype=jnp.bfloat16)``). ``None`` where
    the optimizer does not run on such a tree (e.g. it labels the unit names)
    or holds no single Adam there.

    Raises:
      Exception: what the optimizer raises on the probe if not a
        ``TypeError``, ``ValueError`` or ``KeyError`` (the ways an optimizer
        refuses a tree it does not take): a bug, not a refusal.
    """
    probed = _probe_adam(optimizer)
    return None if isinstance(probed, str) else probed


def _probe_adam(optimizer: optax.GradientTransformation) -> tuple[float, float, float] | str:
    """:func:`optax_adam_betas`, or why they could not be read (for the notice)."""
    x = {"probe": jnp.ones((4,), jnp.float32)}
    zeros = jax.tree.map(jnp.zeros_like, x)
    try:
        state = optimizer.init(zeros)
        _, first = optimizer.update(x, state, zeros)
        _, second = optimizer.update(zeros, first, zeros)
    except (TypeError, ValueError, KeyError) as e:  # it rejects the probe's tree
        first_line = (str(e).splitlines() or [""])[0]  # pytree errors run to many lines
        return f"its update of a (4,) probe tree raised {type(e).__name__}: {first_line}"
    if len(_adam_states(first)) != 1:
        return f"the probe's state has {len(_adam_states(first))} ScaleByAdamState"
    (a,), (b,) = _adam_states(first), _adam_states(second)
    mu, nu = float(a.mu["probe"][0]), float(a.nu["probe"][0])
    if mu == 0 or nu == 0:
        return "a gradient of ones left the probe's Adam moments at zero"
    # a ratio of two values each rounded to its dtype: off by up to ~2 ulps
    tolerance = max([_BETA_TOLERANCE] + [2 * float(jnp.finfo(m["probe"].dtype).eps)
                                         for m in (a.mu, a.nu)])
    return float(b.mu["probe"][0]) / mu, float(b.nu["probe"][0]) / nu, tolerance


def _onebit_hyper(meta: dict, trainer: Trainer, where: str) -> tuple[dict, list[str]]:
    """1-bit Adam's ``b1``, ``b2``, ``eps`` (stored), checked against the
    trainer's Adam, and the notices of what was assumed (warned when the
    state is filled, after the restore's checks)."""
    prefixes = _adam_states(_abstract_opt(trainer), paths=True)
    if len(prefixes) != 1:
        raise qgz_target_mismatch(
            meta, trainer, where, f"the trainer's optax state has {len(prefixes)} "
            "ScaleByAdamState (optax.adam and the like) where the conversion needs exactly one.")
    stored = meta.get("optimizer") or {}
    probed = _probe_adam(trainer.optimizer)
    failed = probed if isinstance(probed, str) else None
    betas, tolerance = (None, 0.0) if failed else (probed[:2], probed[2])
    notices = []
    if stored.get("name") == "onebit_adam":
        hyper = {k: float(stored[k]) for k in ("b1", "b2", "eps")}
    elif betas is not None:  # written before meta["optimizer"]
        hyper = {"b1": betas[0], "b2": betas[1], "eps": 1e-8}
        notices.append(f"{where} does not record 1-bit Adam's hyperparameters: taking b1, "
                       f"b2 = the trainer's optax Adam's {betas} and eps = 1e-8")
    else:
        raise qgz_target_mismatch(
            meta, trainer, where, "the checkpoint does not record 1-bit Adam's b1, b2 and "
            f"eps, and the trainer's optax Adam's could not be read back ({failed}).")
    if betas is None:
        notices.append(f"{where}: could not read b1 and b2 back from the trainer's optax "
                       f"optimizer ({failed}); converting with 1-bit Adam's {hyper} and "
                       "taking them to be the same")
    elif max(abs(betas[0] - hyper["b1"]), abs(betas[1] - hyper["b2"])) > tolerance:
        raise qgz_target_mismatch(
            meta, trainer, where, f"the checkpoint's 1-bit Adam has b1={hyper['b1']}, "
            f"b2={hyper['b2']} and the trainer's optax Adam b1={betas[0]:.6g}, "
            f"b2={betas[1]:.6g} (build it with the same betas).")
    return hyper, notices


# ------------------------------------------------------ 1-bit -> optax
def _onebit_to_adam(hyper: dict, notices: list[str], where: str, plan: Any,
                    stored: dict[Key, Any], target: dict[Key, Any], target_tree: Any):
    """Plans optax Adam's leaves from 1-bit Adam's (all read to host)."""
    (adam,) = _adam_states(target_tree.inner, paths=True)
    adam = ("inner",) + adam
    makers: list[Callable[[dict, dict], jax.Array]] = []
    for key, tgt in target.items():
        rel = key[len(adam):] if key[:len(adam)] == adam else ()
        if rel[:1] in (("mu",), ("nu",)) and len(rel) == 2 and rel[1] in plan.new_units:
            makers.append(functools.partial(_moment_maker, rel[0], rel[1], tgt, plan))
        elif _is_count(key, tgt):  # Adam's count, a schedule's count
            makers.append(lambda values, _, tgt=tgt: place(values[_COUNT], tgt))
        elif _is_guard(key, tgt):  # optax.apply_if_finite's: no skip seen yet
            makers.append(lambda values, _, tgt=tgt, fresh=_GUARD_FRESH[key[-1]]: place(
                np.asarray(fresh, tgt.dtype), tgt))
        elif key[:2] == ("qgz", "carry"):  # a gradient carry: nothing deferred yet
            makers.append(lambda values, _, tgt=tgt: place(np.zeros(tgt.shape, tgt.dtype), tgt))
        elif key == _GRAD_RMS:
            makers.append(lambda values, _, tgt=tgt: place(values[_GRAD_RMS], tgt))
        else:
            raise _unconvertible(where, "/".join(key), "the trainer's optax state")

    def fill(values: dict) -> list[jax.Array]:
        for notice in notices:
            warnings.warn(notice, stacklevel=2)
        moments = {name: _adam_moments(values, name, plan.old_nodes, hyper)
                   for name in plan.new_units}
        _announce_onebit_to_adam(where, values, moments, hyper)
        return [make(values, moments) for make in makers]

    return {k: NUMPY for k in stored}, fill


def _moment_maker(which: str, unit: str, tgt: Any, plan: Any, values: dict, moments: dict):
    old, new = plan.old_units[unit], plan.new_units[unit]
    return place(repack(moments[unit][which], old, new, tgt.dtype), tgt)


def _adam_moments(values: dict, unit: str, nodes: int, hyper: dict) -> dict:
    """optax Adam's ``mu``, ``nu`` of one unit (float64, the stored layout
    ``([L,] padded)``) and the deferred momentum ``d * c`` folded into ``mu``."""
    b1, b2, eps = hyper["b1"], hyper["b2"], hyper["eps"]
    count, v_count = int(values[_COUNT]), max(int(values[_V_COUNT]), 1)
    m = np.asarray(values[("inner", "m", unit)], np.float64)[0]
    v = np.asarray(values[("inner", "v", unit)], np.float64)[0]
    v_correction = 1.0 - b2**v_count
    carry = np.zeros_like(m)  # in units of the update u = m / d
    sender = values.get(("qgz", "carry", unit))
    if sender is not None:
        carry += np.asarray(sender, np.float64).sum(axis=0) / nodes
    receiver = values.get(("inner", "receiver_carry", unit))
    if receiver is not None:
        carry += np.asarray(receiver, np.float64)
    deferred = (np.sqrt(v / v_correction) + eps) * carry
    mu = m + deferred / b1 if b1 > 0 else m
    nu = v * (1.0 - b2**count) / v_correction
    return {"mu": mu, "nu": nu, "deferred": deferred}


def _announce_onebit_to_adam(where: str, values: dict, moments: dict, hyper: dict) -> None:
    count, v_count = int(values[_COUNT]), int(values[_V_COUNT])
    message = (
        f"{where}: restoring 1-bit Adam's state (count {count}, v from step {v_count}) as "
        "optax Adam's: mu = m + d * carries / b1, nu = v * (1 - b2**count) / "
        "(1 - b2**v_count) (zeropp_jax.checkpoint.convert)")
    largest = max(float(np.abs(m["deferred"]).max(initial=0.0)) for m in moments.values())
    if largest == 0.0:
        log.warning("%s; the carries are zero: exact", message)
        return
    if hyper["b1"] > 0:
        folded = (f"; FOLDED the error-feedback carries (momentum that compression deferred, "
                  f"largest |d * carry| = {largest:.3g}) into mu, so optax's next step "
                  "applies them at full precision where 1-bit Adam would have sent them on "
                  "its next compressed step")
    else:
        folded = (f"; DROPPED the error-feedback carries (largest |d * carry| = "
                  f"{largest:.3g}): with b1 = 0 Adam keeps no momentum to carry them")
    warnings.warn(message + folded, stacklevel=2)  # once: a warning, not also a log line


# ------------------------------------------------------ optax -> 1-bit
def _adam_to_onebit(meta: dict, trainer: Trainer, where: str, plan: Any,
                    stored: dict[Key, Any], target: dict[Key, Any], target_tree: Any):
    """Plans 1-bit Adam's leaves from optax Adam's (exact; read to host)."""
    del target_tree
    adam = _stored_adam_prefix(meta, trainer, where, stored, plan.new_units)
    count = adam + ("count",)
    read = {count, _GRAD_RMS} | {adam + (w, u) for w in ("mu", "nu") for u in plan.new_units}
    guards = [k for k in stored if _is_guard(k, stored[k])]  # dropped, and announced
    read |= set(guards)
    other = [k for k in stored if k not in read and not _is_count(k, stored[k])]
    if other:
        raise qgz_target_mismatch(
            meta, trainer, where, "the checkpoint's optax state has leaves beyond Adam's "
            f"and step counts ({['/'.join(k) for k in other][:4]}), which 1-bit Adam's "
            "state would drop.")
    makers = []
    for key, tgt in target.items():
        if key in (_COUNT, _V_COUNT):  # v's bias correction continues optax's
            makers.append(lambda values, tgt=tgt: place(values[count], tgt))
        elif key[:2] in (("inner", "m"), ("inner", "v")) and key[2] in plan.new_units:
            src = adam + ({"m": "mu", "v": "nu"}[key[1]], key[2])
            makers.append(functools.partial(_row_maker, src, key[2], tgt, plan))
        elif key[:2] in (("inner", "receiver_carry"), ("qgz", "carry")):
            makers.append(lambda values, tgt=tgt: place(np.zeros(tgt.shape, tgt.dtype), tgt))
        elif key == _GRAD_RMS:
            makers.append(lambda values, tgt=tgt: place(values[_GRAD_RMS], tgt))
        else:
            raise _unconvertible(where, "/".join(key), "1-bit Adam's state")

    def fill(values: dict) -> list[jax.Array]:
        log.warning(
            "%s: restoring optax Adam's state (count %d) as 1-bit Adam's: m = mu, v = nu, "
            "v_count = count, carries zero (exact; zeropp_jax.checkpoint.convert)%s",
            where, int(values[count]), _dropped_guards(values, guards))
        return [make(values) for make in makers]

    return {k: NUMPY if k in read else None for k in stored}, fill


def _row_maker(src: Key, unit: str, tgt: Any, plan: Any, values: dict) -> jax.Array:
    """A flat ``([L,] padded)`` moment as the equal per-node rows ``(nodes, [L,] padded)``."""
    host = repack(np.asarray(values[src]), plan.old_units[unit], plan.new_units[unit], tgt.dtype)
    return place(np.broadcast_to(host, tgt.shape), tgt)


def _stored_adam_prefix(meta: dict, trainer: Trainer, where: str,
                        stored: dict[Key, Any], units: dict) -> Key:
    """Where the stored optax state keeps Adam's ``count``, ``mu`` and ``nu``.

    Orbax's stored tree has the field names, not the types: Adam's state is
    the one prefix with ``count`` and a ``mu`` and ``nu`` per unit.
    """
    candidates = {k[:-2] for k in stored if len(k) >= 2 and k[-2] == "mu"}
    found = [p for p in sorted(candidates)
             if p + ("count",) in stored
             and all(p + (w, u) in stored for w in ("mu", "nu") for u in units)]
    if len(found) != 1:
        raise qgz_target_mismatch(
            meta, trainer, where, f"the checkpoint's optax state has {len(found)} Adam "
            "states (count, mu and nu per unit) where the conversion needs exactly one.")
    return found[0]


# ------------------------------------------------------------ helpers
def _adam_states(tree: Any, *, paths: bool = False) -> list:
    """The ``ScaleByAdamState`` nodes of an optax state (or their key paths)."""
    def is_adam(x):
        return isinstance(x, optax.ScaleByAdamState)

    nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_adam)
    found = [(tuple(key_name(k) for k in p), x) for p, x in nodes if is_adam(x)]
    return [p for p, _ in found] if paths else [x for _, x in found]


def _abstract_opt(trainer: Trainer) -> Any:
    """The trainer's optimizer state tree (shapes only)."""
    return trainer.abstract_state(params_shapes(trainer.layout)).opt_state.inner


def _is_count(key: Key, leaf: Any) -> bool:
    """A step count: Adam's or a learning-rate schedule's (an integer scalar)."""
    return key[-1] == "count" and tuple(leaf.shape) == () and jnp.issubdtype(leaf.dtype, jnp.integer)


def _is_guard(key: Key, leaf: Any) -> bool:
    """A counter of ``optax.apply_if_finite`` (a scalar named as in ``ApplyIfFiniteState``)."""
    return key[-1] in _GUARD_FRESH and tuple(leaf.shape) == ()


def _dropped_guards(values: dict, guards: list[Key]) -> str:
    """What a log line says of the ``apply_if_finite`` counters 1-bit Adam has no place for."""
    if not guards:
        return ""
    counts = {k[-1]: values[k].item() for k in guards}
    return (f"; dropped optax.apply_if_finite's counters {counts} (1-bit Adam skips non-finite "
            "steps with onebit_adam(skip_non_finite=True), without counters)")


def _unconvertible(where: str, name: str, what: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"{where}: {what} has leaf {name!r}, which the 1-bit Adam <-> optax Adam "
        "conversion does not make (zeropp_jax.checkpoint.convert)")
