"""``zeropp-train --eval-data``: the loss on held-out tokens during a run.

The held-out rows are the file's first ``--eval-rows`` non-overlapping windows
of ``seq_len + 1`` tokens (fewer where the file is shorter), the same on every
process and at every evaluation, so the losses of one run, and of two runs of
one command, compare. :func:`loss` runs them ``--batch-size`` rows at a time
through :meth:`Trainer.evaluate <zeropp_jax.step.trainer.Trainer.evaluate>`
(the model as the step's forward runs it, qwZ's codes included; the last
chunk may be partial) and reports the mean over all rows, each row weighing
the same. On several processes the rows are cut to a multiple of
``--batch-size`` (each process passes its share of every chunk), said at start.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, NamedTuple

import numpy as np

from zeropp_jax import data
from zeropp_jax.cli import common

DEFAULT_ROWS = 64  # held-out windows: 8 k tokens at the default --seq-len 128


def add_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("held-out loss")
    g.add_argument(
        "--eval-data", default=None, metavar="FILE",
        help="a text or .npy token file read as --data is (its ids below the "
        "vocabulary), kept out of training: its loss is measured after the last "
        "step (and every --eval-every steps), logged as eval_loss",
    )
    g.add_argument(
        "--eval-every", type=common.positive_int, default=None, metavar="N",
        help="also measure the held-out loss every N steps (default: only after the last)",
    )
    g.add_argument(
        "--eval-rows", type=common.positive_int, default=None, metavar="N",
        help=f"held-out windows of --seq-len + 1 tokens, from the file's start "
        f"(default: {DEFAULT_ROWS}, fewer if the file is shorter; on several processes "
        "a multiple of --batch-size)",
    )


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors: ``--eval-every`` or ``--eval-rows`` without ``--eval-data``."""
    if args.eval_data is None:
        for flag, value in (("--eval-every", args.eval_every), ("--eval-rows", args.eval_rows)):
            if value is not None:
                parser.error(f"{flag} needs --eval-data (add --eval-data FILE, or leave {flag} out)")


class HeldOut(NamedTuple):
    """The held-out rows and when they are evaluated.

    Attributes:
      rows: int32 ``(n, seq_len + 1)``, the same on every process.
      every: evaluate after every this many steps (``None``: after the last only).
      batch_size: rows per :meth:`Trainer.evaluate` call (the global batch).
      cut: rows of the file left out so that they divide into ``batch_size``
        on several processes (0 on one).
    """

    rows: np.ndarray
    every: int | None
    batch_size: int
    cut: int

    def due(self, done: int, steps: int) -> bool:
        """Whether the state after ``done`` steps (of ``steps``) is evaluated."""
        return done == steps or bool(self.every and done % self.every == 0)


def load(args: argparse.Namespace, vocab: int, process_count: int = 1) -> HeldOut | None:
    """The held-out rows of ``--eval-data`` (``None`` without it).

    Raises:
      ValueError, FileNotFoundError: a file :func:`~zeropp_jax.data.load_tokens`
        refuses, ids at or above ``vocab``, fewer than ``seq_len + 1`` tokens,
        or (several processes) fewer windows than ``--batch-size``.
    """
    if args.eval_data is None:
        return None
    tokens, _ = data.load_tokens(args.eval_data, vocab_size=vocab)
    width = args.seq_len + 1
    n = min(args.eval_rows or DEFAULT_ROWS, len(tokens) // width)
    if n == 0:
        raise ValueError(f"--eval-data {args.eval_data} holds {len(tokens)} tokens, fewer than "
                         f"one window of --seq-len + 1 = {width}")
    kept = n if process_count == 1 else n // args.batch_size * args.batch_size
    if kept == 0:
        raise ValueError(
            f"--eval-data {args.eval_data} holds {n} windows of {width} tokens, fewer than "
            f"--batch-size {args.batch_size}: on {process_count} processes the held-out "
            "rows are evaluated a whole batch at a time")
    rows = np.asarray(tokens[: kept * width], np.int32).reshape(kept, width)
    return HeldOut(rows, args.eval_every, args.batch_size, n - kept)


def start_warnings(args: argparse.Namespace, held_out: HeldOut | None, processes: int) -> list[str]:
    """What a run's start says of its held-out rows: rows cut, or none held out."""
    if held_out is None:
        return []
    said = [f"--eval-data: {held_out.cut} held-out rows left out, so that the rest divide into "
            f"--batch-size {args.batch_size} on {processes} processes"] if held_out.cut else []
    if args.data is not None and os.path.realpath(args.eval_data) == os.path.realpath(args.data):
        said.append(f"--eval-data {args.eval_data} is the --data file: its windows are "
                    "trained on, so their loss is not a held-out one")
    return said


def loss_or_problem(trainer: Any, state: Any, held_out: HeldOut) -> tuple[float | None, str | None]:
    """``(loss(...), None)``, or ``(None, what went wrong)``: the evaluation
    raised (out of memory, a compile error) or its loss is not finite."""
    try:
        value = loss(trainer, state, held_out)
    except Exception as e:  # noqa: BLE001 - said, after the run's steps are saved
        return None, f"the held-out evaluation failed: {type(e).__name__}: {e}"
    if not math.isfinite(value):
        return None, (f"the held-out loss is {value}: the model gives non-finite "
                      "values on the held-out rows")
    return value, None


def loss(trainer: Any, state: Any, held_out: HeldOut) -> float:
    """The mean loss of the held-out rows at ``state`` (a Python float: each of
    the ``len(held_out.rows)`` rows weighing the same; every process calls it).

    Args:
      trainer: the run's :class:`~zeropp_jax.step.trainer.Trainer`.
      state: its :class:`~zeropp_jax.step.state.TrainState` (not consumed).
      held_out: from :func:`load`.
    """
    import jax

    total, n = 0.0, len(held_out.rows)
    for lo in range(0, n, held_out.batch_size):
        chunk = held_out.rows[lo: lo + held_out.batch_size]
        share = len(chunk) // jax.process_count()  # several processes: whole chunks only
        mine = chunk[jax.process_index() * share: (jax.process_index() + 1) * share]
        total += float(trainer.evaluate(state, mine)["loss"]) * len(chunk)
    return total / n
