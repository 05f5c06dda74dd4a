"""``zeropp-train``'s guards: what a resume changes, divergence, output files.

Pure functions of flags, checkpoint metadata and losses (no JAX), so each
rule is tested on its own:

* :func:`resume_changes`: the command against the checkpoint's recorded
  run: errors where the state cannot follow (another model, learning-rate
  schedule or optimizer), warnings where the run changes (schedule, preset,
  data);
* :func:`start_warnings`: qgZ configured where no step of the run compresses,
  hpZ where its secondary is the whole model;
* :func:`diverged`: the divergence rule of the summary and the exit status;
* :func:`rewrite_metrics`: the metrics file (checked before any compile by
  :func:`zeropp_jax.files.output_problem`), rewritten atomically on resume.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Sequence

from zeropp_jax.cli.data_flags import data_change
from zeropp_jax.files import is_stream, write_file
from zeropp_jax.step.geometry import idle_features

# GPTConfig field -> the flag that sets it.
_MODEL_FLAGS = {
    "n_layers": "--layers",
    "d_model": "--d-model",
    "n_heads": "--heads",
    "seq_len": "--seq-len",
    "vocab_size": "--vocab-size",
}
# Recorded flags whose change alters the run but which the state can follow.
_RUN_FLAGS = ("lr", "lr_warmup", "steps", "seed", "batch_size", "data", "preset")

# The divergence rule (see diverged()).
DIVERGENCE_FACTOR = 2.0
EARLY_FRACTION = 0.1


def run_record(args: argparse.Namespace, model: dict, data_fingerprint=None) -> dict:
    """What a checkpoint records of the command (its metadata's ``"extra"``),
    with the :class:`~zeropp_jax.data.Fingerprint` of the data it reads."""
    return {
        "model": model,
        **{name: getattr(args, name) for name in _RUN_FLAGS},
        "lr_schedule": args.lr_schedule,
        **({"data_fingerprint": list(data_fingerprint)} if data_fingerprint else {}),
    }


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resume_changes(
    record: dict, args: argparse.Namespace, model: dict, config: dict, saved_config: dict,
    data_fingerprint=None,
) -> tuple[list[str], list[str]]:
    """How the command differs from the run that wrote a checkpoint.

    Args:
      record: the checkpoint's ``extra`` (:func:`run_record`; keys that an
        older checkpoint lacks are not compared).
      args: the command's flags.
      model: the command's model config (``dataclasses.asdict``).
      config: the command's ``ZeroConfig.describe()``.
      saved_config: the checkpoint's ``config``.
      data_fingerprint: the command's data's
        :class:`~zeropp_jax.data.Fingerprint` (``None``: paths compared).

    Returns:
      ``(errors, warnings)``: one line each. Errors: the model (its
      parameters would be read into another architecture) or the
      learning-rate schedule's kind (the optimizer state follows it).
      Warnings: a change between 1-bit Adam and optax Adam
      (``qgz_target``), whose state the restore converts or refuses
      (:mod:`zeropp_jax.checkpoint.convert`), and every other
      recorded flag that differs (``--steps`` only under the cosine
      schedule, whose shape it sets; ``--data`` by its tokens,
      :func:`~zeropp_jax.cli.data_flags.data_change`), naming old and new
      values.
    """
    errors, warnings = [], []
    old_model = record.get("model") or {}
    for field, flag in _MODEL_FLAGS.items():
        if field in old_model and field in model and old_model[field] != model[field]:
            errors.append(
                f"the checkpoint's model has {field}={old_model[field]}, the command's "
                f"{model[field]} ({flag}); pass {flag} {old_model[field]} to resume the "
                "model it was trained with"
            )
    old_schedule = record.get("lr_schedule")
    if old_schedule is not None and old_schedule != args.lr_schedule:
        errors.append(
            f"the checkpoint was trained with --lr-schedule {old_schedule} (its optimizer "
            f"state follows it), the command has {args.lr_schedule}; pass --lr-schedule "
            f"{old_schedule}"
        )
    old_target = saved_config.get("qgz_target", "gradient")
    if old_target != config.get("qgz_target", "gradient"):
        # The library converts 1-bit Adam's state to optax Adam's and back
        # (zeropp_jax.checkpoint.convert) and refuses where it cannot.
        warnings.append(
            f"optimizer state converted: qgz_target {old_target} (preset "
            f"{saved_config.get('preset')}) -> {config.get('qgz_target')} (preset "
            f"{config.get('preset')})"
        )
    data = data_change(record, args, data_fingerprint)
    if data:
        warnings.append(data)
    for name in _RUN_FLAGS:
        if name == "data" or (name == "steps" and args.lr_schedule != "cosine"):
            continue
        if name in record and record[name] != getattr(args, name):
            warnings.append(f"{_flag(name)} {record[name]} -> {getattr(args, name)}")
    return errors, warnings


def start_warnings(trainer, steps: int) -> list[str]:
    """What ``zeropp-train`` warns of before a ``steps``-step run of
    ``trainer``: qgZ configured where no step of the run will compress, and
    hpZ where its secondary partition is the whole model on every device or,
    on one node, a second copy of the master shards."""
    qgz, schedule = trainer.config.qgz, trainer.schedule
    said = {  # idle_features' names, in the flags' words
        "hpz_one_device_per_node": "one device per node: hpZ's secondary partition (split over "
                                   "the devices of a node) is the whole model on every device "
                                   "(--no-hpz saves that memory; a mesh with LOCAL >= 2 splits it)",
        "hpz_one_node": "one node: hpZ's per-layer gathers stay inside a node anyway, so its "
                        "secondary partition only adds a copy of the master shards (--no-hpz "
                        "saves it)",
        "qgz_one_node": f"one node: qgZ ({qgz}) compresses only what crosses nodes, so no step "
                        "of this run is compressed (--mesh NODESxLOCAL with NODES >= 2 for it)",
    }
    idle = idle_features(trainer.config, trainer.nodes, trainer.local)
    out = [said[name] for name in idle]
    if "qgz_one_node" not in idle and schedule.active and schedule.warmup_steps >= steps:
        out.append(f"qgZ's full-precision warm-up ({schedule.warmup_steps} steps) is not "
                   f"shorter than --steps {steps}: no step will be compressed (--qgz-warmup "
                   "sets it)")
    return out


def diverged(losses: Sequence[float]) -> bool:
    """The divergence rule: the run ended far above where it started.

    True when the final loss exceeds both the first loss and
    ``DIVERGENCE_FACTOR`` (2) times the lowest loss of the first
    ``EARLY_FRACTION`` (10%, at least one) of the steps, or is not finite.
    A resumed run applies the rule to the steps it took.
    """
    if not losses:
        return False
    final = losses[-1]
    if not math.isfinite(final):
        return True
    early = min(losses[: max(1, int(len(losses) * EARLY_FRACTION))])
    return final > losses[0] and final > DIVERGENCE_FACTOR * early


def rewrite_metrics(path: str, first_step: int) -> None:
    """Keeps one line per step below ``first_step`` (the newest of duplicates), atomically.

    A resumed run re-takes the steps from ``first_step`` on, so their lines
    (and any half-written line of a killed run) go; the file is replaced by
    a rename, so a kill during the rewrite leaves the old file whole. A
    stream (a named pipe, ``/dev/stdout``) is left alone: the run appends.
    """
    if is_stream(path):
        return
    kept: dict[int, str] = {}
    if first_step > 0 and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(step, int) and 0 <= step < first_step:
                    kept[step] = line if line.endswith("\n") else line + "\n"
    write_file(path, "".join(kept[s] for s in sorted(kept)).encode())
