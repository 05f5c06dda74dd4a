"""``zeropp-cluster-bench``: the emulated two-node cluster, its records and its predictions.

The smoke test builds real network namespaces, so it needs root, ``ip`` and
``tc``; it skips with the reason otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess

import pytest

from zeropp_jax.analysis import cost_model as cm
from zeropp_jax.cli import cluster_bench, cluster_model, cluster_report, link_probe, netns

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
        # the link probe at the rate: the unshaped veth carries at least 50 Mbit/s
        assert len(r["link_probes"]) == 1 and r["link_probe_gbits_per_s"] > 0.05
    flat, two_level = records
    assert flat["speedup_vs_zero3"] == 1.0
    # one device per node crosses instead of every device to every remote one
    assert two_level["link_bytes_per_node_per_step"] < flat["link_bytes_per_node_per_step"]
    assert 0 < two_level["link_frames_per_node_per_step"] < flat["link_frames_per_node_per_step"]
    assert figure.stat().st_size > 0
    assert _namespaces() == before  # torn down


def _racing_reads(true: list[float], caught: list[float], before: float = 0.0
                  ) -> list[list[float]]:
    """Per-step counter figures of two alike nodes when the read after step k
    also takes ``caught[k]`` of step k + 1's bytes (the last read, none; the
    read before the window, ``before`` of the first step)."""
    reads = []
    for step, bytes_ in enumerate(true):
        now = caught[step] if step + 1 < len(true) else 0.0
        reads.append([bytes_ + now - before] * 2)
        before = now
    return reads


def test_bytes_by_kind_fit_the_cumulative_counts_through_racing_reads():
    """zeropp's reads race the next step's hpZ gather (up to 450 of a 600-byte
    step): one step's figure is off by up to 75%, the fit over a window by
    one race over its length; a refresh's bytes stay out of the compressed
    figure."""
    rng = random.Random(0)
    kinds = [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0]
    runs = []
    for _ in range(3):
        true = [600.0 if k else 3800.0 for k in kinds]
        caught = [rng.choice((0.0, 450.0)) for _ in true]
        runs.append((_racing_reads(true, caught, rng.choice((0.0, 450.0))), kinds))
    single = [reads[i][0] for reads, _ in runs for i in range(len(kinds) - 1) if kinds[i]]
    assert max(abs(s / 600 - 1) for s in single) >= 0.7  # a step alone is way off
    main, full = cluster_report.bytes_by_kind(runs)
    assert main == pytest.approx(600, rel=0.06) and full == pytest.approx(3800, rel=0.1)
    # a race the same at every read cancels exactly
    steady = [(_racing_reads([600.0 if k else 3800.0 for k in kinds], [450.0] * 13, 450.0),
               kinds)]
    assert cluster_report.bytes_by_kind(steady) == pytest.approx((600, 3800))
    # one kind: the slope; a full step only at the end (whose read is left
    # out) cannot be told apart
    assert cluster_report.bytes_by_kind([([[5, 7]] * 3, [0] * 3)]) == (pytest.approx(6), None)
    assert cluster_report.bytes_by_kind([([[5, 7]] * 3, [1, 1, 0])]) == (pytest.approx(6), None)
    assert cluster_report.bytes_by_kind([([[5, 7]], [1])]) == (pytest.approx(6), None)


def test_without_root_or_tools_it_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "network namespaces need root")
    assert cluster_bench.main(["--rates", "0", "--presets", "zero3", *TINY_ARGS]) == 2
    assert "need root" in capsys.readouterr().err


def test_flags_the_bench_sets_itself_are_refused(capsys):
    with pytest.raises(SystemExit):
        cluster_bench.parse_args(["--preset", "zeropp"])
    with pytest.raises(SystemExit):
        cluster_bench.parse_args(["--presets", "zero4"])
    # zeropp-train would read an abbreviation as the whole flag ("--pres" as
    # --preset, "--step" as --steps): refused rather than passed on unchecked
    for flags in (["--pres", "zero3"], ["--step", "20"], ["--mes=8x1"]):
        with pytest.raises(SystemExit):
            cluster_bench.parse_args(flags)
        assert "not a flag of the bench or of zeropp-train" in capsys.readouterr().err
    assert cluster_bench.parse_args(["--layers", "2"])[1] == ["--layers", "2"]
    # a batch that does not split over 2x4 devices x micro-batches: refused
    # before any namespace is built, not in the first run
    with pytest.raises(SystemExit):
        cluster_bench.parse_args(["--batch-size", "8", "--grad-accum", "2"])
    assert "8 x 2 = 16" in capsys.readouterr().err


def _profile(inter_bytes, per_layer=False, calls=1):
    cost = cm.CollectiveCost(
        kind="all-gather", axis="node", role="float", dtype="f32", element_bytes=4.0,
        inter_bytes_per_node=inter_bytes, intra_bytes_per_device=0.0, op_name="",
        per_layer=per_layer, calls=calls)
    return cm.CommProfile(label="", mesh_shape=(2, 4), params=1000, collectives=(cost,))


def test_per_layer_link_time_overlaps_compute_by_the_calibrated_fraction(monkeypatch):
    """zero3-2level (per-layer traffic) at 8 Mbit/s: 1.0 s compute + 1.0 s link
    measured 1.5 s, so half the hideable second was hidden; a per-step
    collective hides nothing, a per-layer one half of min(compute, link)
    (no token bucket here: its own test follows)."""
    monkeypatch.setattr(cluster_model.netns, "burst_bytes", lambda mbit: 0)
    workload = cm.Workload(params=1000, tokens_per_gpu=8, float_bytes=4)
    profiles = {"zero3-2level": _profile(1e6, per_layer=True), "hpz": _profile(1e6),
                "qwz-2level": _profile(5e5, per_layer=True)}
    monkeypatch.setattr(cluster_model, "_profile",
                        lambda flags: (profiles[flags[-1]], workload))
    measured = {("zero3-2level", 0): 1.0, ("zero3-2level", 8): 1.5, ("zero3-2level", 16): 1.25,
                ("hpz", 0): 1.0, ("hpz", 8): 2.0, ("qwz-2level", 0): 1.0, ("qwz-2level", 8): 1.3}
    records = [{"preset": p, "rate_mbit": r, "step_time_s": t, "tokens_per_s": 8 / t,
                "link_bytes_per_node_per_step": 1e5} for (p, r), t in measured.items()]
    cluster_report.add_speedups(records)
    cluster_model.add_predictions(records, lambda preset, flags, steps: [preset], [])
    by = {(r["preset"], r["rate_mbit"]): r for r in records}
    assert by["hpz", 8]["model_overlap_fraction"] == pytest.approx(0.5)
    assert by["zero3-2level", 8]["predicted_step_time_s"] == pytest.approx(1.5)
    assert by["zero3-2level", 16]["predicted_step_time_s"] == pytest.approx(1.0 + 0.5 - 0.25)
    assert by["hpz", 8]["predicted_step_time_s"] == pytest.approx(2.0)
    assert by["qwz-2level", 8]["predicted_step_time_s"] == pytest.approx(1.0 + 0.5 - 0.25)
    assert "50% hidden" in cluster_model.describe(records)
    # runs that disagree: f lies between what each alone says (0.5 and 0.2 here)
    records[2]["step_time_s"] = 1.4
    profiles_of = {p: (profiles[p], workload) for p in profiles}
    f = cluster_model.calibrate_overlap(records, profiles_of, {"zero3-2level": 1.0},
                                        cluster_model.link_gbits(records))
    assert 0.2 < f < 0.5


def test_predictions_add_link_time_at_the_rate_to_the_unlimited_step(monkeypatch):
    """Step time at rate r = unlimited step + model bytes / r, less what the
    link's token bucket holds for the call; speedups over zero3."""
    workload = cm.Workload(params=1000, tokens_per_gpu=8, float_bytes=4)
    profiles = {"zero3": _profile(1e6), "zeropp": _profile(1e5)}
    monkeypatch.setattr(cluster_model, "_profile",
                        lambda flags: (profiles[flags[-1]], workload))
    measured = {("zero3", 0): 1.0, ("zeropp", 0): 1.1, ("zero3", 8): 2.0, ("zeropp", 8): 1.2}
    records = [{"preset": p, "rate_mbit": r, "step_time_s": t, "tokens_per_s": 8 / t,
                "link_bytes_per_node_per_step": 1e5} for (p, r), t in measured.items()]
    cluster_report.add_speedups(records)
    curves = cluster_model.add_predictions(
        records, lambda preset, flags, steps: [preset], [])
    by = {(r["preset"], r["rate_mbit"]): r for r in records}
    # 8 Mbit/s = 1e6 bytes/s: zero3 1.0 s + its bytes beyond the bucket,
    # zeropp 1.1 s + nothing (its 1e5 bytes fit in the bucket)
    zero3_s = 1.0 + (1e6 - netns.burst_bytes(8)) / 1e6
    assert by["zero3", 8]["predicted_step_time_s"] == pytest.approx(zero3_s)
    assert by["zeropp", 8]["predicted_step_time_s"] == pytest.approx(1.1)
    assert by["zeropp", 8]["predicted_speedup"] == pytest.approx(zero3_s / 1.1)
    assert by["zeropp", 8]["speedup_vs_zero3"] == pytest.approx(2.0 / 1.2)
    assert by["zeropp", 8]["model_link_bytes_per_node_per_step"] == pytest.approx(1e5)
    assert by["zeropp", 0]["predicted_speedup"] == pytest.approx(1.0 / 1.1, rel=1e-3)
    assert curves["zeropp"](8) == pytest.approx(1.1)
    assert curves["zero3"](1e-3) > 1000  # far below the bucket's rate, the bytes' time
    table = cluster_report.format_table(records)
    assert "8 Mbit/s" in table and "unlimited" in table


def test_a_call_that_finds_the_link_idle_sends_a_bucket_at_line_speed():
    """tbf's bucket refills while the link idles: four per-layer calls of
    0.2 MB at 8 Mbit/s (1 MB/s, a 256 KiB bucket) behind 1 s of compute cost
    no link time. Behind 0.1 s the link hidden behind the compute (f = 1) is
    busy throughout and they cost their bytes' time; in series (f = 0) the
    0.1 s of compute leaves 0.1 MB of tokens. Unshaped, there is no bucket."""
    workload = cm.Workload(params=1000, tokens_per_gpu=8, float_bytes=4)
    calls = _profile(8e5, per_layer=True, calls=4)

    def link(profile, rate, compute, overlap):
        return cluster_model._link_seconds(profile, workload, rate, 0.008, compute, overlap)

    assert link(calls, 8, 1.0, 0.5) == pytest.approx((0, 0))
    assert link(calls, 8, 0.1, 1.0) == pytest.approx((0.8, 0))
    assert link(calls, 8, 0.1, 0.0) == pytest.approx((0.7, 0))
    assert link(calls, 0, 1.0, 0.5) == pytest.approx((0.8, 0))
    # one call of 1 MB behind 1 s: the bucket's worth passes, the rest costs
    assert link(_profile(1e6), 8, 1.0, 0.5) == pytest.approx(
        (0, (1e6 - netns.burst_bytes(8)) / 1e6))


def test_the_model_uses_the_probed_link_rates(monkeypatch):
    """A probed rate carries its probe's payload rate, an unprobed finite one
    the probed fraction of its tc rate; a probed unlimited link is not free:
    its link time comes off the unlimited run to leave the compute (no
    token bucket here)."""
    monkeypatch.setattr(cluster_model.netns, "burst_bytes", lambda mbit: 0)
    workload = cm.Workload(params=1000, tokens_per_gpu=8, float_bytes=4)
    profiles = {"zero3-2level": _profile(2e6, per_layer=True), "zeropp-max": _profile(1e6)}
    monkeypatch.setattr(cluster_model, "_profile",
                        lambda flags: (profiles[flags[-1]], workload))
    # payload Gbit/s: half of 8 Mbit/s, and 2e6 bytes/s unlimited
    probed = {8: 0.004, 0: 0.016}
    measured = {("zero3-2level", 0): 3.0, ("zero3-2level", 8): 6.0, ("zero3-2level", 16): 4.5,
                ("zeropp-max", 0): 1.5, ("zeropp-max", 8): 2.0}
    records = [{"preset": p, "rate_mbit": r, "step_time_s": t, "tokens_per_s": 8 / t,
                "link_bytes_per_node_per_step": 1e5, "link_probe_gbits_per_s": probed.get(r)}
               for (p, r), t in measured.items()]
    cluster_report.add_speedups(records)
    cluster_model.add_predictions(records, lambda preset, flags, steps: [preset], [])
    by = {(r["preset"], r["rate_mbit"]): r for r in records}
    # zero3-2level: 1 s of link unlimited, 4 s at 8 Mbit/s (probed), 2 s at
    # 16 (half its rate, as at 8); compute 3 - 1 = 2 s; serial (f = 0 fits
    # 8 Mbit/s exactly and 16 better than any f > 0)
    assert by["zero3-2level", 8]["model_overlap_fraction"] == pytest.approx(0, abs=1e-6)
    assert by["zero3-2level", 0]["predicted_step_time_s"] == pytest.approx(3.0)
    assert by["zero3-2level", 8]["predicted_step_time_s"] == pytest.approx(6.0)
    assert by["zero3-2level", 16]["predicted_step_time_s"] == pytest.approx(4.0)
    assert by["zero3-2level", 16]["model_link_gbits_per_s"] == pytest.approx(0.008)
    # zeropp-max: 0.5 s of once-per-step link unlimited, so 1 s of compute;
    # at 8 Mbit/s its bytes at the probed rate
    zeropp_s = 1.0 + 1e6 / 5e5
    assert by["zeropp-max", 8]["predicted_step_time_s"] == pytest.approx(zeropp_s)
    assert by["zeropp-max", 8]["predicted_speedup_vs_zero3_2level"] == pytest.approx(
        6.0 / zeropp_s)
    text = cluster_model.describe(records)
    assert "8 Mbit/s: 4 Mbit/s (probed)" in text and "16 Mbit/s: 8 Mbit/s," in text
    assert "unlimited: 16 Mbit/s (probed)" in text
    # between probed rates the fraction carried is interpolated in log rate
    gbits = cluster_model.link_gbits([{"rate_mbit": 10, "link_probe_gbits_per_s": 0.009},
                                      {"rate_mbit": 1000, "link_probe_gbits_per_s": 0.8}])
    assert gbits(100) == pytest.approx(0.1 * 0.85) and gbits(1000) == 0.8
    assert gbits(5) == pytest.approx(0.0045) and gbits(2000) == pytest.approx(1.6)
    assert gbits(0) == cluster_model.UNLIMITED_GBITS


def test_the_link_probe_measures_a_payload_rate():
    """In one process of 8 devices the probe's gathers run through memory:
    a positive rate, the large gather's bytes as asked (whole chunks)."""
    result = link_probe.measure(1 << 24, 2, 4)  # 16 MiB: a copy long against any noise
    assert result["bytes_per_node"] == 4 * ((1 << 24) // 4)
    assert result["payload_gbits_per_s"] is not None and result["payload_gbits_per_s"] > 0
    assert result["fixed_ms"] > 0


def test_record_separates_compressed_and_refresh_steps():
    """A 1-bit Adam run's record: the compressed steps' median and bytes, the
    refresh steps' apart, and the mean over the preset's own refresh cycle."""
    measured = {
        "step_times_s": [1.0, 3.0, 1.2, 0.8, 3.4],
        "compressed": [1, 0, 1, 1, 0],
        "link_rx_bytes": [[100, 110], [900, 910], [100, 110], [100, 110], [1100, 1110]],
        "link_rx_frames": [[1, 1], [9, 9], [1, 1], [1, 1], [11, 11]],
    }
    r = cluster_report.record("zeropp-max", 50.0, [measured], tokens_per_step=10, refresh=40,
                              flags="--preset zeropp-max")
    assert r["flags"] == "--preset zeropp-max" and r["compressed"] == [1, 0, 1, 1, 0]
    assert r["link_frames_per_node_per_step"] == pytest.approx(1)
    assert r["link_payload_bytes_per_node_per_step"] == pytest.approx(
        105 - netns.FRAME_HEADER_BYTES)
    assert r["step_time_s"] == 1.0 and r["full_precision_step_time_s"] == pytest.approx(3.2)
    assert r["cycle_step_time_s"] == pytest.approx((39 * 1.0 + 3.2) / 40)
    assert r["link_bytes_per_node_per_step"] == pytest.approx(105) and r["tokens_per_s"] == 10
    # the last step's read races no next step and is left out of the fit
    assert r["full_precision_link_bytes_per_node_per_step"] == pytest.approx(905)
    assert r["run_steps"] == [5]
    # without qgZ every timed step is the step, and the cycle is that step
    plain = cluster_report.record("zero3", 50.0, [{**measured, "compressed": [0] * 5}], 10)
    assert plain["step_time_s"] == 1.2 and plain["cycle_step_time_s"] == 1.2
    assert plain["full_precision_step_time_s"] is None
    # a refresh schedule with no refresh step timed has no cycle figure
    none = cluster_report.record("zeropp", 50.0, [{**measured, "compressed": [1] * 5}], 10, 10)
    assert none["cycle_step_time_s"] is None


def test_record_averages_a_run_of_the_presets_own_schedule():
    """A warm-up of 100 steps and a refresh every 40: 107 of a 400-step run's
    steps at full precision (steps 0-99, then 139, 179, ..., 379), the other
    293 compressed; without a full-precision timing no run figure, without
    qgZ the median step."""
    measured = {"step_times_s": [1.0, 3.0, 1.2, 0.8, 3.4], "compressed": [1, 0, 1, 1, 0],
                "link_rx_bytes": [[100, 100], [900, 900], [100, 100], [100, 100], [900, 900]]}
    assert cluster_report.RUN_STEPS == 400
    r = cluster_report.record("zeropp", 50.0, [measured], 10, 40, warmup=100)
    assert r["warmup_steps"] == 100 and r["refresh_every"] == 40
    assert r["run_steps_total"] == 400 and r["run_full_precision_steps"] == 107
    assert r["run_step_time_s"] == pytest.approx((293 * 1.0 + 107 * 3.2) / 400)
    untimed = cluster_report.record("zeropp-int4", 50.0, [{**measured, "compressed": [1] * 5}],
                                    10, 0, warmup=100)
    assert untimed["run_step_time_s"] is None and untimed["step_time_s"] == 1.2
    plain = cluster_report.record("zero3-2level", 50.0, [{**measured, "compressed": [0] * 5}], 10)
    assert plain["run_step_time_s"] == plain["step_time_s"] == 1.2
    assert plain["warmup_steps"] == 0 and plain["run_full_precision_steps"] == 0
    records = [plain, r, untimed]
    cluster_report.add_speedups(records)
    assert r["run_speedup_vs_zero3_2level"] == pytest.approx(1.2 / r["run_step_time_s"])
    assert untimed["run_speedup_vs_zero3_2level"] is None
    head, base_row, zeropp_row, _ = cluster_report.format_table(records).splitlines()
    assert "x 2level cycle  x 2level run" in head
    column = head.index("x 2level run") + len("x 2level run")
    assert zeropp_row[:column].endswith(f"{1.2 / r['run_step_time_s']:.2f}")
    assert base_row[:column].endswith("1.00")


def test_the_figure_draws_a_run_speedup_beside_the_step_speedup(monkeypatch, tmp_path):
    """A hollow marker for a preset whose 400-step run differs from its step,
    none for one whose run is its step."""
    import matplotlib.figure

    drawn = {}

    def savefig(fig, path, **kwargs):
        for ax in fig.axes:
            drawn[ax.get_title()] = [(line.get_label(), line.get_markerfacecolor())
                                     for line in ax.get_lines()
                                     if not line.get_label().startswith("_")]

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    records = [{"preset": p, "rate_mbit": 50.0, "step_time_s": s, "run_step_time_s": run}
               for p, s, run in (("zero3-2level", 2.0, 2.0), ("hpz", 1.5, 1.5),
                                 ("zeropp", 0.5, 0.8))]
    cluster_report.add_speedups(records)
    cluster_report.draw(records, str(tmp_path / "f.png"))
    (lines,) = drawn.values()
    labels = [label for label, _ in lines]
    assert labels == ["hpz measured", "zeropp measured", "zeropp over a 400-step run"]
    assert lines[2][1] == "none" and lines[1][1] != "none"


def test_the_bench_times_refresh_steps_of_1bit_adam_presets():
    flags = cluster_bench.train_command_flags("zeropp-max", [], 10, probe_refresh=True)
    assert flags[flags.index("--qgz-refresh-every") + 1] == str(cluster_bench.REFRESH_PROBE_EVERY)
    assert cluster_bench.refresh_every("zeropp-max", []) == 40  # the preset's own cycle
    # the preset's own warm-up, not the runs' one step; the user's flags count
    assert "--qgz-warmup" in flags
    assert cluster_bench.own_schedule("zeropp-max", []).warmup_steps == 100
    assert cluster_bench.own_schedule("zeropp", ["--qgz-warmup", "50"]).warmup_steps == 50
    assert cluster_bench.own_schedule("zero3-2level", []).warmup_steps == 0
    assert cluster_bench.own_schedule("zeropp-int4", []).warmup_steps == 0  # as DeepSpeed
    assert "--qgz-refresh-every" not in cluster_bench.train_command_flags(
        "zeropp-int4", [], 10, probe_refresh=True)  # gradient qgZ: no refreshes


def test_repeats_are_rounds_over_the_sweep_pooled_per_point(monkeypatch, tmp_path):
    class FakeCluster:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_rate(self, mbit):
            pass

    class Progress:
        def __init__(self):
            self.done = 0

        def set_description(self, text):
            pass

        def update(self, n):
            self.done += n

        def write(self, text):
            pass

    ports = []

    def fake_run(cluster, flags, *, warmup, steps, log_dir, run_id, port, timeout_s):
        ports.append(port)
        step = 0.1 * len(ports)
        return {"step_times_s": [step, step], "compressed": [0, 0],
                "link_rx_bytes": [[100, 100], [100, 100]], "link_rx_frames": [[2, 2], [2, 2]]}

    def fake_probe(cluster, rate, *, log_dir, run_id, port, timeout_s):
        ports.append(port)
        return {"rate_mbit": rate, "payload_gbits_per_s": 0.04 + 0.001 * len(ports)}

    monkeypatch.setattr(cluster_bench.netns, "TwoNodeCluster", FakeCluster)
    monkeypatch.setattr(cluster_bench, "run_once", fake_run)
    monkeypatch.setattr(cluster_bench, "probe_link", fake_probe)
    options, flags = cluster_bench.parse_args(
        ["--rates", "50,0", "--presets", "zero3,hpz", "--repeats", "3"])
    progress = Progress()
    records = cluster_bench.sweep(options, flags, str(tmp_path), progress)
    assert len(records) == 4 and progress.done == 12
    assert len(set(ports)) == 18  # every run and probe its own coordinator port
    first = records[0]
    # each round probes 50 Mbit/s, runs zero3 and hpz there, then the same unlimited
    assert first["step_times_s"] == pytest.approx([0.2, 0.2, 0.8, 0.8, 1.4, 1.4])
    assert first["step_time_s"] == pytest.approx(0.8)  # the median of the pooled steps
    assert [p["payload_gbits_per_s"] for p in first["link_probes"]] == pytest.approx(
        [0.041, 0.047, 0.053])
    assert first["link_probe_gbits_per_s"] == pytest.approx(0.047)
    assert records[1]["link_probes"] == first["link_probes"]
    assert first["run_steps"] == [2, 2, 2]
    assert first["link_frames_per_node_per_step"] == pytest.approx(2)
    assert [(r["preset"], r["rate_mbit"]) for r in records] == [
        ("zero3", 50), ("hpz", 50), ("zero3", 0), ("hpz", 0)]


def _fake_sweep_json(path, step_s, *, flags=(), steps=10, presets=("zero3", "zeropp")):
    """A sweep's --json as the bench writes it: per preset at 50 Mbit/s, two
    runs of two timed steps (``step_s`` and 2 x ``step_s``; zeropp's second
    step a refresh)."""
    records = []
    for preset in presets:
        kinds = [1, 0] if preset == "zeropp" else [0, 0]
        runs = [{"step_times_s": [step_s * k, step_s * k], "compressed": kinds,
                 "link_rx_bytes": [[100 * k, 100 * k]] * 2,
                 "link_rx_frames": [[2, 2]] * 2} for k in (1, 2)]
        records.append(cluster_report.record(
            preset, 50.0, runs, 64, probes=[{"rate_mbit": 50.0, "payload_gbits_per_s": 0.045}]))
    path.write_text(json.dumps({
        "command": ["zeropp-cluster-bench", "--steps", str(steps), "--warmup", "3", *flags],
        "nodes": 2, "local": 4, "steps": steps, "warmup": 3, "records": records,
        "provenance": {"git": f"commit-of-{path.stem}"}}))
    return path


def test_pool_reports_earlier_sweeps_as_one_with_their_runs_as_rounds(tmp_path, capsys):
    a = _fake_sweep_json(tmp_path / "a.json", 1.0)
    b = _fake_sweep_json(tmp_path / "b.json", 3.0, presets=("zero3",))
    out = tmp_path / "pooled.json"
    assert cluster_bench.main(["--pool", str(a), str(b), "--no-predict",
                               "--json", str(out)]) == 0
    assert "zero3" in capsys.readouterr().out
    pooled = json.loads(out.read_text())
    assert pooled["pooled"] == [str(a), str(b)] and pooled["steps"] == 10
    zero3, zeropp = pooled["records"]
    assert zero3["run_steps"] == [2, 2, 2, 2]
    assert zero3["step_times_s"] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 6.0, 6.0]
    assert zero3["step_time_s"] == pytest.approx(2.5)  # the median of all four runs' steps
    assert zeropp["run_steps"] == [2, 2] and zeropp["full_precision_step_time_s"] == 1.5
    assert zeropp["speedup_vs_zero3"] == pytest.approx(2.5 / 1.5)
    assert len(zero3["link_probes"]) == 2  # one per sweep, not one per record
    assert zeropp["link_probes"] == zero3["link_probes"]
    # a pooled file pools again, by the flags it records
    again = tmp_path / "again.json"
    assert cluster_bench.main(["--pool", str(out), str(b), "--no-predict",
                               "--json", str(again)]) == 0
    again = json.loads(again.read_text())
    assert again["records"][0]["run_steps"] == [2] * 6
    # where every pooled sweep ran stays with the figures (the pooling run's own record aside)
    assert pooled["sources"] == [{"path": str(p), "provenance": {"git": f"commit-of-{p.stem}"}}
                                 for p in (a, b)]
    assert [s["provenance"]["git"] for s in again["sources"]] == [
        "commit-of-a", "commit-of-b", "commit-of-b"]


def test_pool_refuses_sweeps_of_other_workloads_and_run_flags(tmp_path, capsys):
    a = _fake_sweep_json(tmp_path / "a.json", 1.0)
    for other in (_fake_sweep_json(tmp_path / "b.json", 1.0, flags=("--d-model", "256")),
                  _fake_sweep_json(tmp_path / "c.json", 1.0, steps=12)):
        assert cluster_bench.main(["--pool", str(a), str(other), "--no-predict"]) == 2
        assert "pool sweeps of one workload" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("{}")
    assert cluster_bench.main(["--pool", str(tmp_path / "x.json")]) == 2
    assert "not a zeropp-cluster-bench --json file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cluster_bench.parse_args(["--pool", str(a), "--rates", "50"])
    assert "--pool takes the flags of the sweeps it pools" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the pooled table would overwrite an input
        cluster_bench.parse_args(["--pool", str(a), "--json", str(a)])
    assert "is one of the --pool inputs" in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: the directory /nonexistent"),
    (["--figure", "f.xyz"], "--figure f.xyz: matplotlib cannot write this file type"),
    (["--figure", "/nonexistent/f.png"], "--figure /nonexistent/f.png: the directory"),
])
def test_outputs_that_cannot_be_written_are_refused_before_the_sweep(flags, needle, capsys):
    """A sweep writes its JSON and figure after its runs: a bad path must not
    lose them at the end."""
    with pytest.raises(SystemExit) as exit_info:
        cluster_bench.parse_args(["--presets", "zero3-2level", *flags])
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_the_bench_runs_zeropp_as_published():
    """zeropp-int4's flags, made from the cost model's PUBLISHED_ZEROPP (which
    zeropp-simulate --published predicts), build that very config."""
    from zeropp_jax.cli import common, train

    assert common.config_args({"qgz": "int4", "qgz_warmup_steps": 1}) == [
        "--qgz", "int4", "--qgz-warmup", "1"]  # a field's own flag name
    with pytest.raises(ValueError, match="qgz_nonsense"):
        common.config_args({"qgz_nonsense": 1})
    with pytest.raises(ValueError, match="boolean"):
        common.config_args({"hpz": True})

    flags = cluster_bench.train_command_flags("zeropp-int4", [], 1)
    config = common.build_config(train.build_parser().parse_args(flags))
    # The bench's runs warm up for one step (BENCH_QGZ_WARMUP), to time the
    # full-precision step; a user's run, as DeepSpeed's, compresses from the first.
    assert config == dataclasses.replace(config, **{**cm.PUBLISHED_ZEROPP, "qgz_warmup_steps": 1})
    assert config.qgz == "int4" and config.qgz_target == "gradient"
    assert cluster_bench.own_schedule("zeropp-int4", []).warmup_steps == 0


@pytest.mark.slow
def test_the_model_counts_a_bf16_run_at_the_bytes_its_link_carries():
    """A ``--dtype bfloat16`` run sends its full-precision payloads at 2 bytes
    (as bits, also on CPU), so the model's bytes for zero3-2level halve while
    zeropp's, quantized, stay (a float32 width here doubled the baseline)."""
    small = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16",
             "--batch-size", "8"]
    counted = {}
    for dtype in ("float32", "bfloat16"):
        for preset in ("zero3-2level", "zeropp"):
            profile, workload = cluster_model._profile(
                cluster_bench.train_command_flags(preset, [*small, "--dtype", dtype], 1))
            assert workload.float_bytes == (4 if dtype == "float32" else 2)
            counted[dtype, preset] = profile.bytes_at(
                cluster_model._cluster(1.0, workload), workload)[0]
    assert counted["float32", "zero3-2level"] == pytest.approx(
        2 * counted["bfloat16", "zero3-2level"], rel=0.02)  # metric scalars stay float32
    assert counted["float32", "zeropp"] == pytest.approx(counted["bfloat16", "zeropp"], rel=0.02)


def test_the_readmes_pooled_sweeps_report_its_speedups(tmp_path):
    """The six sweeps behind the README's d_model 256 table, pooled again:
    zeropp 3.27x the two-level zero3 at 50 Mbit/s (3.14x over its cycle,
    2.23x over a 400-step run with its 100-step warm-up: the files hold no
    run figures, the pooling recomputes them), 0.99x unlimited, and the
    probes' payload rates per link rate."""
    import pathlib

    data = sorted((pathlib.Path(__file__).parent.parent / "benchmarks" / "data"
                   / "cluster_d256_bf16").glob("*.json"))
    assert [p.stem for p in data] == list("abcdef")
    _, _, records = cluster_bench.pool([str(p) for p in data])
    cluster_report.add_speedups(records)
    by = {(r["preset"], r["rate_mbit"]): r for r in records}
    assert by["zeropp", 50]["speedup_vs_zero3_2level"] == pytest.approx(3.27, abs=0.005)
    assert by["zeropp", 50]["cycle_speedup_vs_zero3_2level"] == pytest.approx(3.14, abs=0.005)
    zeropp = by["zeropp", 50]
    assert zeropp["warmup_steps"] == 100 and zeropp["run_full_precision_steps"] == 107
    assert zeropp["run_step_time_s"] == pytest.approx(
        (293 * zeropp["step_time_s"] + 107 * zeropp["full_precision_step_time_s"]) / 400)
    assert zeropp["run_speedup_vs_zero3_2level"] == pytest.approx(2.23, abs=0.005)
    assert by["zero3-2level", 50]["run_step_time_s"] == by["zero3-2level", 50]["step_time_s"]
    int4 = by["zeropp-int4", 50]  # as DeepSpeed: no warm-up, so a run is its steps
    assert int4["run_full_precision_steps"] == 0
    assert int4["run_step_time_s"] == int4["step_time_s"]
    assert by["zeropp", 0]["speedup_vs_zero3_2level"] == pytest.approx(0.99, abs=0.005)
    assert by["zeropp", 50]["run_steps"] == [13] * 8  # eight runs of 13 timed steps
    probes = {rate: len(by["zeropp", rate]["link_probes"]) for rate in (50, 200, 1000, 0)}
    assert probes == {50: 4, 200: 4, 1000: 6, 0: 6}
    assert by["zeropp", 50]["link_probe_gbits_per_s"] == pytest.approx(0.047, abs=0.001)
