"""Training throughput of the example GPT on one GPU: plain JAX vs the trainer.

What is measured
----------------
One optimizer step (Adam, float32 master parameters, bfloat16 compute) of
the example GPT (:mod:`zeropp_jax.models.gpt`; default shape 24 layers,
d_model 2048, 16 heads, seq 1024, vocab 256: 1.21B parameters) at a global
batch of ``--batch`` sequences, in six variants:

* ``plain``: ``jax.jit`` of ``value_and_grad`` + ``optax.adam``, the loss on
  bfloat16 copies of the parameters (what a user writes without this
  library);
* ``plain_remat``: the same with each layer under ``jax.checkpoint`` (the
  per-layer recomputation that ZeRO-3's per-layer gathering implies);
* ``zero3``: :func:`zeropp_jax.make_trainer` with the ``zero3`` preset, per
  layer, on a ``1x1`` mesh (no collective moves data: what is left is the
  trainer's own cost);
* ``qwz`` / ``qwz_pallas`` / ``qwz_xla``: the ``qwz`` preset (int8
  parameter quantize, gather, dequantize per layer) with the default kernels
  (``implementation="auto"``: Pallas, the gathered layers decoded by XLA),
  with the Pallas kernels only, and with the XLA reference only.

Per variant: compile, ``--warmup`` steps, then the median of ``--repeats``
timed groups of ``--steps`` queued steps (``jax.block_until_ready`` on the
last state of a group). Model FLOP/s = tokens/s x
:func:`~zeropp_jax.models.gpt.flops_per_token` (``6N + 12 L S d``, the
causal mask not discounted). ``--peak-tflops`` (default 790, the bf16 dense
matmul rate measured on an H200) gives the utilization column.

With ``--hlo-dir`` each variant's optimized HLO is saved (and its memory
traffic estimated, :mod:`zeropp_jax.analysis.traffic`); with
``--profile-dir`` a few more steps run under the profiler and the device
time per kernel is written per variant (``benchmarks/gpu_profile.py``): what
to read when the trainer costs more than plain ``jax.jit``.

Prints one ``JSON`` line and a table last. Exits 0 with a message without a
GPU, unless ``--allow-cpu`` (a tiny shape, to exercise the script).

Usage::

  python benchmarks/gpu_train_probe.py                      # ~2-3 min on one H200
  python benchmarks/gpu_train_probe.py --variants plain,zero3 --layers 12 --d-model 768 --heads 12
  python benchmarks/gpu_train_probe.py --allow-cpu --layers 2 --d-model 64 --heads 4 --seq 32 --batch 2
  python benchmarks/gpu_train_probe.py --hlo-dir $OUT/hlo --profile-dir $OUT/profile
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, NamedTuple
from zeropp_jax.cli.flags import json_file, non_negative_int, positive_int  # noqa: E402

VARIANTS = ("plain", "plain_remat", "zero3", "qwz", "qwz_pallas", "qwz_xla")
H200_BF16_PEAK_TFLOPS = 790.0  # dense bf16 matmul, measured (benchmarks/RESULTS.md)


def log(message: str) -> None:
    print(f"[gpu_train_probe] {message}", file=sys.stderr, flush=True)


class Variant(NamedTuple):
    """One way of training: ``init(params) -> state``; ``step(state, batch) ->
    (state, loss)``; ``lower(state, batch)``, the step's ``jax.stages.Lowered``
    (both may be abstract); ``abstract(params_shapes, batch)``, the state's
    and the batch's shapes, dtypes and shardings (on ``devices`` where the
    variant was built for them, e.g. a GPU compiled for from a CPU:
    ``gpu_aot.target_devices``)."""

    init: Callable
    step: Callable
    lower: Callable
    abstract: Callable


def _plain_step(cfg, optimizer, *, remat: bool, devices=None) -> Variant:
    """Plain single-device training, bf16 compute."""
    import jax
    import jax.numpy as jnp
    import optax

    from zeropp_jax.models import gpt

    layer = jax.checkpoint if remat else (lambda f: f)

    def loss(params, batch):
        p16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        return gpt.loss_fn(p16, batch, cfg, layer=layer)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    def init(params):
        return params, optimizer.init(params)

    def abstract(params_shapes, batch):
        sharding = None if devices is None else jax.sharding.SingleDeviceSharding(devices[0])
        place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)  # noqa: E731
        return jax.tree.map(place, jax.eval_shape(init, params_shapes)), place(batch)

    return Variant(init, step, step.lower, abstract)


def _trainer_step(cfg, optimizer, params_shapes, *, preset: str, implementation: str,
                  devices=None):
    """:func:`zeropp_jax.make_trainer` on a 1x1 mesh."""
    import jax
    import jax.numpy as jnp

    import zeropp_jax as zp
    from zeropp_jax.models import gpt

    config = zp.ZeroConfig.from_preset(
        preset, compute_dtype=jnp.bfloat16, implementation=implementation
    )
    loss = functools.partial(gpt.loss_fn, cfg=cfg, gather=zp.gather, layer=zp.layer)
    trainer = zp.make_trainer(
        loss, optimizer, params_shapes,
        mesh=zp.make_mesh(1, 1, devices=(devices or jax.devices())[:1]),
        config=config, per_layer=True, stacked=("blocks",),
    )

    def step(state, batch):
        state, metrics = trainer.step(state, batch)
        return state, metrics["loss"]

    def lower(state, batch):
        if not isinstance(batch, jax.ShapeDtypeStruct):
            batch = trainer.shard_batch(batch)
        return trainer.lower(state, batch)

    def abstract(params_shapes, batch):
        return (trainer.abstract_state(params_shapes),
                jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=trainer.batch_sharding))

    return Variant(trainer.init, step, lower, abstract)


# The trainer's variants: (preset, implementation).
TRAINER_VARIANTS = {"zero3": ("zero3", "auto"), "qwz": ("qwz", "auto"),
                    "qwz_pallas": ("qwz", "pallas"), "qwz_xla": ("qwz", "xla")}


def build(variant: str, cfg, optimizer, params_shapes, devices=None) -> Variant:
    if variant in ("plain", "plain_remat"):
        return _plain_step(cfg, optimizer, remat=variant == "plain_remat", devices=devices)
    if variant in TRAINER_VARIANTS:
        preset, implementation = TRAINER_VARIANTS[variant]
        return _trainer_step(cfg, optimizer, params_shapes, preset=preset,
                             implementation=implementation, devices=devices)
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def measure(variant, cfg, optimizer, batch, args) -> dict:
    """Compile, warm up and time one variant; the state is freed afterwards."""
    import jax

    from zeropp_jax.models import gpt

    params = gpt.init_params(cfg, jax.random.key(0))
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    init, step, lower, _ = build(variant, cfg, optimizer, shapes)
    t0 = time.perf_counter()
    state = init(params)
    del params
    losses = []
    for _ in range(args.warmup):
        state, loss = step(state, batch)
        losses.append(float(loss))
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, loss = step(state, batch)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / args.steps)
    losses.append(float(loss))
    extra = {}
    if args.hlo_dir or args.profile_dir:
        hlo = lower(state, batch).compile().as_text()  # the executable just run (cached)
        extra = inspect(variant, hlo, step, state, batch, args)
    del state
    step_s = statistics.median(times)
    tokens = args.batch * args.seq
    tflops = tokens / step_s * gpt.flops_per_token(cfg) / 1e12
    return dict(variant=variant, step_s=step_s, step_s_all=times, tokens_per_s=tokens / step_s,
                model_tflops=tflops, utilization=tflops / args.peak_tflops,
                compile_and_warmup_s=warm_s, loss_first=losses[0], loss_last=losses[-1],
                **extra)


def inspect(variant, hlo, step, state, batch, args) -> dict:
    """Saves the step's optimized HLO and estimated memory traffic (``--hlo-dir``)
    and its profiled device time per kernel (``--profile-dir``)."""
    from zeropp_jax.analysis.traffic import memory_traffic, traffic_summary

    out = {}
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        with open(os.path.join(args.hlo_dir, f"{variant}.hlo"), "w") as f:
            f.write(hlo)
        try:  # an estimate that cannot read this HLO must not cost the timings
            out["traffic_bytes"] = traffic_summary(memory_traffic(hlo), top=0)["bytes"]
        except Exception as e:
            out["traffic_error"] = _failed(variant, "traffic estimate", e)
    if args.profile_dir and variant in args.profile_variants.split(","):
        os.makedirs(args.profile_dir, exist_ok=True)
        log_dir = tempfile.mkdtemp(prefix=f"trace_{variant}_")  # raw traces: large, not kept
        try:
            import gpu_profile

            gpu_profile.trace_steps(step, state, batch, args.profile_steps, log_dir)
            summary = gpu_profile.kernel_times(log_dir, hlo, args.profile_steps)
        except Exception as e:  # a profiler that cannot run must not cost the timings
            out["profile_error"] = _failed(variant, "profile", e)
        else:
            with open(os.path.join(args.profile_dir, f"{variant}.json"), "w") as f:
                json.dump(summary, f, indent=1)
            out["device_ms_per_step"] = summary["device_us_per_step"] / 1e3
            out["profile_source"] = summary["source"]
            log(f"{variant}: {summary['device_us_per_step'] / 1e3:.1f} ms of kernels per step "
                f"({summary['source']})")
        finally:
            shutil.rmtree(log_dir, ignore_errors=True)
    return out


def _failed(variant: str, what: str, e: Exception) -> str:
    message = f"{type(e).__name__}: {str(e)[:300]}"
    log(f"{variant}: {what} FAILED {message}")
    return message


def add_model_args(parser, **defaults) -> None:
    """``--variants`` and the example GPT's shape flags (shared with step_traffic.py)."""
    shape = {**dict(variants=",".join(VARIANTS), layers=24, d_model=2048, heads=16, seq=1024,
                    vocab=256, batch=8), **defaults}
    parser.add_argument("--variants", default=shape["variants"],
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    for name in ("layers", "d_model", "heads", "seq", "vocab"):
        parser.add_argument("--" + name.replace("_", "-"), type=positive_int, default=shape[name])
    parser.add_argument("--batch", type=positive_int, default=shape["batch"], help="sequences per step")


def check_shape(parser, args) -> None:
    """A parser error if ``--heads`` does not divide ``--d-model``."""
    if args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must divide --d-model {args.d_model}")


def parse_variants(parser, text: str) -> list[str]:
    """The comma-separated variants, or a parser error naming the unknown ones."""
    variants = [v for v in text.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return variants


# Issue 18's goals for the step at 1.2B parameters on one H200: (what, variant,
# compared with, at most this many times its step time); and the share of the
# peak the trainer's presets must reach.
STEP_GOALS = (
    ("zero3 within 2% of plain jit with per-layer remat", "zero3", "plain_remat", 1.02),
    ("qwz (default kernels) within 2% of zero3", "qwz", "zero3", 1.02),
)
UTILIZATION_GOAL = 0.5
UTILIZATION_VARIANTS = ("zero3", "qwz")


def goals(rows: list[dict]) -> list[dict]:
    """Each goal that ``rows`` (the probe's, by variant) can answer: the measured
    ratio or share, the bound, and whether it holds. Variants that failed or
    were not run are left out.

    A step-time ratio is of the two medians; ``low``/``high`` are the extremes
    the timed groups allow (fastest over slowest group and back), and
    ``settled`` says whether the bound lies outside them, i.e. whether another
    run with the same spread could give the other verdict."""
    ok = {r["variant"]: r for r in rows if "error" not in r}
    out = []
    for what, variant, base, bound in STEP_GOALS:
        if variant in ok and base in ok:
            ratio = ok[variant]["step_s"] / ok[base]["step_s"]
            groups, base_groups = (ok[v].get("step_s_all") or [ok[v]["step_s"]]
                                   for v in (variant, base))
            low, high = min(groups) / max(base_groups), max(groups) / min(base_groups)
            settled = not low <= bound < high
            out.append(dict(goal=what, value=ratio, bound=bound, met=ratio <= bound,
                            low=low, high=high, settled=settled,
                            text=f"{ratio:.3f}x (groups {low:.3f}-{high:.3f}x"
                                 f"{'' if settled else ', the bound inside: not settled'})"))
    for variant in UTILIZATION_VARIANTS:
        if variant in ok:
            share = ok[variant]["utilization"]
            out.append(dict(goal=f"{variant} at least {UTILIZATION_GOAL:.0%} of the peak",
                            value=share, bound=UTILIZATION_GOAL, met=share >= UTILIZATION_GOAL,
                            text=f"{share:.1%}"))
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps (compile included)")
    parser.add_argument("--steps", type=positive_int, default=5, help="steps per timed group")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed groups (median reported)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
    parser.add_argument("--json-out", default=None, help="also write the results here")
    parser.add_argument("--hlo-dir", default=None,
                        help="write each variant's optimized HLO here (<variant>.hlo; "
                             "benchmarks/step_traffic.py --hlo-dir reads them)")
    parser.add_argument("--profile-dir", default=None,
                        help="trace --profile-steps more steps per variant and write its device "
                             "time per kernel here (<variant>.json, benchmarks/gpu_profile.py)")
    parser.add_argument("--profile-steps", type=positive_int, default=2)
    parser.add_argument("--profile-variants", default="plain_remat,zero3,qwz",
                        help="the variants --profile-dir traces (each costs a trace and its "
                             "parsing)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (tiny shapes)")
    parser.add_argument("--table-from", type=json_file, default=None, metavar="JSON",
                        help="print the table of an earlier run's --json-out file and exit "
                             "(what gpu_check.sh shows when a time limit cut a run short)")
    args = parser.parse_args(argv)
    if args.table_from is not None:
        print(table(args.table_from))
        return 0
    variants = parse_variants(parser, args.variants)
    parse_variants(parser, args.profile_variants)
    check_shape(parser, args)

    import jax
    import jax.numpy as jnp
    import optax

    from zeropp_jax.models import gpt

    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print(f"No GPU: jax.default_backend() is {jax.default_backend()!r}; nothing to measure "
              "(--allow-cpu runs it anyway).")
        return 0
    cfg = gpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layers=args.layers,
                        d_model=args.d_model, n_heads=args.heads)
    dev = jax.devices()[0]
    attention = gpt.attention_implementation(jnp.bfloat16, cfg.head_dim) or "xla"
    log(f"jax {jax.__version__}, {dev.device_kind}; {gpt.count_params(cfg) / 1e9:.3f}B params, "
        f"batch {args.batch} x seq {args.seq}, attention {attention}")
    batch = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, args.vocab,
                               dtype=jnp.int32)
    optimizer = optax.adam(1e-4)

    from zeropp_jax import provenance

    origin = provenance.record()

    def summary_of(rows):
        return dict(provenance=origin, device=dev.device_kind, params=gpt.count_params(cfg),
                    flops_per_token=gpt.flops_per_token(cfg), attention=attention,
                    shape=dict(layers=args.layers, d_model=args.d_model, heads=args.heads,
                               seq=args.seq, vocab=args.vocab, batch=args.batch),
                    peak_tflops=args.peak_tflops, variants=rows,
                    # issue 18's goals are of a GPU; --allow-cpu only exercises the probe
                    goals=goals(rows) if jax.default_backend() == "gpu" else [],
                    **({} if jax.default_backend() == "gpu" else
                       {"goals_skipped": "not a GPU: the goals are an H200's"}))

    rows = []
    for variant in variants:
        try:
            row = measure(variant, cfg, optimizer, batch, args)
        except Exception as e:  # report and go on with the other variants
            row = dict(variant=variant, error=f"{type(e).__name__}: {str(e)[:400]}")
            log(f"{variant}: FAILED {row['error']}")
        else:
            log(f"{variant}: {row['step_s'] * 1e3:.1f} ms/step, {row['model_tflops']:.0f} TFLOP/s")
        rows.append(row)
        if args.json_out:  # after every variant: a time limit keeps what was measured
            with open(args.json_out, "w") as f:
                json.dump(summary_of(rows), f, indent=1)
    print("JSON " + json.dumps(summary_of(rows)))
    print(table(summary_of(rows)))
    ok = [r for r in rows if "error" not in r]
    return 0 if len(ok) == len(rows) else 1


def table(summary: dict) -> str:
    """The probe's short table from its ``summary`` (the JSON): per variant,
    step time, model TFLOP/s, share of the peak, time against plain remat,
    the loss, profiled kernel time and estimated bytes; then one line per
    goal. Kernel times marked ``h`` were summed from host events (the trace
    had no device track), not from the GPU's."""
    rows = summary["variants"]
    ok = {r["variant"]: r for r in rows if "error" not in r}
    shape = summary["shape"]
    lines = [f"{summary['device']}, {summary['params'] / 1e9:.2f}B params, bf16, "
             f"attention {summary['attention']}, batch {shape['batch']} x seq {shape['seq']}",
             f"{'variant':<13}{'ms/step':>9}{'TFLOP/s':>9}{'% peak':>8}{'vs plain_remat':>16}"
             f"{'loss':>14}{'kernels ms':>12}{'GB moved':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<13}  FAILED {r['error'][:80]}")
            continue
        base = ok.get("plain_remat")
        rel = f"{r['step_s'] / base['step_s']:.3f}x" if base else "-"
        kernels = _fmt(r.get("device_ms_per_step"), ".1f")
        if r.get("profile_source", "").startswith("host"):
            kernels += "h"
        lines.append(f"{r['variant']:<13}{r['step_s'] * 1e3:>9.1f}{r['model_tflops']:>9.0f}"
                     f"{100 * r['utilization']:>7.1f}%{rel:>16}"
                     f"{r['loss_first']:>7.3f}->{r['loss_last']:<6.3f}{kernels:>12}"
                     f"{_fmt(r.get('traffic_bytes', 0) / 1e9 or None, '.1f'):>10}")
    for g in summary.get("goals", []):
        lines.append(f"goal {'met' if g['met'] else 'NOT met'}: {g['goal']}: {g['text']}")
    if summary.get("goals_skipped"):
        lines.append(f"goals not checked: {summary['goals_skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
