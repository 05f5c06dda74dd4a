"""``zeropp-train --checkpoint-dir``: the checkpoint directory opened, and a run resumed.

A run resumes from the newest readable checkpoint, after the command is
compared with the run that wrote it (:func:`~zeropp_jax.cli.guards.resume_changes`):
changes the state cannot follow are refused, others are warned about.
"""

from __future__ import annotations

import os
import sys

from zeropp_jax.cli import common, guards

PROG = "zeropp-train"


def open_checkpoints(args, trainer, is_main: bool, record_of_run: dict):
    """``(checkpointer or None, restored state or None, its metadata or None)``.

    The command is compared with the run recorded in the checkpoint it
    resumes from (:func:`~zeropp_jax.cli.guards.resume_changes`).
    """
    if args.checkpoint_dir is None:
        return None, None, None
    from zeropp_jax.checkpoint import CheckpointError, Checkpointer, CheckpointMismatchError
    from zeropp_jax.checkpoint.errors import QgzTargetMismatchError

    existed = os.path.isdir(args.checkpoint_dir)
    try:
        ckpt = Checkpointer(args.checkpoint_dir, max_to_keep=args.keep)
    except (ValueError, OSError) as e:
        common.fail(PROG, f"--checkpoint-dir {args.checkpoint_dir}: {e}")
    if not ckpt.all_steps():
        if args.resume:  # a mistyped directory would start over: said on stderr
            common.warn(PROG, [f"--resume: no checkpoint in {args.checkpoint_dir} ("
                               f"{'empty' if existed else 'a new directory'}); starting at step 0"])
        return ckpt, None, None
    if not args.resume:
        steps = ckpt.all_steps()
        ckpt.close()
        common.fail(
            PROG,
            f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (steps "
            f"{steps}); pass --resume to continue from the newest, or use another directory"
        )

    changed: list[str] = []  # the command's changes from the restored step's run

    def refuse(meta: dict) -> None:
        changed[:] = _refuse_changes(ckpt, meta, args, trainer, record_of_run)

    try:
        try:
            # The newest readable checkpoint: an unreadable newer one is skipped
            # (and set aside). The command is compared with its ``meta`` before
            # the state is built, so a refusal comes before any conversion notice.
            state, meta = ckpt.restore_with_metadata(trainer, check=refuse)
        except CheckpointMismatchError as e:
            # The command's own difference (model, schedule) says more.
            recorded = _newest_readable_meta(ckpt)
            if recorded is not None:
                refuse(recorded)
            if isinstance(e, QgzTargetMismatchError):
                raise CheckpointMismatchError(
                    f"{e}; with {PROG}: {_same_optimizer_flags(e.stored_config)}") from e
            raise
    except (CheckpointError, FileNotFoundError) as e:
        ckpt.close()
        common.fail(PROG, str(e))
    if is_main:
        print(
            f"zeropp-train: resumed from {ckpt.step_path(meta['step'])} (saved on mesh "
            f"{meta['mesh']['node']}x{meta['mesh']['local']}, preset "
            f"{meta['config']['preset']})", flush=True,
        )
        if changed:
            print(f"zeropp-train: warning: the run differs from the checkpoint's: "
                  f"{', '.join(changed)}", file=sys.stderr, flush=True)
    return ckpt, state, meta


def _newest_readable_meta(ckpt) -> dict | None:
    """The metadata of the newest checkpoint whose metadata reads, else ``None``."""
    from zeropp_jax.checkpoint import CheckpointError

    for step in reversed(ckpt.all_steps()):
        try:
            return ckpt.metadata(step)
        except CheckpointError:
            continue
    return None


def _refuse_changes(ckpt, meta: dict, args, trainer, record_of_run: dict) -> list[str]:
    """The command's changes from the run of checkpoint ``meta`` (warnings);
    raises ``CheckpointMismatchError`` for those the state cannot follow."""
    from zeropp_jax.checkpoint import CheckpointMismatchError

    errors, changed = guards.resume_changes(
        meta.get("extra", {}), args, record_of_run["model"],
        trainer.config.describe(), meta["config"],
        record_of_run.get("data_fingerprint"),
    )
    if errors:
        raise CheckpointMismatchError(
            f"cannot resume from {ckpt.step_path(meta['step'])}: " + "; ".join(errors)
        )
    return changed


def _same_optimizer_flags(stored: dict) -> str:
    """The flags that give a trainer the optimizer of a checkpoint's ``config``."""
    if stored.get("qgz_target", "gradient") == "momentum":  # 1-bit Adam: qgZ on, a warm-up
        flags = (f"--qgz {stored.get('qgz')} --qgz-target momentum "
                 f"--qgz-warmup {stored.get('qgz_warmup_steps')} "
                 f"--qgz-refresh-every {stored.get('qgz_refresh_every')}")
        return f"pass --preset {stored.get('preset')}, or {flags}"
    return "pass --qgz-target gradient"
