"""Default training data and deterministic batching (numpy only).

The default corpus is real text that exists on every machine without network
access: the Python standard library's own ``.py`` sources, read as bytes.
Bytes are tokens (vocabulary of 256), so no tokenizer is needed.

Batches are random windows of ``seq_len + 1`` tokens whose start offsets are a
pure function of ``(seed, step)``. Batch ``k`` is therefore the same whoever
asks for it and in whatever order, which gives exact resumption after a restart
and lets several processes each take their own rows of one global batch without
talking to each other.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from typing import NamedTuple

import numpy as np

VOCAB_SIZE_BYTES = 256
# A .npy token file is recognised by its header, whatever its name.
NPY_MAGIC = b"\x93NUMPY"
NPZ_MAGIC = b"PK\x03\x04"  # a zip archive (np.savez)
# The largest vocabulary inferred as ``max id + 1`` (2**20 ids; the largest
# tokenizers have about 2**18): above it one stray id would size the embedding.
MAX_INFERRED_VOCAB = 2**20
# Leading bytes of compressed or archive files, which are never text.
_NOT_TEXT_MAGIC = {
    NPZ_MAGIC: "a zip archive", b"\x1f\x8b": "gzip-compressed",
    b"\xfd7zXZ\x00": "xz-compressed", b"\x28\xb5\x2f\xfd": "zstd-compressed",
}
# bzip2's header: "BZh" alone begins text too, so its block size digit and
# first block's magic (pi's digits 0x314159265359) are matched with it.
_BZIP2_HEADER = re.compile(rb"BZh[1-9]1AY&SY")
# How many leading bytes of a byte-token file are searched for a NUL byte:
# text holds none, while raw integer ids (nanoGPT's uint16 ``train.bin``) do
# wherever an id is below 256.
TEXT_PROBE_BYTES = 1 << 16
# numpy splits a larger seed into 32-bit words, so a seed of 2**32 or more
# would alias a smaller seed at another step (``default_rng([seed, step])``),
# and ``jax.random.key`` keeps only its low 32 bits without x64.
MAX_SEED = 2**32 - 1
# Token ids are hashed this many at a time (as little-endian int32) by
# :func:`fingerprint`.
_HASH_CHUNK = 1 << 22

# Directory names never descended into when collecting the default corpus:
# installed third-party packages, the standard library's own test suites
# (large, repetitive, partly binary fixtures) and byte-code caches.
_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def default_corpus(max_bytes: int = 4_000_000, *, root: str | None = None) -> np.ndarray:
    """Returns the Python standard library's ``.py`` sources as bytes.

    Files are visited in sorted order (directories walked top-down with sorted
    names), so the result is deterministic for a given Python installation.
    ``site-packages``/``dist-packages``, test directories (``test``, ``tests``,
    ``idle_test``), ``__pycache__`` and unreadable files are skipped. File
    contents are joined with a single newline byte and cut at ``max_bytes``.

    Args:
      max_bytes: upper bound on the corpus length in bytes; must be positive.
      root: directory to read instead of the standard library (for tests);
        defaults to ``sysconfig.get_paths()["stdlib"]``.

    Returns:
      uint8 array of shape ``(n,)`` with ``0 < n <= max_bytes``.

    Raises:
      ValueError: if ``max_bytes`` is not a positive integer.
      FileNotFoundError: if no readable, non-empty ``.py`` file was found.

    Example:
      >>> corpus = default_corpus(max_bytes=10_000)
      >>> corpus.dtype, corpus.shape
      (dtype('uint8'), (10000,))
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}.")
    if root is None:
        root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes the order in which os.walk descends.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    text = f.read(max_bytes - total)
            except OSError:
                continue
            if not text:
                continue
            if chunks:
                chunks.append(b"\n")
                total += 1
            chunks.append(text)
            total += len(text)
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(
            f"No readable, non-empty .py files found under {root!r} to build the default "
            "corpus; pass a token file path instead."
        )
    data = b"".join(chunks)[:max_bytes]
    return np.frombuffer(data, dtype=np.uint8).copy()


def _check_vocab(tokens: np.ndarray, vocab: int, source: str) -> None:
    top = int(tokens.max())
    if top >= vocab:
        raise ValueError(
            f"{source}: token id {top} is out of range for vocab_size={vocab}; "
            f"pass vocab_size >= {top + 1} (the tools' --vocab-size), or omit it to use "
            "max id + 1.")


def load_tokens(path: str | None, *, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """Loads a 1-D token stream and its vocabulary size.

    * ``None``: the default corpus (:func:`default_corpus`) as byte tokens.
    * a ``.npy`` file (recognised by its header, whatever its name): an
      integer array of token ids (flattened).
    * any other file: its raw bytes as tokens, if it is text: a file named
      ``.npy`` that is not one, a zip (``.npz``), gzip, bzip2, xz or zstd
      file, or one with a NUL byte in its first :data:`TEXT_PROBE_BYTES`
      (raw binary ids such as nanoGPT's ``train.bin``, which would train on
      the bytes of the ids) is refused, saying how to save the ids as
      ``.npy``.

    A ``.npy`` file is memory-mapped while it is checked, so the int32
    result is the only copy held.

    Args:
      path: file to read, or ``None`` for the default corpus.
      vocab_size: vocabulary size to use. For ``.npy`` files it defaults to
        ``max id + 1`` (at most :data:`MAX_INFERRED_VOCAB`); for byte tokens
        it defaults to 256. Every id must be below it.

    Returns:
      ``(tokens, vocab)``: tokens is int32 of shape ``(n,)`` with ``n >= 1`` and
      values in ``[0, vocab)``; vocab is a Python int.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: if the file is empty, not a regular file, not text (above),
        holds non-integer or negative ids, or ids ``>= vocab_size``; each
        message names the file.

    Example:
      >>> tokens, vocab = load_tokens(None)
      >>> tokens.dtype, vocab
      (dtype('int32'), 256)
    """
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size <= 0
    ):
        raise ValueError(f"vocab_size must be a positive integer or None, got {vocab_size!r}.")

    if path is None:
        tokens = default_corpus().astype(np.int32)
        vocab = VOCAB_SIZE_BYTES if vocab_size is None else int(vocab_size)
        _check_vocab(tokens, vocab, "default corpus")
        return tokens, vocab

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"Token file {path!r} does not exist.")
    if not os.path.isfile(path):
        raise ValueError(f"Token file {path!r} is not a regular file.")

    with open(path, "rb") as f:
        head = f.read(len(NPY_MAGIC))
    if head.startswith(NPZ_MAGIC) and path.lower().endswith(".npz"):
        raise ValueError(f"Token file {path!r} is a .npz archive; save the token ids as one "
                         "array with np.save (a .npy file)")
    if path.lower().endswith(".npy") and head != NPY_MAGIC:
        raise ValueError(f"Token file {path!r} is not a NumPy .npy file (it does not start with "
                         "the .npy header); save the ids with np.save, or give text without the "
                         ".npy suffix to train on its bytes")
    if head == NPY_MAGIC:  # an .npy file whatever its name
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:  # truncated, pickled objects, ...
            raise ValueError(f"Token file {path!r} cannot be read as a .npy array: {e}") from None
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"Token file {path!r} holds dtype {arr.dtype}; token ids must be an integer array "
                "(e.g. int32)."
            )
        arr = arr.reshape(-1)
        if arr.size == 0:
            raise ValueError(f"Token file {path!r} holds an empty array; it needs at least one token.")
        if int(arr.min()) < 0:
            raise ValueError(
                f"Token file {path!r} holds negative id {int(arr.min())}; token ids must be >= 0."
            )
        top = int(arr.max())
        if top > np.iinfo(np.int32).max:
            raise ValueError(f"Token file {path!r} holds id {top}, which does not fit in int32.")
        if vocab_size is None and top >= MAX_INFERRED_VOCAB:
            raise ValueError(
                f"Token file {path!r} holds id {top}: a vocabulary of {top + 1:,} ids (from "
                f"{len(np.unique(arr)):,} distinct ones) is above {MAX_INFERRED_VOCAB:,}; remap the "
                "ids to 0..n-1 (np.unique(ids, return_inverse=True)), or give the vocabulary "
                "(the tools' --vocab-size N; load_tokens(..., vocab_size=N))")
        vocab = top + 1 if vocab_size is None else int(vocab_size)
        tokens = np.asarray(arr.astype(np.int32))  # a plain array, not a np.memmap
    else:
        with open(path, "rb") as f:
            data = f.read(TEXT_PROBE_BYTES)  # checked before a large binary file is read
            if not data:
                raise ValueError(f"Token file {path!r} is empty; it needs at least one byte.")
            _check_text(data, path)
            data += f.read()
        tokens = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        vocab = VOCAB_SIZE_BYTES if vocab_size is None else int(vocab_size)
    _check_vocab(tokens, vocab, f"Token file {path!r}")
    return tokens, vocab


def _check_text(data: bytes, path: str) -> None:
    """Raises ``ValueError`` if ``data`` (the first bytes of a file, to be
    trained on as byte tokens) is evidently not text."""
    kind = next((k for magic, k in _NOT_TEXT_MAGIC.items() if data.startswith(magic)), None)
    if kind is None and _BZIP2_HEADER.match(data):
        kind = "bzip2-compressed"
    if kind is not None:
        raise ValueError(
            f"Token file {path!r} is {kind}, not text: its bytes are no tokens; decompress "
            "it, or save the token ids with np.save (a .npy file)")
    at = data.find(b"\0", 0, TEXT_PROBE_BYTES)
    if at >= 0:
        raise ValueError(
            f"Token file {path!r} is not text (a NUL byte at offset {at:,}): a file read as "
            "byte tokens must be text; save raw token ids as .npy with their dtype and pass "
            "that: np.save('train.npy', np.fromfile(path, np.uint16)) for nanoGPT's uint16 "
            "train.bin, np.uint8 to train on a binary file's bytes themselves")


class Fingerprint(NamedTuple):
    """A token stream's length and a hash of its ids (:func:`fingerprint`)."""

    tokens: int
    blake2b: str  # 16 hex digits

    def __str__(self) -> str:
        return f"{self.tokens:,} tokens, blake2b {self.blake2b}"


def fingerprint(tokens: np.ndarray) -> Fingerprint:
    """The length and an 8-byte BLAKE2b hash of a token stream (its ids as
    little-endian int32, whatever its dtype), which tells whether a resumed
    or multi-host run reads the same data as the run it continues or its
    peers."""
    tokens = np.asarray(tokens).reshape(-1)
    digest = hashlib.blake2b(digest_size=8)
    for lo in range(0, len(tokens), _HASH_CHUNK):
        digest.update(np.ascontiguousarray(tokens[lo:lo + _HASH_CHUNK], dtype="<i4").tobytes())
    return Fingerprint(len(tokens), digest.hexdigest())


def _compact(arr: np.ndarray) -> np.ndarray:
    """Integer ids ``arr`` as a new array of the smallest of uint8, uint16 and
    int32 that holds them (``ValueError`` for ids outside int32)."""
    lo, hi = int(arr.min()), int(arr.max())
    info = np.iinfo(np.int32)
    if lo < info.min or hi > info.max:
        raise ValueError(f"tokens hold id {lo if lo < info.min else hi}, outside int32.")
    for dtype in (np.uint8, np.uint16):
        if lo >= 0 and hi <= np.iinfo(dtype).max:
            return arr.astype(dtype)
    return arr.astype(np.int32)


def _is_int_in(value, lo: int, hi: int) -> bool:
    """Whether ``value`` is an integer (not a bool) in ``[lo, hi]``."""
    return (not isinstance(value, bool) and isinstance(value, (int, np.integer))
            and lo <= value <= hi)


def _check_positive_int(name: str, value) -> int:
    if not _is_int_in(value, 1, float("inf")):
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


class TokenBatches:
    """Deterministic random windows over a token stream.

    Batch ``step`` is a pure function of ``(tokens, seed, step)``: its window
    start offsets come from ``np.random.default_rng([seed, step])``. There is no
    iterator state, so batches can be requested in any order, by any process.

    Example:
      >>> tokens, _ = load_tokens(None)
      >>> batches = TokenBatches(tokens, batch_size=8, seq_len=128, seed=0)
      >>> batches.batch_at(0).shape
      (8, 129)
    """

    def __init__(self, tokens, *, batch_size: int, seq_len: int, seed: int):
        """Validates and stores the stream.

        Args:
          tokens: integer array-like of shape ``(n,)`` (ids within int32);
            copied, read-only, to the smallest of uint8, uint16 and int32
            that holds its ids (batches are int32).
          batch_size: rows per global batch, positive.
          seq_len: model sequence length, positive; windows hold
            ``seq_len + 1`` tokens (inputs plus shifted targets).
          seed: integer seed in ``[0, MAX_SEED]`` (``2**32 - 1``).

        Raises:
          ValueError: on non-positive sizes, a negative seed, a non-integer or
            non-1-D token array, or fewer than ``seq_len + 1`` tokens.
        """
        self._batch_size = _check_positive_int("batch_size", batch_size)
        self._seq_len = _check_positive_int("seq_len", seq_len)
        if not _is_int_in(seed, 0, MAX_SEED):
            raise ValueError(
                f"seed must be an integer from 0 to {MAX_SEED} (2**32 - 1), got {seed!r}: "
                "numpy splits a larger seed into 32-bit words, so it would draw another "
                "seed's batches.")
        self._seed = int(seed)
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}; flatten it first.")
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array, got dtype {arr.dtype}.")
        if len(arr) < self._seq_len + 1:
            raise ValueError(
                f"Need at least seq_len + 1 = {self._seq_len + 1} tokens for one window, but the "
                f"stream has only {len(arr)}; use a shorter seq_len or more data."
            )
        arr = _compact(arr)  # Always a copy: later edits to `tokens` cannot leak in.
        arr.setflags(write=False)
        self._tokens = arr

    @property
    def tokens(self) -> np.ndarray:
        """Read-only token stream, shape ``(n,)``, in the smallest of uint8,
        uint16 and int32 that holds its ids."""
        return self._tokens

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def seed(self) -> int:
        return self._seed

    def _starts(self, step: int) -> np.ndarray:
        if not _is_int_in(step, 0, MAX_SEED):
            raise ValueError(f"step must be an integer from 0 to {MAX_SEED}, got {step!r}.")
        rng = np.random.default_rng([self._seed, int(step)])
        # Exclusive upper bound: the last window ends exactly at len(tokens).
        high = len(self._tokens) - self._seq_len
        return rng.integers(0, high, size=self._batch_size)

    def _windows(self, starts: np.ndarray) -> np.ndarray:
        offsets = np.arange(self._seq_len + 1)
        return self._tokens[starts[:, None] + offsets[None, :]].astype(np.int32)

    def batch_at(self, step: int) -> np.ndarray:
        """Returns global batch number ``step``.

        Args:
          step: non-negative integer.

        Returns:
          int32 array of shape ``(batch_size, seq_len + 1)``.
        """
        return self._windows(self._starts(step))

    def local_batch_at(self, step: int, *, process_index: int, process_count: int) -> np.ndarray:
        """Returns this process's rows of global batch ``step``.

        Process ``i`` of ``p`` gets rows ``[i * B/p, (i + 1) * B/p)`` of
        ``batch_at(step)``, where ``B = batch_size``.

        Args:
          step: non-negative integer.
          process_index: integer in ``[0, process_count)``.
          process_count: positive integer dividing ``batch_size``.

        Returns:
          int32 array of shape ``(batch_size // process_count, seq_len + 1)``.

        Raises:
          ValueError: on a bad index/count or if ``batch_size`` is not divisible
            by ``process_count``.
        """
        process_count = _check_positive_int("process_count", process_count)
        if not _is_int_in(process_index, 0, process_count - 1):
            raise ValueError(
                f"process_index must be an integer in [0, {process_count}), got {process_index!r}."
            )
        if self._batch_size % process_count:
            raise ValueError(
                f"batch_size={self._batch_size} is not divisible by process_count={process_count}; "
                "choose a global batch size that is a multiple of the number of processes."
            )
        rows = self._batch_size // process_count
        lo = int(process_index) * rows
        return self._windows(self._starts(step)[lo : lo + rows])
