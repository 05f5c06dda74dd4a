"""``zeropp-train --eval-data``: the held-out loss of a run (``zeropp_jax/cli/held_out.py``)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from zeropp_jax.cli import common, held_out, train

from _util import TRAIN, read_jsonl, run_cli

TINY = ("--no-progress", "--mesh", "2x4", "--layers", "2", "--d-model", "32", "--heads", "2",
        "--seq-len", "16", "--batch-size", "8", "--dtype", "fp32")


def _args(*flags):
    return train.build_parser().parse_args([*TINY, *flags])


def _text(path, n_bytes, seed=0):
    rng = np.random.default_rng(seed)
    path.write_bytes(bytes(rng.integers(32, 127, n_bytes).astype(np.uint8)))
    return str(path)


def test_held_out_rows_are_the_files_first_windows(tmp_path):
    data = _text(tmp_path / "val.txt", 17 * 10 + 5)
    loaded = held_out.load(_args("--eval-data", data, "--eval-rows", "64"), 256)
    tokens = np.frombuffer(open(data, "rb").read(), np.uint8)
    assert loaded.rows.shape == (10, 17) and loaded.rows.dtype == np.int32 and loaded.cut == 0
    np.testing.assert_array_equal(loaded.rows, tokens[:170].reshape(10, 17))
    assert held_out.load(_args("--eval-data", data, "--eval-rows", "3"), 256).rows.shape == (3, 17)
    # several processes: whole global batches only (8 rows), the rest said
    on_two = held_out.load(_args("--eval-data", data), 256, process_count=2)
    assert on_two.rows.shape == (8, 17) and on_two.cut == 2
    assert [on_two.due(d, 10) for d in (5, 10)] == [False, True]
    every = held_out.load(_args("--eval-data", data, "--eval-every", "4"), 256)
    assert [every.due(d, 10) for d in (3, 4, 8, 10)] == [False, True, True, True]
    assert held_out.load(_args(), 256) is None


def test_start_warnings_say_what_is_not_held_out(tmp_path):
    data = _text(tmp_path / "val.txt", 17 * 10)
    assert held_out.start_warnings(_args(), None, 1) == []
    args = _args("--eval-data", data, "--data", data)
    said = held_out.start_warnings(args, held_out.load(args, 256, process_count=2), 2)
    assert len(said) == 2 and "2 held-out rows left out" in said[0]
    assert "is the --data file" in said[1]
    with pytest.raises(SystemExit):  # nor may the metrics overwrite it
        train.main([*TINY, "--eval-data", data, "--metrics-out", data])


def test_an_evaluation_that_fails_or_is_not_finite_is_a_problem_said(tmp_path):
    loaded = held_out.load(_args("--eval-data", _text(tmp_path / "val.txt", 17 * 10)), 256)

    class Evaluates:  # a trainer's evaluate, giving ``value`` or raising it
        def __init__(self, value):
            self.value = value

        def evaluate(self, state, rows):
            if isinstance(self.value, Exception):
                raise self.value
            return {"loss": self.value}

    assert held_out.loss_or_problem(Evaluates(2.0), None, loaded) == (2.0, None)
    _, problem = held_out.loss_or_problem(Evaluates(float("nan")), None, loaded)
    assert "the held-out loss is nan" in problem
    _, problem = held_out.loss_or_problem(Evaluates(RuntimeError("RESOURCE_EXHAUSTED")), None, loaded)
    assert "failed: RuntimeError: RESOURCE_EXHAUSTED" in problem


def test_held_out_files_it_cannot_use_are_refused(tmp_path):
    short = _text(tmp_path / "short.txt", 16)
    with pytest.raises(ValueError, match="fewer than one window of --seq-len \\+ 1 = 17"):
        held_out.load(_args("--eval-data", short), 256)
    few = _text(tmp_path / "few.txt", 17 * 5)
    with pytest.raises(ValueError, match="5 windows .* fewer than --batch-size 8"):
        held_out.load(_args("--eval-data", few), 256, process_count=2)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(100, 400, dtype=np.int32))
    with pytest.raises(ValueError, match="300|399|vocab"):
        held_out.load(_args("--eval-data", str(ids)), 256)
    with pytest.raises(FileNotFoundError):
        held_out.load(_args("--eval-data", str(tmp_path / "missing.txt")), 256)


@pytest.mark.parametrize("flags", [("--eval-every", "5"), ("--eval-rows", "64")])
def test_eval_flags_need_eval_data(flags, capsys):
    with pytest.raises(SystemExit):
        train.main([*TINY, *flags])
    assert f"{flags[0]} needs --eval-data" in capsys.readouterr().err


@pytest.mark.slow
def test_a_runs_held_out_loss_is_the_saved_states(tmp_path):
    """``--eval-every 3`` over 6 steps: the loss after steps 3 and 6 in the
    metrics file and the summary; the one after step 6 equals the loss of the
    21 held-out rows (a partial last chunk) at the saved state, in one
    ``evaluate`` of them all."""
    from zeropp_jax.checkpoint import Checkpointer
    from zeropp_jax.models import gpt

    data = _text(tmp_path / "val.txt", 17 * 21 + 3, seed=1)
    flags = [*TINY, "--steps", "6", "--eval-data", data, "--eval-every", "3", "--eval-rows", "21",
             "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = run_cli(*TRAIN, *flags, "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(next(line for line in proc.stdout.splitlines()
                              if line.startswith("summary: "))[len("summary: "):])
    lines = read_jsonl(tmp_path / "m.jsonl")
    assert [line.get("eval_loss") is not None for line in lines] == [False, False, True] * 2
    assert summary["eval_rows"] == 21 and list(summary["eval_losses"]) == ["3", "6"]
    assert summary["eval_loss"] == lines[-1]["eval_loss"] == summary["eval_losses"]["6"]
    assert summary["eval_losses"]["6"] < summary["eval_losses"]["3"]

    args = train.build_parser().parse_args(flags)
    model_cfg = common.build_model(args, 256)
    shapes = jax.eval_shape(lambda k: gpt.init_params(model_cfg, k), jax.random.key(args.seed))
    trainer = common.build_trainer(args, common.build_mesh(args), model_cfg, shapes)
    state = Checkpointer(tmp_path / "ckpt").restore(trainer)
    expected = trainer.evaluate(state, held_out.load(args, 256).rows)["loss"]
    np.testing.assert_allclose(summary["eval_loss"], float(expected), rtol=1e-6)
