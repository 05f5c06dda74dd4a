"""``zeropp-cluster-bench``: the emulated two-node cluster, its records and its predictions.

The smoke test builds real network namespaces, so it needs root, ``ip`` and
``tc``; it skips with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from zeropp_jax.analysis import cost_model as cm
from zeropp_jax.cli import cluster_bench, cluster_report, netns

from _util import TINY_ARGS, run_cli


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.slow
def test_smoke_two_presets_on_the_emulated_cluster(tmp_path):
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no emulated cluster here: {reason}")
    before = _namespaces()
    out, figure = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run_cli(
        "-m", "zeropp_jax.cli.cluster_bench", "--rates", "0", "--presets", "zero3,zero3-2level",
        "--steps", "3", "--warmup", "1", "--no-predict", "--json", str(out),
        "--figure", str(figure), *TINY_ARGS, "--layers", "1", timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    assert [(r["preset"], r["rate_mbit"]) for r in records] == [
        ("zero3", 0), ("zero3-2level", 0)]
    for r in records:
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) == 2
    flat, two_level = records
    assert flat["speedup_vs_zero3"] == 1.0
    # one device per node crosses instead of every device to every remote one
    assert two_level["link_bytes_per_node_per_step"] < flat["link_bytes_per_node_per_step"]
    assert figure.stat().st_size > 0
    assert _namespaces() == before  # torn down


def test_without_root_or_tools_it_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "network namespaces need root")
    assert cluster_bench.main(["--rates", "0", "--presets", "zero3", *TINY_ARGS]) == 2
    assert "need root" in capsys.readouterr().err


def test_flags_the_bench_sets_itself_are_refused():
    with pytest.raises(SystemExit):
        cluster_bench.parse_args(["--preset", "zeropp"])
    with pytest.raises(SystemExit):
        cluster_bench.parse_args(["--presets", "zero4"])


def _profile(inter_bytes):
    cost = cm.CollectiveCost(
        kind="all-gather", axis="node", role="float", dtype="f32", element_bytes=4.0,
        inter_bytes_per_node=inter_bytes, intra_bytes_per_device=0.0, op_name="")
    return cm.CommProfile(label="", mesh_shape=(2, 4), params=1000, collectives=(cost,))


def test_predictions_add_link_time_at_the_rate_to_the_unlimited_step(monkeypatch):
    """Step time at rate r = unlimited step + model bytes / r; speedups over zero3."""
    workload = cm.Workload(params=1000, tokens_per_gpu=8, float_bytes=4)
    profiles = {"zero3": _profile(1e6), "zeropp": _profile(1e5)}
    monkeypatch.setattr(cluster_report, "_profile",
                        lambda flags: (profiles[flags[-1]], workload))
    measured = {("zero3", 0): 1.0, ("zeropp", 0): 1.1, ("zero3", 8): 2.0, ("zeropp", 8): 1.2}
    records = [{"preset": p, "rate_mbit": r, "step_time_s": t, "tokens_per_s": 8 / t,
                "link_bytes_per_node_per_step": 1e5} for (p, r), t in measured.items()]
    cluster_report.add_speedups(records)
    curves = cluster_report.add_predictions(
        records, lambda preset, flags, steps: [preset], [])
    by = {(r["preset"], r["rate_mbit"]): r for r in records}
    # 8 Mbit/s = 1e6 bytes/s: zero3 1.0 + 1.0 s, zeropp 1.1 + 0.1 s
    assert by["zero3", 8]["predicted_step_time_s"] == pytest.approx(2.0)
    assert by["zeropp", 8]["predicted_step_time_s"] == pytest.approx(1.2)
    assert by["zeropp", 8]["predicted_speedup"] == pytest.approx(2.0 / 1.2)
    assert by["zeropp", 8]["speedup_vs_zero3"] == pytest.approx(2.0 / 1.2)
    assert by["zeropp", 8]["model_link_bytes_per_node_per_step"] == pytest.approx(1e5)
    assert by["zeropp", 0]["predicted_speedup"] == pytest.approx(1.0 / 1.1, rel=1e-3)
    assert curves["zeropp"](8) == pytest.approx(1.2)
    table = cluster_report.format_table(records)
    assert "8 Mbit/s" in table and "unlimited" in table
