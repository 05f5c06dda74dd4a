"""The cost model's step times on ``zeropp-cluster-bench``'s emulated cluster.

The cluster is 2 nodes x 4 devices with free intra-node links. Each preset's
bytes are the model's two-level count of its compiled step
(:mod:`zeropp_jax.analysis.cost_model`); the link carries, at each rate, the
payload rate the bench's link probe measured there
(:mod:`zeropp_jax.cli.link_probe`: frame headers and gloo's own messages
cost a part of the ``tc`` rate, and the unlimited veth is finite). Without a
probe a finite rate carries the fraction the probed ones did (:func:`link_gbits`;
all of it when none was probed), and the unlimited link is free.

Step time at a rate: ``compute + once + layer - f * min(compute, layer)``,
with ``once`` the link time of the collectives that run once per step and
``layer`` that of the per-layer ones (inside the layer loops), which a
prefetching runtime can partly hide behind the layers' compute. ``compute``
is the preset's own: the time that makes the formula give its measured step
at unlimited rate. ``f`` is one number for the cluster, fitted to
``zero3-2level``'s runs at finite rates (the preset with the most per-layer
traffic; least squares on the relative errors of its step times), and 0
without such a run (the serial model).

The emulated link is a token bucket (``tc tbf``,
:func:`zeropp_jax.cli.netns.burst_bytes`; a real link has none): it fills
at the rate while the link idles (``compute - f * min(compute, layer)`` of
the step), and a call that finds it full sends up to ``burst`` bytes at the
link's own speed. ``once`` and ``layer`` count only the bytes beyond what
each call finds in the bucket (:func:`_link_seconds`):
on a link idle for most of the step (the two-level zero3 at 1000 Mbit/s:
calls of 0.8 MB, a 1.25 MB bucket) most traffic costs no link time; on a
link busy throughout, the bucket stays empty.
"""

from __future__ import annotations

from typing import Callable, Sequence

from zeropp_jax.cli import netns

# The run the overlap of per-layer traffic is calibrated on.
CALIBRATION_PRESET = "zero3-2level"
# What an unprobed "unlimited" is for the model: far above any rate of the sweep.
UNLIMITED_GBITS = 1e6
# Fitting f: a grid over [0, 1], then golden-section search around its best
# point down to this width.
OVERLAP_GRID = 100
OVERLAP_TOLERANCE = 1e-9
# How closely the bisection finds what a call finds in the token bucket.
BUCKET_TOLERANCE_BYTES = 1.0


def add_predictions(records: list[dict], flags_of: Callable,
                    train_flags: Sequence[str]) -> dict[str, Callable]:
    """Adds the cost model's ``predicted_step_time_s``, ``predicted_speedup`` (over
    zero3), ``predicted_speedup_vs_zero3_2level``, ``model_compute_s`` and
    ``model_link_bytes_per_node_per_step`` (its two-level count) to every
    record (``None`` where the preset has no unlimited-rate run), and the
    ``model_overlap_fraction`` and ``model_link_gbits_per_s`` it used.

    Compiles each preset's step once in this process (8 CPU devices).

    Args:
      records: the bench's records.
      flags_of: ``flags_of(preset, train_flags, steps)``: the run's zeropp-train flags.
      train_flags: the flags passed through to zeropp-train.

    Returns:
      preset -> ``step_s(rate_mbit)``, the predicted step time at any rate.
    """
    unlimited = {r["preset"]: r["step_time_s"] for r in records if r["rate_mbit"] == 0}
    gbits = link_gbits(records)
    profiles, link_bytes = {}, {}
    for preset in dict.fromkeys(r["preset"] for r in records):
        if preset in unlimited:
            profiles[preset] = _profile(flags_of(preset, train_flags, 1))
            profile, workload = profiles[preset]
            link_bytes[preset] = profile.bytes_at(_cluster(1.0, workload), workload)[0]
    overlap = calibrate_overlap(records, profiles, unlimited, gbits)
    computes = {preset: _compute_s(profile, workload, unlimited[preset], overlap, gbits(0))
                for preset, (profile, workload) in profiles.items()}
    curves = {preset: _curve(profile, workload, computes[preset], overlap, gbits)
              for preset, (profile, workload) in profiles.items()}
    for r in records:
        known = r["preset"] in curves
        r["model_overlap_fraction"] = overlap
        r["model_link_gbits_per_s"] = gbits(r["rate_mbit"])
        r["model_compute_s"] = computes.get(r["preset"])
        r["model_link_bytes_per_node_per_step"] = link_bytes[r["preset"]] if known else None
        r["predicted_step_time_s"] = curves[r["preset"]](r["rate_mbit"]) if known else None
    index = {(r["preset"], r["rate_mbit"]): r for r in records}
    for r in records:
        for base, key in (("zero3", "predicted_speedup"),
                          ("zero3-2level", "predicted_speedup_vs_zero3_2level")):
            other = index.get((base, r["rate_mbit"]), {}).get("predicted_step_time_s")
            mine = r["predicted_step_time_s"]
            r[key] = other / mine if other and mine else None
    return curves


def link_gbits(records: Sequence[dict]) -> Callable[[float], float]:
    """``gbits(rate_mbit)``: the payload Gbit/s per node the model's link carries.

    At a probed rate (a record's ``link_probe_gbits_per_s``), the probe's;
    at another finite rate, the rate times the fraction the probed finite
    rates carried, interpolated in log rate between them (the nearest's
    beyond them; 1 without any); unprobed unlimited, :data:`UNLIMITED_GBITS`.
    """
    import numpy as np

    probed = {r["rate_mbit"]: r["link_probe_gbits_per_s"] for r in records
              if r.get("link_probe_gbits_per_s")}
    finite = sorted(rate for rate in probed if rate)
    fractions = [probed[rate] * 1e3 / rate for rate in finite]

    def gbits(rate_mbit: float) -> float:
        if rate_mbit in probed:
            return probed[rate_mbit]
        if not rate_mbit:
            return UNLIMITED_GBITS
        if not finite:
            return rate_mbit / 1e3
        fraction = np.interp(np.log(rate_mbit), np.log(finite), fractions)
        return rate_mbit / 1e3 * float(fraction)

    return gbits


def calibrate_overlap(records: Sequence[dict], profiles: dict, unlimited: dict,
                      gbits: Callable[[float], float]) -> float:
    """The fraction ``f`` of per-layer link time hidden behind compute (module doc).

    Fitted to every :data:`CALIBRATION_PRESET` record at a finite rate: the
    ``f`` in ``[0, 1]`` that minimises the squared relative errors of its
    predicted step times (whose compute time depends on ``f`` too); 0
    without such a record, its profile or its unlimited run. With several
    rates no one run's noise sets ``f``.
    """
    runs = [r for r in records if r["preset"] == CALIBRATION_PRESET and r["rate_mbit"] > 0]
    if not runs or CALIBRATION_PRESET not in profiles or CALIBRATION_PRESET not in unlimited:
        return 0.0
    profile, workload = profiles[CALIBRATION_PRESET]

    def loss(f: float) -> float:
        compute = _compute_s(profile, workload, unlimited[CALIBRATION_PRESET], f, gbits(0))
        step_s = _curve(profile, workload, compute, f, gbits)
        return sum((step_s(r["rate_mbit"]) / r["step_time_s"] - 1) ** 2 for r in runs)

    best = min(range(OVERLAP_GRID + 1), key=lambda i: loss(i / OVERLAP_GRID)) / OVERLAP_GRID
    lo, hi = max(0.0, best - 1 / OVERLAP_GRID), min(1.0, best + 1 / OVERLAP_GRID)
    golden = (5 ** 0.5 - 1) / 2
    while hi - lo > OVERLAP_TOLERANCE:
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        lo, hi = (lo, b) if loss(a) <= loss(b) else (a, hi)
    return (lo + hi) / 2


def describe(records: Sequence[dict]) -> str:
    """The model's lines under the bench's table: the overlap and the link rates it used."""
    with_model = [r for r in records if r.get("model_overlap_fraction") is not None]
    if not with_model:
        return ""
    rates = {r["rate_mbit"]: r for r in with_model}
    link = ", ".join(
        f"{'unlimited' if not rate else f'{rate:g} Mbit/s'}: "
        f"{r['model_link_gbits_per_s'] * 1e3:,.0f} Mbit/s"
        f"{' (probed)' if r.get('link_probe_gbits_per_s') else ''}"
        for rate, r in sorted(rates.items(), key=lambda kv: kv[0] or float("inf"))
        if r["model_link_gbits_per_s"] < UNLIMITED_GBITS)
    none = sorted({r["preset"] for r in with_model if r.get("model_compute_s") == 0})
    return (f"model: per-layer link time {with_model[0]['model_overlap_fraction']:.0%} hidden "
            f"behind compute (calibrated on {CALIBRATION_PRESET}; 0% without it)"
            + (f"\nmodel: payload per node and direction {link}" if link else "")
            + (f"\nmodel: no compute time left for {', '.join(none)}: the unlimited step is "
               "shorter than its modelled link time there" if none else ""))


def _link_seconds(profile, workload, rate_mbit: float, gbits: float, compute_s: float,
                  overlap: float) -> tuple[float, float]:
    """``(per-layer, once-per-step)`` inter-node link seconds at ``gbits`` of payload.

    A capped link is a token bucket (module doc): a call that finds it full
    sends up to ``burst`` bytes at the link's own speed. In a step of
    ``compute + once + layer - f * min(compute, layer)`` the link is busy for
    ``once + layer`` and idle for ``compute - f * min(compute, layer)``; taken
    as spread evenly between the step's calls, each call finds
    ``x = min(burst, rate * idle / calls)`` in the bucket: all of it on a link
    idle for most of the step, nothing on one busy throughout. The idle time
    depends on ``x`` in turn. ``x`` is the largest bucket that refills to at
    least itself, found by bisection: what a call finds less ``x`` never grows
    with ``x`` (each byte more in the bucket frees at most ``f`` of a byte's
    time per call), so those ``x`` are an interval from 0.
    """
    from zeropp_jax.analysis import cost_model as cm

    per_second = gbits * cm.GBIT
    calls = [(c, inter / c.calls) for c, inter, _ in profile.scaled(_cluster(gbits, workload),
                                                                   workload) if inter > 0]
    burst = float(netns.burst_bytes(rate_mbit)) if rate_mbit else 0.0
    count = sum(c.calls for c, _ in calls) or 1

    def seconds(found: float) -> tuple[float, float]:
        return tuple(sum(c.calls * max(0.0, per_call - found) for c, per_call in calls
                         if c.per_layer == layer) / per_second for layer in (True, False))

    def refilled(found: float) -> float:
        idle = compute_s - overlap * min(compute_s, seconds(found)[0])
        return min(burst, per_second * max(0.0, idle) / count)

    low, high = (burst, burst) if refilled(burst) >= burst else (0.0, burst)
    while high - low > BUCKET_TOLERANCE_BYTES:
        middle = (low + high) / 2
        low, high = (middle, high) if refilled(middle) >= middle else (low, middle)
    return seconds(low)


def _compute_s(profile, workload, unlimited_s: float, overlap: float, gbits: float) -> float:
    """The compute time ``c`` with ``c + once + layer - f * min(c, layer)`` the
    measured unlimited-rate step (``once`` and ``layer`` on the unshaped link at
    ``gbits``); 0 when that link time alone outlasts the step."""
    layer, once = _link_seconds(profile, workload, 0, gbits, 0.0, overlap)
    c = unlimited_s - once - (1 - overlap) * layer
    if c >= layer:
        return c
    # the link outlasted the compute even unshaped: min(c, layer) = c
    rest = unlimited_s - once - layer
    return max(0.0, rest / (1 - overlap)) if overlap < 1 else max(0.0, c)


def _curve(profile, workload, compute_s: float, overlap: float,
           gbits: Callable[[float], float]) -> Callable[[float], float]:
    """``step_s(rate_mbit)``: the model's step time on the emulated cluster (module doc)."""

    def step_s(rate_mbit: float) -> float:
        layer, once = _link_seconds(profile, workload, rate_mbit, gbits(rate_mbit), compute_s,
                                    overlap)
        return compute_s + once + layer - overlap * min(compute_s, layer)

    return step_s


def _cluster(gbits: float, workload):
    """2 x 4 devices, free intra-node links, ``gbits`` per node (only its bytes are
    read: the compute time is the measured one, not the cluster's peak)."""
    from zeropp_jax.analysis import cost_model as cm

    return cm.Cluster(
        nodes=2, gpus_per_node=4, intra_node_gbytes_per_s=UNLIMITED_GBITS,
        inter_node_gbits_per_s=gbits,
        peak_tflops=workload.flops_per_gpu / cm.TERA, efficiency=1.0,
    )


def _profile(flags: Sequence[str]):
    """``(CommProfile, Workload)`` of the zeropp-train run with ``flags``."""
    import jax
    import jax.numpy as jnp

    import zeropp_jax as zp
    from zeropp_jax.analysis import cost_model as cm
    from zeropp_jax.cli import common, data_flags, train

    args = train.build_parser().parse_args(list(flags))
    config = common.build_config(args)
    model = common.build_model(args, data_flags.data_vocab(args))
    mesh = zp.make_mesh(2, 4, devices=jax.devices()[:8])
    # The median step of a qgZ run is a compressed one (the bench starts
    # compressing at step 1; a refresh step every N is an outlier of the median).
    profile = cm.profile_config(config, mesh=mesh, model=model, batch_size=args.batch_size,
                                compress=True if config.qgz != "off" else None,
                                label=args.preset)
    # Full-precision payloads cross at the compute dtype (2-byte floats as
    # their bits, also on CPU; "auto" is float32 on CPU); quantized payloads
    # are packed bytes, exact on every backend.
    float_bytes = jnp.dtype(config.resolved_compute_dtype("cpu")).itemsize
    workload = cm.Workload(params=profile.params, float_bytes=float_bytes,
                           tokens_per_gpu=args.batch_size * args.seq_len / 8)
    return profile, workload
