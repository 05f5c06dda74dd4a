"""The command line's data: --vocab-size, the data a resume reads, processes' data."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from zeropp_jax import data
from zeropp_jax.cli import data_flags, guards


def _args(**kw):
    base = dict(data=None, vocab_size=None, batch_size=4, seq_len=8, seed=0, lr=1e-3,
                lr_warmup=None, steps=10, preset="zero3", lr_schedule="cosine")
    return argparse.Namespace(**{**base, **kw})


def test_vocab_size_sizes_the_model_and_must_hold_every_id(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(100, dtype=np.uint16) % 150)
    path = str(tmp_path / "ids.npy")
    assert data_flags.data_vocab(_args(data=path)) == 100
    assert data_flags.data_vocab(_args(data=path, vocab_size=50257)) == 50257
    assert data_flags.data_vocab(_args()) == 256 and data_flags.data_vocab(_args(vocab_size=300)) == 300
    with pytest.raises(ValueError, match=r"--data .*ids.npy.*id 99.*vocab_size=50.*--vocab-size"):
        data_flags.data_vocab(_args(data=path, vocab_size=50))
    with pytest.raises(ValueError, match=r"the bundled data: .*vocab_size=100.*--vocab-size"):
        data_flags.data_vocab(_args(vocab_size=100))
    batches, vocab, fp = data_flags.load_batches(_args(data=path, vocab_size=512))
    assert vocab == 512 and fp == data.fingerprint(np.arange(100) % 150)
    assert batches.batch_at(0).shape == (4, 9)


def test_a_resume_is_warned_of_other_tokens_not_of_another_spelling_of_one_path(tmp_path,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = data.fingerprint(np.arange(500) % 7)
    new = data.fingerprint(np.arange(501) % 7)
    record = guards.run_record(_args(data="ids.npy"), {}, old)
    assert record["data_fingerprint"] == [500, old.blake2b]

    def changes(args, fp):
        return guards.resume_changes(record, args, {}, {}, {}, fp)[1]

    assert changes(_args(data="ids.npy"), old) == []
    assert changes(_args(data=str(tmp_path / "moved.npy")), old) == []  # same tokens
    (line,) = changes(_args(data="ids.npy"), new)  # the same path, rewritten
    assert "other tokens (500 tokens" in line and "501 tokens" in line
    # An older record (no fingerprint): paths, compared as absolute paths.
    del record["data_fingerprint"]
    assert changes(_args(data=str(tmp_path / "ids.npy")), new) == []
    assert changes(_args(data="other.npy"), new) == ["--data ids.npy -> other.npy"]


def test_another_vocabulary_on_resume_names_the_flag_and_value_to_pass():
    record = guards.run_record(_args(), {"vocab_size": 200})
    errors, _ = guards.resume_changes(record, _args(), {"vocab_size": 150}, {}, {})
    assert errors == ["the checkpoint's model has vocab_size=200, the command's 150 "
                      "(--vocab-size); pass --vocab-size 200 to resume the model it was "
                      "trained with"]


def test_processes_that_differ_are_named_key_by_key():
    """agreement.differing's comparison of the gathered hashes (two uint32
    per key, one row per process), as the flags and the data's fingerprint
    use it."""
    from zeropp_jax import agreement

    rows = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 4]], np.uint32)
    assert agreement.differing_rows(rows, ["data", "lr"]) == {"data": [3], "lr": [2]}
    assert agreement.differing_rows(rows[:2], ["data", "lr"]) == {}
    assert agreement.differing({"lr": "0.1"}) == {}  # one process: no collective


def test_a_coordinator_port_in_use_is_refused_before_jax_crashes_on_it():
    import socket

    from zeropp_jax import distributed

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} .*in use.*--coordinator"):
            distributed.initialize(f"127.0.0.1:{port}", 2, 0)
    distributed._check_port_free(f"127.0.0.1:{port}")  # free again
