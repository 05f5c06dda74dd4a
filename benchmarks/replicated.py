"""zeropp-max over a long run: replicas bit-identical across nodes, resume bit-exact.

Trains the example GPT (tiny by default) with the ``zeropp-max`` preset
(``node_replicated=True``: parameters split over ``local``, one copy per
node) on the simulated ``2x4`` CPU mesh, and checks after every step that
each node's copy of the parameters and of 1-bit Adam's ``m`` / ``v`` is the
same to the bit, through warm-up, compressed and refresh steps. Halfway it
saves a checkpoint, and at the end resumes from it and re-runs the second
half: every loss and the final parameters must be bit-identical.

Prints progress to stderr and one JSON object on stdout::

  python benchmarks/replicated.py --steps 300
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zeropp_jax as zp  # noqa: E402
from zeropp_jax import data  # noqa: E402
from zeropp_jax.checkpoint import Checkpointer  # noqa: E402
from zeropp_jax.models import gpt  # noqa: E402
from zeropp_jax.cli.flags import non_negative_int, positive_int  # noqa: E402


def rows_equal(state) -> bool:
    """Whether every per-node leaf (parameters, m, v) has bit-identical rows."""
    inner = state.opt_state.inner
    for tree in (state.params, inner.m, inner.v):
        for x in tree.values():
            rows = np.asarray(jax.device_get(x))
            if not all(np.array_equal(rows[0], r) for r in rows[1:]):
                return False
    return True


def run(trainer, state, batches, start, stop, check, progress):
    losses, compressed, mismatches = [], [], []
    for i in range(start, stop):
        state, metrics = trainer.step(state, batches.batch_at(i))
        losses.append(float(metrics["loss"]))
        compressed.append(int(metrics["compressed"]))
        if check and not rows_equal(state):
            mismatches.append(i)
        progress(i)
    return state, losses, compressed, mismatches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=300,
                        help="steps (at least 2: the resume starts halfway)")
    parser.add_argument("--warmup", type=positive_int, default=20,
                        help="1-bit Adam's full-precision warm-up")
    parser.add_argument("--refresh-every", type=non_negative_int, default=10,
                        help="a full-precision refresh every N steps (0: never; not 1)")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--d-model", type=positive_int, default=32,
                        help="model width (a multiple of 2, the heads)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: give at least 2 (the resume starts halfway)")
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} is not shorter than --steps {args.steps}: no step "
                     "would compress, and the replicas' equality would check nothing")
    if args.refresh_every == 1 or args.d_model % 2:
        parser.error("--refresh-every 1 compresses no step, and --d-model must be even (2 heads)")

    cfg = gpt.GPTConfig(vocab_size=256, seq_len=16, n_layers=args.layers, d_model=args.d_model,
                        n_heads=2)
    params = gpt.init_params(cfg, jax.random.key(0))
    config = zp.ZeroConfig.from_preset(
        "zeropp-max", compute_dtype="float32", qgz_warmup_steps=args.warmup,
        qgz_refresh_every=args.refresh_every)
    loss = functools.partial(gpt.loss_fn, cfg=cfg, gather=zp.gather, layer=zp.layer)
    trainer = zp.make_trainer(loss, zp.onebit_adam(3e-3, clip_norm=1.0), params,
                              mesh=zp.make_mesh(2, 4), config=config, per_layer=True,
                              stacked=("blocks",))
    tokens, _ = data.load_tokens(None)
    batches = data.TokenBatches(tokens % cfg.vocab_size, batch_size=16, seq_len=cfg.seq_len, seed=0)
    t0 = time.time()

    def progress(i):
        if (i + 1) % 25 == 0:
            print(f"step {i + 1}/{args.steps} ({time.time() - t0:.0f} s)", file=sys.stderr)

    half = args.steps // 2
    with tempfile.TemporaryDirectory() as tmp:
        state = trainer.init(params)
        state, l1, c1, m1 = run(trainer, state, batches, 0, half, True, progress)
        with Checkpointer(tmp) as ckpt:
            ckpt.save(half, state, trainer)
        state, l2, c2, m2 = run(trainer, state, batches, half, args.steps, True, progress)
        final = trainer.gather_params(state)
        resumed = Checkpointer(tmp).restore(trainer)
        resumed, l3, _, _ = run(trainer, resumed, batches, half, args.steps, False, progress)
        again = trainer.gather_params(resumed)
    compressed = c1 + c2
    from zeropp_jax import provenance

    out = {
        "provenance": provenance.record(),
        "steps": args.steps,
        "mesh": "2x4",
        "full_precision_steps": compressed.count(0),
        "compressed_steps": compressed.count(1),
        "replica_mismatch_steps": m1 + m2,
        "replicas_bit_identical": not (m1 or m2),
        "resume_losses_bit_identical": l2 == l3,
        "resume_params_bit_identical": all(
            np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(again))),
        "first_loss": l1[0],
        "final_loss": l2[-1],
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
