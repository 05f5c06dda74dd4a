"""The stall where a qgZ warm-up ends: compile at first use vs ``Trainer.precompile``.

A trainer whose schedule switches has two compiled steps (full precision,
compressed qgZ), each compiled at its first use: the first compressed step,
after ``--warmup`` full-precision steps, stops the run for a whole compile
(README, "Compiling ahead"). This measures that stop and what
``trainer.precompile`` does about it, on a Hugging Face Flax GPT-2 built from a
config (never downloaded; needs ``transformers``, e.g. 4.46.3) with
``wrap=(FlaxGPT2Block,)``, preset ``zeropp`` (1-bit Adam, float32 compute,
``qgz_warmup_steps=--warmup``), on the simulated ``2x4`` CPU mesh, 16 rows per
step. For each mode

* ``first-use``: no precompile; step 0 compiles the full-precision step,
  step ``--warmup`` the compressed one;
* ``precompile``: ``trainer.precompile(state, batch)`` before the loop (both
  variants, in this thread), then the loop;
* ``background``: ``trainer.precompile(state, batch, background=True)``, then
  the loop at once (step 0 waits for its variant; the compressed one compiles
  in the worker while the warm-up runs, on the same cores);

a fresh trainer is built and initialized in its own process (a subprocess per
mode: no jit cache, no persistent compilation cache, no warm allocator shared),
then ``--steps`` steps run (default ``--warmup + 5``), each timed to
``jax.block_until_ready`` of its metrics. Reported per mode: ``total_s``, the
time from before the precompile call (if any) to the end of the loop; every
step's seconds, the longest and its index, step 0's and step ``--warmup``'s;
the compile seconds ``precompile`` returned (or its futures resolved to, with
the time each finished, from the start of the timed section); and the
lowerings / backend compiles JAX reported (``jax.monitoring``) by thread and
by phase (``precompile`` or the main thread's step index at the time), which
shows a variant compiled twice or compiled at first use despite a precompile
(``long_events``: each over 0.05 s, with its thread and phase).

Prints one line per mode to stderr as it goes, a markdown table, then one JSON
object on the last line.

  python benchmarks/compile_stall.py                       # 12 layers, warm-up 5, ~3 min
  python benchmarks/compile_stall.py --layers 48           # the README's depth
  python benchmarks/compile_stall.py --modes background --layers 24 --warmup 10
  python benchmarks/compile_stall.py --replot out48.txt out12.txt \
      --figure benchmarks/figures/compile_stall.png  # the steps' timelines, a panel a run

On 2 CPU cores the background worker compiles on the cores the warm-up steps
run on: the steps it overlaps get slower, and the compressed compile takes
longer than alone.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

MODES = ("first-use", "precompile", "background")
BATCH = 16  # global rows; 2 per device on 2x4
MESH = (2, 4)
VOCAB = 256
# What JAX reports per program it traces, lowers or compiles (jax._src.dispatch).
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load"}
# Events shorter than this (placing a batch, a scalar op, a cached trace) are counted, not listed.
LIST_EVENTS_OVER_S = 0.05


def _model(n_layer: int, d_model: int, seq: int):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(n_layer=n_layer, n_embd=d_model, n_head=4, vocab_size=VOCAB,
                     n_positions=seq)
    model = FlaxGPT2LMHeadModel(cfg, seed=0)
    module = model.module

    def loss_fn(params, batch):
        import jax.numpy as jnp
        import optax

        x = batch["x"]
        pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        out = module.apply({"params": params}, x, jnp.ones_like(x), pos, deterministic=True)
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["y"]).mean()

    return loss_fn, model.params


def _batch(step: int, seq: int) -> dict:
    import numpy as np

    x = np.random.default_rng(step).integers(0, VOCAB, (BATCH, seq)).astype(np.int32)
    return {"x": x, "y": np.roll(x, -1, axis=1)}


def run_mode(mode: str, args) -> dict:
    """One mode in this process: build, init, (precompile), ``args.steps`` timed steps."""
    import jax
    import optax
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block

    import zeropp_jax as zp

    t0 = time.perf_counter()
    loss_fn, params = _model(args.layers, args.d_model, args.seq)
    config = zp.ZeroConfig.from_preset("zeropp", compute_dtype="float32",
                                       qgz_warmup_steps=args.warmup)
    opt = zp.onebit_adam(1e-3) if config.qgz_target == "momentum" else optax.adam(1e-3)
    shapes = {k: jax.ShapeDtypeStruct((BATCH, args.seq), jax.numpy.int32) for k in ("x", "y")}
    trainer = zp.make_trainer(loss_fn, opt, params, mesh=zp.make_mesh(*MESH), config=config,
                              wrap=(FlaxGPT2Block,), example_batch=shapes)
    state = trainer.init(params)
    jax.block_until_ready(state)
    build_s = time.perf_counter() - t0
    batches = [_batch(i, args.seq) for i in range(args.steps)]
    schedule = [bool(trainer.schedule.compress_at(i, float("inf"))) for i in range(args.steps)]

    phase = ["before"]  # the main thread's phase, read by the listener in any thread
    events = []  # (thread, kind, phase, seconds)
    lock = threading.Lock()

    def listen(event, seconds, **kwargs):
        if event in EVENTS:
            with lock:
                events.append((threading.current_thread().name, EVENTS[event], phase[0], seconds))

    jax.monitoring.register_event_duration_secs_listener(listen)
    start = time.perf_counter()
    compile_s, finished_at = None, {}
    if mode == "precompile":
        phase[0] = "precompile"
        compile_s = {str(k).lower(): v for k, v in trainer.precompile(state, batches[0]).items()}
    elif mode == "background":
        phase[0] = "precompile"
        futures = trainer.precompile(state, batches[0], background=True)
        for compress, future in futures.items():
            future.add_done_callback(lambda f, c=compress: finished_at.__setitem__(
                str(c).lower(), time.perf_counter() - start))
    precompile_call_s = time.perf_counter() - start
    step_s, compressed, step_start = [], [], []
    for i in range(args.steps):
        phase[0] = i
        t = time.perf_counter()
        step_start.append(t - start)
        state, metrics = trainer.step(state, batches[i])
        jax.block_until_ready(metrics)
        step_s.append(time.perf_counter() - t)
        compressed.append(int(metrics["compressed"]))
    total_s = time.perf_counter() - start
    if mode == "background":
        compile_s = {str(k).lower(): f.result() for k, f in futures.items()}
    jax.monitoring.unregister_event_duration_listener(listen)

    by_thread: dict = {}
    for thread, kind, _, seconds in events:
        row = by_thread.setdefault(thread, {}).setdefault(kind, {"n": 0, "s": 0.0})
        row["n"] += 1
        row["s"] = round(row["s"] + seconds, 3)
    longest = max(range(args.steps), key=step_s.__getitem__)
    w = args.warmup
    return {
        "mode": mode,
        "build_and_init_s": round(build_s, 2),
        "precompile_call_s": round(precompile_call_s, 3),
        "total_s": round(total_s, 2),
        "step0_s": round(step_s[0], 3),
        f"step{w}_s": round(step_s[w], 3) if w < args.steps else None,
        "longest_step": longest,
        "longest_step_s": round(step_s[longest], 3),
        "steady_step_s": round(sorted(step_s[w + 1:])[len(step_s[w + 1:]) // 2], 3)
        if args.steps > w + 1 else None,
        "compile_s": {k: round(v, 2) for k, v in compile_s.items()} if compile_s else None,
        "compile_finished_at_s": {k: round(v, 2) for k, v in finished_at.items()} or None,
        "step_start_at_s": [round(s, 2) for s in step_start],
        "step_s": [round(s, 3) for s in step_s],
        "compressed": compressed,
        "schedule_compressed": [int(c) for c in schedule],
        "jax_events_by_thread": by_thread,
        "long_events": [{"thread": t, "kind": k, "phase": p, "s": round(s, 2)}
                        for t, k, p, s in events if s > LIST_EVENTS_OVER_S],
    }


def _child(mode: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--only-mode", mode,
           "--layers", str(args.layers), "--d-model", str(args.d_model), "--seq", str(args.seq),
           "--warmup", str(args.warmup), "--steps", str(args.steps)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def figure(path: str, results: list[dict]) -> None:
    """A timeline per mode (one panel per result: this script's JSON): each step
    a bar from its start to its end (full precision blue, compressed orange),
    ``precompile``'s call grey before step 0, the background worker's compiles
    green under its steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"step": ("tab:blue", "tab:orange"), "precompile": "0.6", "worker": "tab:green"}
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 0.6 + 2.0 * len(results)),
                             squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        modes = list(result["modes"])
        for y, mode in enumerate(modes):
            r = result["modes"][mode]
            ax.broken_barh(list(zip(r["step_start_at_s"], r["step_s"])), (y - 0.3, 0.45),
                           facecolors=[colors["step"][c] for c in r["compressed"]],
                           edgecolor="white", linewidth=0.3)
            if r["precompile_call_s"] > 0:
                ax.broken_barh([(0, r["precompile_call_s"])], (y - 0.3, 0.45),
                               facecolors=colors["precompile"])
            done = r.get("compile_finished_at_s") or {}
            if mode == "background" and done:
                ax.broken_barh([(done[c] - r["compile_s"][c], r["compile_s"][c]) for c in done],
                               (y + 0.2, 0.2), facecolors=colors["worker"], edgecolor="white")
        cfg = result["config"]
        ax.set(yticks=range(len(modes)), yticklabels=modes, ylim=(len(modes) - 0.4, -0.6),
               title=f"{cfg['layers']} layers, warm-up {cfg['warmup']}: first compressed "
                     f"step at step {cfg['warmup']} ({result['git']})")
        ax.set_xlabel("seconds from the first step (or the precompile call)")
    handles = [matplotlib.patches.Patch(color=c, label=label) for c, label in [
        (colors["step"][0], "full-precision step"), (colors["step"][1], "compressed step"),
        (colors["precompile"], "precompile call"), (colors["worker"], "worker's compiles")]]
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.3 / (0.6 + 2.0 * len(results)), 1, 1))
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (n_layer)")
    p.add_argument("--d-model", type=int, default=128, help="n_embd (4 heads)")
    p.add_argument("--seq", type=int, default=32, help="tokens per row")
    p.add_argument("--warmup", type=int, default=5,
                   help="full-precision steps before the first compressed one (qgz_warmup_steps)")
    p.add_argument("--steps", type=int, default=None, help="steps per mode (default warmup + 5)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    p.add_argument("--only-mode", choices=MODES, help=argparse.SUPPRESS)  # the child process
    p.add_argument("--figure", metavar="PNG", help="also draw the steps' timelines (figure())")
    p.add_argument("--replot", nargs="+", metavar="OUT", default=None,
                   help="draw --figure from earlier runs' output (their last line, the "
                        "JSON), a panel each, instead of running")
    args = p.parse_args(argv)
    if args.replot:
        if not args.figure:
            p.error("--replot needs --figure PNG")
        figure(args.figure, [json.loads(pathlib.Path(f).read_text().strip().splitlines()[-1])
                             for f in args.replot])
        return 0
    if args.steps is None:
        args.steps = args.warmup + 5
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) "
                "to reach the first compressed step")

    if args.only_mode:
        print(json.dumps(run_mode(args.only_mode, args)))
        return 0

    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {MODES}")
    rows = []
    for m in modes:
        row = _child(m, args)
        rows.append(row)
        print(f"{m}: total {row['total_s']} s, step 0 {row['step0_s']} s, step {args.warmup} "
              f"{row[f'step{args.warmup}_s']} s, compile {row['compile_s']}", file=sys.stderr)

    w = args.warmup
    print(f"\nHF Flax GPT-2, {args.layers} layers x d_model {args.d_model}, seq {args.seq}, "
          f"batch {BATCH}, preset zeropp (float32), mesh {MESH[0]}x{MESH[1]}, warm-up {w}, "
          f"{args.steps} steps\n")
    print(f"| mode | total s | precompile call s | step 0 s | step {w} s | longest (step) s "
          f"| steady step s | compile s (full / compressed) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["compile_s"] or {}
        print(f"| {r['mode']} | {r['total_s']} | {r['precompile_call_s']} | {r['step0_s']} "
              f"| {r[f'step{w}_s']} | {r['longest_step_s']} ({r['longest_step']}) "
              f"| {r['steady_step_s']} | {c.get('false', '-')} / {c.get('true', '-')} |")

    import jax

    from zeropp_jax import provenance

    record = provenance.record()
    result = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, "
                   f"{record.get('backend')} x {record.get('devices')}",
        "jax": jax.__version__,
        "command": record["command"],
        "git": record["git"],
        "config": {"layers": args.layers, "d_model": args.d_model, "seq": args.seq,
                   "batch": BATCH, "mesh": list(MESH), "preset": "zeropp",
                   "compute_dtype": "float32", "warmup": w, "steps": args.steps},
        "modes": {r["mode"]: r for r in rows},
        "provenance": record,
    }
    if args.figure:
        figure(args.figure, [result])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
