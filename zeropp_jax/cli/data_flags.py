"""The data a command reads: ``--data``, ``--vocab-size``, ``--seq-len``, ``--seed``.

* :func:`data_vocab`: the model's vocabulary (``zeropp-comm`` and
  ``zeropp-simulate`` read no more of the data);
* :func:`load_batches`: ``zeropp-train``'s batches, its vocabulary and the
  data's :class:`~zeropp_jax.data.Fingerprint`, checked to be the same on
  every process of a multi-process run;
* :func:`data_change`: the data a resume reads against the checkpoint's.

Errors are ``ValueError`` naming the flag; the tools print them.
"""

from __future__ import annotations

import argparse
import os

from zeropp_jax import data


def _source(args: argparse.Namespace) -> str:
    return f"--data {args.data}" if args.data is not None else "the bundled data"


def data_vocab(args: argparse.Namespace) -> int:
    """``--vocab-size``, else ``--data``'s largest id + 1, else the byte
    vocabulary of the bundled data; ``ValueError`` naming the flag."""
    if args.data is None and (args.vocab_size or data.VOCAB_SIZE_BYTES) >= data.VOCAB_SIZE_BYTES:
        return args.vocab_size or data.VOCAB_SIZE_BYTES  # holds every byte: nothing to read
    try:
        return data.load_tokens(args.data, vocab_size=args.vocab_size)[1]
    except ValueError as e:
        raise ValueError(f"{_source(args)}: {e}") from None


def load_batches(args: argparse.Namespace) -> tuple[data.TokenBatches, int, data.Fingerprint]:
    """``(batches, vocab, fingerprint)`` of the command's data.

    The int32 stream :func:`~zeropp_jax.data.load_tokens` returns is let go
    once the batches hold their compact copy. On a multi-process run every
    process compares its fingerprint with the others'
    (:func:`zeropp_jax.agreement.differing`): processes that read different
    tokens (another file, another Python's standard library as the bundled
    data) would each sample windows from their own stream.
    """
    try:
        tokens, vocab = data.load_tokens(args.data, vocab_size=args.vocab_size)
    except ValueError as e:
        raise ValueError(f"{_source(args)}: {e}") from None
    fingerprint = data.fingerprint(tokens)
    try:
        batches = data.TokenBatches(
            tokens, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    except ValueError as e:  # too few tokens for one window
        raise ValueError(f"{_source(args)} with --seq-len {args.seq_len}: {e}") from None
    del tokens
    _check_same_on_every_process(fingerprint, args)
    return batches, vocab, fingerprint


def _check_same_on_every_process(fingerprint: data.Fingerprint, args: argparse.Namespace) -> None:
    from zeropp_jax import agreement

    other = agreement.differing({"data": str(fingerprint)}).get("data")
    if other:
        advice = ("file" if args.data is not None else "file with --data (the bundled data is "
                  "the standard library of each host's Python, which differs between Python "
                  "releases)")
        raise ValueError(
            f"{_source(args)}: processes {other} read other tokens than process 0 (this "
            f"process: {fingerprint}); give every process the same {advice}")


def data_change(record: dict, args: argparse.Namespace, fingerprint=None) -> str | None:
    """The warning for a resume that reads other data than the run that
    wrote the checkpoint (its ``record``, :func:`zeropp_jax.cli.guards.run_record`),
    or ``None``.

    With both fingerprints at hand the tokens decide (the same file moved
    is no change; the same path rewritten is one); else the paths, as
    absolute paths (``data/x`` and ``/abs/data/x`` are one file).
    ``fingerprint``: the command's data's, a
    :class:`~zeropp_jax.data.Fingerprint` or its fields as a list (as a
    record stores it), or ``None``.
    """
    old_path, new_path = record.get("data"), args.data
    if record.get("data_fingerprint") is not None and fingerprint is not None:
        old_print = data.Fingerprint(*record["data_fingerprint"])
        new_print = data.Fingerprint(*fingerprint)
        if old_print == new_print:
            return None
        return (f"--data {old_path} -> {new_path}: other tokens ({old_print} -> {new_print}), "
                "so the batches from here on are not those of the run it continues")
    if "data" not in record or _absolute(old_path) == _absolute(new_path):
        return None
    return f"--data {old_path} -> {new_path}"


def _absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)
