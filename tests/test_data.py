"""Tests for zeropp_jax.data."""

import os

import numpy as np
import pytest

from zeropp_jax import data


# --- default_corpus ---------------------------------------------------------


def test_default_corpus_is_deterministic_printable_python():
    a = data.default_corpus(max_bytes=200_000)
    b = data.default_corpus(max_bytes=200_000)
    assert a.dtype == np.uint8
    assert a.shape == (200_000,)  # the stdlib is far larger than this
    np.testing.assert_array_equal(a, b)
    printable = (a >= 32) & (a < 127) | (a == ord("\n")) | (a == ord("\t")) | (a == ord("\r"))
    assert printable.mean() > 0.97
    text = a.tobytes()
    assert b"def " in text and b"import " in text


def test_default_corpus_prefix_is_stable_across_sizes():
    small = data.default_corpus(max_bytes=5_000)
    large = data.default_corpus(max_bytes=50_000)
    np.testing.assert_array_equal(small, large[:5_000])


def test_default_corpus_walk_order_and_skips(tmp_path):
    def write(rel, content):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)

    write("b.py", b"BBB")
    write("a.py", b"AAA")
    write("notes.txt", b"not python")
    write("empty.py", b"")
    write("pkg/c.py", b"CCC")
    write("test/t.py", b"TEST")
    write("pkg/tests/t.py", b"TESTS")
    write("idlelib/idle_test/t.py", b"IDLE")
    write("site-packages/x.py", b"SITE")
    write("__pycache__/y.py", b"CACHE")
    out = data.default_corpus(max_bytes=1000, root=str(tmp_path)).tobytes()
    assert out == b"AAA\nBBB\nCCC"
    out = data.default_corpus(max_bytes=5, root=str(tmp_path)).tobytes()
    assert out == b"AAA\nB"


def test_default_corpus_skips_unreadable(tmp_path):
    (tmp_path / "a.py").write_bytes(b"AAA")
    # A dangling symlink named like a source file cannot be opened.
    os.symlink(tmp_path / "missing_target", tmp_path / "b.py")
    assert data.default_corpus(max_bytes=100, root=str(tmp_path)).tobytes() == b"AAA"


def test_default_corpus_errors(tmp_path):
    (tmp_path / "readme.txt").write_bytes(b"hello")
    with pytest.raises(FileNotFoundError, match="No readable"):
        data.default_corpus(root=str(tmp_path))
    with pytest.raises(ValueError, match="max_bytes"):
        data.default_corpus(max_bytes=0)


# --- load_tokens ------------------------------------------------------------


def test_load_tokens_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello\xff\x01")
    tokens, vocab = data.load_tokens(str(path))
    assert vocab == data.VOCAB_SIZE_BYTES == 256
    assert tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, [104, 101, 108, 108, 111, 255, 1])


def test_load_tokens_npy(tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.array([[3, 1], [4, 1]], dtype=np.int64))
    tokens, vocab = data.load_tokens(str(path))
    assert tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, [3, 1, 4, 1])
    assert vocab == 5
    tokens, vocab = data.load_tokens(str(path), vocab_size=10)
    assert vocab == 10
    np.testing.assert_array_equal(tokens, [3, 1, 4, 1])


def test_load_tokens_npy_out_of_range(tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.array([0, 7, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="7.*vocab_size=5"):
        data.load_tokens(str(path), vocab_size=5)


def test_load_tokens_npy_bad_contents(tmp_path):
    neg = tmp_path / "neg.npy"
    np.save(neg, np.array([1, -2], dtype=np.int32))
    with pytest.raises(ValueError, match="negative"):
        data.load_tokens(str(neg))
    flt = tmp_path / "float.npy"
    np.save(flt, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="integer"):
        data.load_tokens(str(flt))


def test_load_tokens_knows_npy_by_its_header_and_refuses_what_is_not_token_ids(tmp_path):
    ids = np.array([3, 1, 4, 1], np.int32)
    np.save(tmp_path / "ids.npy", ids)
    (tmp_path / "ids.npy").rename(tmp_path / "ids.NPY")  # another name, the same file
    tokens, vocab = data.load_tokens(str(tmp_path / "ids.NPY"))
    np.testing.assert_array_equal(tokens, ids)
    assert vocab == 5
    (tmp_path / "text.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError, match=r"text.npy' is not a NumPy .npy file"):
        data.load_tokens(str(tmp_path / "text.npy"))
    np.savez(tmp_path / "ids.npz", ids=ids)
    with pytest.raises(ValueError, match=r"ids.npz' is a .npz archive; save the token ids as one"):
        data.load_tokens(str(tmp_path / "ids.npz"))
    sparse = ids.copy()
    sparse[1] = 10**9  # one stray id
    np.save(tmp_path / "sparse.npy", sparse)
    with pytest.raises(ValueError, match=r"a vocabulary of 1,000,000,001 ids \(from 4 distinct "
                       r"ones\) is above 1,048,576; remap"):
        data.load_tokens(str(tmp_path / "sparse.npy"))
    assert data.load_tokens(str(tmp_path / "sparse.npy"), vocab_size=10**9 + 1)[1] == 10**9 + 1


def test_load_tokens_missing_and_empty(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        data.load_tokens(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt"):
        data.load_tokens(str(empty))
    empty_npy = tmp_path / "empty.npy"
    np.save(empty_npy, np.zeros((0,), np.int32))
    with pytest.raises(ValueError, match="empty.npy"):
        data.load_tokens(str(empty_npy))


def test_load_tokens_byte_file_vocab_too_small(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="vocab_size=50"):
        data.load_tokens(str(path), vocab_size=50)


def test_load_tokens_default_corpus():
    tokens, vocab = data.load_tokens(None)
    assert vocab == 256
    assert tokens.dtype == np.int32 and tokens.ndim == 1
    assert 0 < len(tokens) <= 4_000_000
    assert tokens.min() >= 0 and tokens.max() < 256


# --- TokenBatches -----------------------------------------------------------


def _stream(n=1000):
    return np.arange(n, dtype=np.int32)


def test_batches_shape_dtype_and_windows():
    tokens = _stream()
    batches = data.TokenBatches(tokens, batch_size=6, seq_len=9, seed=1)
    b = batches.batch_at(3)
    assert b.shape == (6, 10) and b.dtype == np.int32
    # Windows are contiguous runs of the stream (here: consecutive integers).
    np.testing.assert_array_equal(np.diff(b, axis=1), np.ones((6, 9), np.int32))
    assert b.min() >= 0 and b.max() < len(tokens)


def test_batches_deterministic_and_order_independent():
    tokens = _stream()
    a = data.TokenBatches(tokens, batch_size=4, seq_len=8, seed=7)
    b = data.TokenBatches(tokens, batch_size=4, seq_len=8, seed=7)
    later_first = [b.batch_at(s) for s in (5, 2, 0)]
    np.testing.assert_array_equal(a.batch_at(0), later_first[2])
    np.testing.assert_array_equal(a.batch_at(2), later_first[1])
    np.testing.assert_array_equal(a.batch_at(5), later_first[0])
    np.testing.assert_array_equal(a.batch_at(5), a.batch_at(5))


def test_batches_differ_across_steps_and_seeds():
    tokens = _stream(100_000)
    a = data.TokenBatches(tokens, batch_size=8, seq_len=16, seed=0)
    c = data.TokenBatches(tokens, batch_size=8, seq_len=16, seed=1)
    assert not np.array_equal(a.batch_at(0), a.batch_at(1))
    assert not np.array_equal(a.batch_at(0), c.batch_at(0))


def test_batches_cover_the_last_window():
    tokens = _stream(11)  # exactly one window position
    batches = data.TokenBatches(tokens, batch_size=3, seq_len=10, seed=0)
    np.testing.assert_array_equal(batches.batch_at(0), np.tile(tokens, (3, 1)))


def test_batches_do_not_alias_input():
    tokens = _stream()
    batches = data.TokenBatches(tokens, batch_size=2, seq_len=4, seed=0)
    before = batches.batch_at(0)
    tokens[:] = -1
    np.testing.assert_array_equal(batches.batch_at(0), before)


def test_local_batch_at_slices_global_batch():
    batches = data.TokenBatches(_stream(), batch_size=8, seq_len=5, seed=3)
    global_batch = batches.batch_at(4)
    parts = [batches.local_batch_at(4, process_index=i, process_count=4) for i in range(4)]
    for i, part in enumerate(parts):
        assert part.shape == (2, 6) and part.dtype == np.int32
        np.testing.assert_array_equal(part, global_batch[2 * i : 2 * i + 2])
    np.testing.assert_array_equal(np.concatenate(parts), global_batch)


def test_local_batch_at_errors():
    batches = data.TokenBatches(_stream(), batch_size=6, seq_len=5, seed=0)
    with pytest.raises(ValueError, match="divisible"):
        batches.local_batch_at(0, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="process_index"):
        batches.local_batch_at(0, process_index=3, process_count=3)
    with pytest.raises(ValueError, match="process_count"):
        batches.local_batch_at(0, process_index=0, process_count=0)


def test_batches_constructor_errors():
    with pytest.raises(ValueError, match=r"11.*only 10"):
        data.TokenBatches(_stream(10), batch_size=2, seq_len=10, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        data.TokenBatches(_stream(), batch_size=0, seq_len=4, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        data.TokenBatches(_stream(), batch_size=2, seq_len=-1, seed=0)
    with pytest.raises(ValueError, match="seed"):
        data.TokenBatches(_stream(), batch_size=2, seq_len=4, seed=-1)
    with pytest.raises(ValueError, match="1-D"):
        data.TokenBatches(np.zeros((4, 4), np.int32), batch_size=2, seq_len=4, seed=0)
    batches = data.TokenBatches(_stream(), batch_size=2, seq_len=4, seed=0)
    with pytest.raises(ValueError, match="step"):
        batches.batch_at(-1)


# --- what is not text, big seeds, compact storage, fingerprints ---------------


@pytest.mark.parametrize("content,needle", [
    (np.arange(300, dtype=np.uint16).tobytes(), "NUL byte at offset 0"),  # nanoGPT's train.bin
    (b"PK\x03\x04" + b"x" * 40, "zip archive"),  # an .npz renamed
    (__import__("gzip").compress(b"some text " * 20, mtime=0), "gzip-compressed"),
    (b"text at first" + b"\0" * 4, "NUL byte at offset 13"),
])
def test_a_byte_file_that_is_not_text_is_refused_saying_how_to_save_ids(tmp_path, content, needle):
    path = tmp_path / "train.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=needle) as info:
        data.load_tokens(str(path))
    assert str(path) in str(info.value) and "np.save" in str(info.value)


def test_text_that_begins_like_a_bzip2_file_is_text(tmp_path):
    import bz2

    (tmp_path / "tag.txt").write_bytes(b"BZh is a tag, and this is text.\n")
    assert data.load_tokens(str(tmp_path / "tag.txt"))[0].size == 32
    (tmp_path / "c.bz2").write_bytes(bz2.compress(b"some text " * 20))
    with pytest.raises(ValueError, match="bzip2-compressed"):
        data.load_tokens(str(tmp_path / "c.bz2"))


def test_unreadable_npy_files_are_named(tmp_path):
    np.save(tmp_path / "objects.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    np.save(tmp_path / "cut.npy", np.arange(100, dtype=np.int32))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:200])
    for name in ("objects.npy", "cut.npy"):
        with pytest.raises(ValueError, match=f"{name}.*cannot be read as a .npy array"):
            data.load_tokens(str(tmp_path / name))


def test_seeds_and_steps_from_2_to_the_32_are_refused_since_they_would_alias():
    tokens = _stream()
    with pytest.raises(ValueError, match=r"seed must be an integer from 0 to 4294967295"):
        data.TokenBatches(tokens, batch_size=2, seq_len=4, seed=4 + 2**32)
    batches = data.TokenBatches(tokens, batch_size=2, seq_len=4, seed=data.MAX_SEED)
    with pytest.raises(ValueError, match="step"):
        batches.batch_at(2**32)
    # numpy would have drawn seed 4's step 7 for this seed's step 0:
    assert np.array_equal(np.random.default_rng([4 + 7 * 2**32, 0]).integers(0, 99, 5),
                          np.random.default_rng([4, 7]).integers(0, 99, 5))


@pytest.mark.parametrize("top,dtype", [(255, np.uint8), (256, np.uint16), (65535, np.uint16),
                                       (65536, np.int32)])
def test_batches_hold_the_stream_compactly_and_give_int32(top, dtype):
    tokens = np.arange(1000, dtype=np.int64) % 17
    tokens[5] = top
    batches = data.TokenBatches(tokens, batch_size=4, seq_len=8, seed=1)
    assert batches.tokens.dtype == dtype and not batches.tokens.flags.writeable
    np.testing.assert_array_equal(batches.tokens, tokens)
    out = batches.batch_at(3)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(
        out, data.TokenBatches(tokens.astype(np.int32), batch_size=4, seq_len=8, seed=1).batch_at(3))
    with pytest.raises(ValueError, match="outside int32"):
        data.TokenBatches(np.array([0, 2**31] * 20), batch_size=1, seq_len=4, seed=0)


def test_fingerprint_tells_streams_apart_whatever_their_dtype():
    tokens = np.arange(3000, dtype=np.int64) % 250
    fp = data.fingerprint(tokens)
    assert fp == data.fingerprint(tokens.astype(np.uint8)) == data.fingerprint(tokens.astype(">i4"))
    assert fp.tokens == 3000 and len(fp.blake2b) == 16 and str(fp).startswith("3,000 tokens")
    grown = np.append(tokens, 1)
    changed = tokens.copy()
    changed[-1] += 1
    assert len({fp, data.fingerprint(grown), data.fingerprint(changed)}) == 3
