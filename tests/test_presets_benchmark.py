"""benchmarks/presets.py: seeds are summarized and targets checked on the means."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def presets():
    spec = importlib.util.spec_from_file_location(
        "presets_benchmark", os.path.join(ROOT, "benchmarks", "presets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(loss, base):
    return {"mean_loss_last_10pct": loss, "rel_diff_vs_zero3": (loss - base) / base,
            "compressed_steps": 300}


def test_targets_use_the_mean_over_seeds(presets):
    base = {0: 2.0, 1: 2.1}
    per_seed = {
        s: {"zero3": _row(b, b), "qwz": _row(b * (1.009 if s == 0 else 0.999), b),
            "zeropp": _row(b * 1.012, b), "qgz": _row(b * 1.01, b), "qgz-noef": _row(b * 1.1, b)}
        for s, b in base.items()
    }
    per_seed[1]["hpz"] = {"error": "exit code 1"}
    conv = presets.summarize_seeds(per_seed)
    assert conv["qwz"]["seeds"] == [0, 1]
    assert conv["qwz"]["rel_diff_vs_zero3"] == pytest.approx(0.004)  # +0.9% and -0.1%
    assert conv["qwz"]["rel_diff_sd"] == pytest.approx(0.01 / 2 ** 0.5)
    assert list(conv["qwz"]["per_seed_rel_diff"]) == ["0", "1"]
    assert conv["hpz"] == {"error": "exit code 1"}
    targets, skipped = presets.check_targets(None, conv, None)
    assert targets["qwz_loss_rel_diff"]["pass"]  # one seed alone would fail it
    assert not targets["zeropp_loss_rel_diff"]["pass"]
    assert targets["qgz_noef_minus_qgz_loss"]["pass"]
    assert "hpz_loss_rel_diff" in skipped and "zeropp_time_ratio" in skipped
    report = presets.format_report({
        "params": 1, "provenance": {"zeropp_jax": "x", "git": None}, "steps": 400, "seeds": [0, 1],
        "convergence": conv, "targets": targets, "skipped_targets": skipped,
    })
    assert "| qwz | " in report and "+0.90% / -0.10%" in report
    assert "PASS  qwz last-10% loss within 0.5%" in report
    json.dumps(conv)


def test_loss_targets_of_a_run_that_never_compressed_are_skipped_not_passed(presets):
    """`presets.py --steps 100` is within the 1-bit presets' 100-step warm-up:
    their loss equals zero3's at full precision, which passed the targets."""
    per_seed = {0: {"zero3": _row(2.0, 2.0), "qwz": _row(2.001, 2.0),
                    "zeropp": dict(_row(2.0, 2.0), compressed_steps=0),
                    "qgz": dict(_row(2.0, 2.0), compressed_steps=0), "qgz-noef": _row(2.1, 2.0)}}
    per_seed[0]["qwz"]["compressed_steps"] = 0  # qwz never compresses: still judged
    targets, skipped = presets.check_targets(None, presets.summarize_seeds(per_seed), None)
    assert "zeropp compressed no step" in skipped["zeropp_loss_rel_diff"]
    assert "qgz compressed no step" in skipped["qgz_noef_minus_qgz_loss"]
    assert targets["qwz_loss_rel_diff"]["pass"]
    report = presets.format_report({
        "params": 1, "provenance": {"zeropp_jax": "x", "git": None}, "steps": 100, "seeds": [0],
        "convergence": presets.summarize_seeds(per_seed), "targets": targets,
        "skipped_targets": skipped})
    assert "SKIP  zeropp last-10% loss within 1% of zero3 (mean over the seeds) (zeropp " in report


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0,x"], "comma-separated integers"),
    (["--variants", "zero3,zero4"], "unknown variant"),
    (["--steps", "5"], "at least 10"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--seeds", "0,-1"], ">= 0"),
    (["--json-out", "/no/such/dir/out.json"], "--json-out"),
])
def test_bad_flags(presets, argv, message, capsys):
    with pytest.raises(SystemExit):
        presets.main(argv)
    assert message in capsys.readouterr().err


def test_zeropp_int4_runs_the_published_zeropp(presets):
    """The zeropp-int4 variant is ZeRO++ as the cost model's published
    comparison (and the cluster bench) configures it."""
    from zeropp_jax.analysis import cost_model
    from zeropp_jax.cli import common

    assert presets.VARIANTS["zeropp-int4"] == [
        "--preset", "zeropp", *common.config_args(cost_model.PUBLISHED_ZEROPP)]
