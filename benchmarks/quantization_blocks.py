"""Quantization error vs scale overhead per block size, on real GPT tensors.

What is measured
----------------
The example byte-level GPT (``zeropp_jax.models.gpt`` at the CLI defaults:
4 layers, d_model 128, 842,496 parameters) is trained in this process on one
device with plain optax (``clip_by_global_norm(1)`` + Adam 3e-3, the CLI's
optimizer), batch 16 x 128 tokens of the default data, for ``--steps`` steps
(default 50). Three sets of tensors are then quantized:

* ``init weights``: the initial parameters (seed 0);
* ``trained weights``: the parameters after ``--steps`` steps;
* ``gradients``: the gradient of the loss at the trained parameters on the
  next batch (before clipping).

Each set is flattened exactly as the trainer stores it
(:func:`zeropp_jax.layout.flatten_unit`: one flat vector per unit, i.e. the
embeddings, each transformer layer, the final LayerNorm; leaves concatenated
in tree order), so blocks straddle leaf boundaries the way they do on the
wire, e.g. a block holding LayerNorm scales (about 1.0) next to weights of
about 0.02. The vectors are zero-padded to a multiple of 4096 so every block
size divides them; errors are taken over the real elements only.

For bits 8 and 4 (absmax, :func:`zeropp_jax.wire.quantization.quantize`) on all
three sets and for 1 bit (sign with a mean-|x| scale per block, qgZ's
format) on the gradients, and blocks 32 ... 4096, the table gives

* ``rel L2``: ``||x - x_hat|| / ||x||`` over all units;
* ``vs finest``: that error divided by the error at block 32;
* ``max err / absmax``: ``max |x - x_hat|`` over ``max |x|``;
* ``scale overhead``: float32 scale bytes as % of the payload bytes
  (``32 / (bits * block)``, from :func:`zeropp_jax.wire.quantization.wire_bytes`).

How the default block (``DEFAULT_QWZ_BLOCK = DEFAULT_QGZ_BLOCK = 256``) is chosen
--------------------------------------------------------------------------------
A scale costs 4 bytes per block whatever the bits, so its share of the wire
falls as ``1 / block``: for int8 it is 12.5% at 32, 3.1% at 128, 1.6% at 256
and 0.8% at 512; for int4 and 1 bit it is 2x and 8x that. The error grows
with the block because one absmax (or one mean |x|) has to cover more values.
The intended rule is: the largest block whose error is within a few percent
(``--tolerance``, default 10%) of the finest block's while the scale overhead
is small (int8: <= 2%, i.e. block >= 256). ``choose_block`` reports, per
tensor set and bits, the largest block within the tolerance of the finest,
the end of the smooth region (the largest block reached before the error
grows by more than ``--jump``, default 15%, in one doubling), and the error
of 256 relative to 32 and to 128.

What the data says (seed 0, 50 steps; rerun to check):

* int8/int4 absmax error grows smoothly with the block, 5-11% per doubling
  (the absmax of more values), whatever the model: at 256 it is 1.2-1.3x the
  block-32 error, never "within a few percent". What decides is the absolute
  size: int8 at 256 stays at 0.3-0.7% relative L2 error for weights and
  gradients, for 1.6% scale overhead (32 costs 12.5%, 128 costs 3.1%).
* On top of that the error jumps once a block is longer than a row of the
  weight matrices (every leaf of the example GPT starts at a multiple of
  d_model in its unit), because rows differ in magnitude, gradients most.
  With d_model 128 (the example GPT): gradients int8 go from 1.11x (128) to
  1.51x (256) the block-32 error, 1-bit from 1.01x to 1.38x. With
  ``--d-model 256`` the jump moves to 256 -> 512: gradients int8 1.25x at
  256, 1.59x at 512; 1-bit 1.03x at 256, 1.17x at 512.
* So 256 is the smallest block whose scales cost under 2% of an int8
  payload, and it stays inside a row for any d_model >= 256 (all but toy
  models). On the d_model-128 example GPT it crosses rows, which costs 1.36x
  the gradient error of block 128 (int8).
* 1-bit gradients (qgZ): the error is flat (0.52-0.53 relative L2 at
  d_model 128, 0.63-0.65 at 256) for any block up to the row length, and
  worse beyond it. The 1-bit default (``DEFAULT_QGZ_BLOCK_1BIT``) is
  therefore smaller than 256; on the example GPT 128 is as accurate as 32
  (1.01x) at a quarter of the scale overhead (1.25 instead of 2 bits per
  value).

Usage::

  python benchmarks/quantization_blocks.py            # 1-2 minutes on 2 idle CPU cores
  python benchmarks/quantization_blocks.py --d-model 256   # rows of 256: where the jump moves
  python benchmarks/quantization_blocks.py --steps 100 --json-out q.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from zeropp_jax.cli.flags import non_negative_int, positive_int  # noqa: E402

BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
ALIGN = max(BLOCKS)
DEFAULT_BLOCK = 256


def log(message: str) -> None:
    print(f"[quantization_blocks] {message}", file=sys.stderr, flush=True)


def train_tensors(steps: int, seed: int, lr: float, *, layers: int, d_model: int, heads: int) -> dict:
    """Returns ``{"init weights": tree, "trained weights": tree, "gradients": tree}``."""
    import jax

    from zeropp_jax import data
    from zeropp_jax.cli.common import make_optimizer
    from zeropp_jax.models import gpt

    tokens, vocab = data.load_tokens(None)
    cfg = gpt.GPTConfig(vocab_size=vocab, n_layers=layers, d_model=d_model, n_heads=heads)
    batches = data.TokenBatches(tokens, batch_size=16, seq_len=cfg.seq_len, seed=seed)
    params = gpt.init_params(cfg, jax.random.key(seed))
    init = jax.tree.map(lambda x: x.copy(), params)
    optimizer = make_optimizer(lr)
    opt_state = optimizer.init(params)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: gpt.loss_fn(p, b, cfg)))

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, loss

    t0 = time.perf_counter()
    loss = None
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, batches.batch_at(i))
    loss_now, grads = grad_fn(params, batches.batch_at(steps))
    log(
        f"trained {steps} steps in {time.perf_counter() - t0:.1f}s: last train loss "
        f"{float(loss) if loss is not None else float('nan'):.4f}, loss at gradient batch "
        f"{float(loss_now):.4f}"
    )
    return {"init weights": init, "trained weights": params, "gradients": grads}


def flat_units(tree) -> list:
    """``[(flat (rows, padded) float32, numel)]``, one per unit, as the trainer flattens."""
    import jax.numpy as jnp

    from zeropp_jax.layout import build_layout, flatten_unit, split_units

    layout = build_layout(tree, n_devices=1, align=ALIGN, per_layer=True, stacked=("blocks",))
    trees = split_units(tree, layout)
    out = []
    for u in layout.units:
        flat = flatten_unit(trees[u.name], u)
        out.append((jnp.reshape(flat, (-1, u.padded)), u.numel))
    return out


def measure(units: list, bits: int, block: int) -> dict:
    import jax.numpy as jnp

    from zeropp_jax.wire.quantization import dequantize, quantize

    err_sq = x_sq = 0.0
    max_err = absmax = 0.0
    for flat, numel in units:
        q = quantize(flat, bits=bits, block=block)
        err = dequantize(q, bits=bits, block=block, dtype=jnp.float32) - flat
        real = flat[:, :numel]
        err = err[:, :numel]
        err_sq += float(jnp.sum(err * err))
        x_sq += float(jnp.sum(real * real))
        max_err = max(max_err, float(jnp.max(jnp.abs(err))))
        absmax = max(absmax, float(jnp.max(jnp.abs(real))))
    return {
        "relative_l2_error": (err_sq / x_sq) ** 0.5 if x_sq else 0.0,
        "max_abs_error_over_absmax": max_err / absmax if absmax else 0.0,
    }


def scale_overhead(bits: int, block: int) -> float:
    """Scale bytes as a fraction of payload bytes (float32 scales)."""
    from zeropp_jax.wire.quantization import wire_bytes

    n = ALIGN * 8  # any multiple of every block
    payload = n * bits // 8
    return (wire_bytes(n, bits=bits, block=block) - payload) / payload


def choose_block(rows: list, tolerance: float, jump: float) -> dict:
    """Applies the selection rule to one (tensor set, bits) sweep.

    Returns the largest block whose error is within ``tolerance`` of the
    finest block's, the largest block reached before the error first grows by
    more than ``jump`` in one doubling of the block (the end of the smooth
    region), and the error ratios of the default block.
    """
    finest = rows[0]["relative_l2_error"]
    by_block = {r["block"]: r["relative_l2_error"] for r in rows}
    within = [b for b, e in by_block.items() if e <= (1 + tolerance) * finest]
    smooth = rows[0]["block"]
    for prev, cur in zip(rows, rows[1:]):
        if cur["relative_l2_error"] > (1 + jump) * prev["relative_l2_error"]:
            break
        smooth = cur["block"]
    half = DEFAULT_BLOCK // 2
    return {
        "largest_block_within_tolerance_of_finest": max(within),
        "largest_block_before_first_jump": smooth,
        "error_ratio_default_vs_finest": by_block[DEFAULT_BLOCK] / finest if finest else 1.0,
        "error_ratio_default_vs_half": by_block[DEFAULT_BLOCK] / by_block[half] if by_block[half] else 1.0,
        "default_within_tolerance_of_finest": by_block[DEFAULT_BLOCK] <= (1 + tolerance) * finest,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=non_negative_int, default=50, help="training steps before the trained tensors")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--d-model", type=positive_int, default=128)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="error allowed over the finest block when choosing (fraction)")
    parser.add_argument("--jump", type=float, default=0.15,
                        help="error growth in one doubling of the block that ends the smooth region")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")

    started = time.perf_counter()
    tensors = train_tensors(
        args.steps, args.seed, args.lr, layers=args.layers, d_model=args.d_model, heads=args.heads
    )
    plan = [
        ("init weights", (8, 4)),
        ("trained weights", (8, 4)),
        ("gradients", (8, 4, 1)),
    ]
    results: dict = {}
    choices: dict = {}
    for name, bit_list in plan:
        units = flat_units(tensors[name])
        numel = sum(n * flat.shape[0] for flat, n in units)
        results[name] = {"numel": numel, "bits": {}}
        for bits in bit_list:
            rows = []
            for block in BLOCKS:
                m = measure(units, bits, block)
                rows.append({"block": block, **m, "scale_overhead": scale_overhead(bits, block)})
            finest = rows[0]["relative_l2_error"]
            for r in rows:
                r["error_vs_finest"] = r["relative_l2_error"] / finest if finest else 1.0
            results[name]["bits"][str(bits)] = rows
            choices[f"{name}, {bits}-bit"] = choose_block(rows, args.tolerance, args.jump)
            log(f"{name} {bits}-bit done")

    lines = [
        "# Block-wise quantization error vs scale overhead (example GPT, real tensors)",
        "",
        f"GPT {args.layers} layers, d_model {args.d_model}; trained {args.steps} steps (seed {args.seed}); units flattened as the trainer stores them; "
        "errors over real elements.",
        "",
        "| tensors | bits | block | rel L2 error | vs finest | max err / absmax | scale overhead % |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, res in results.items():
        for bits, rows in res["bits"].items():
            for r in rows:
                lines.append(
                    f"| {name} | {bits} | {r['block']} | {r['relative_l2_error']:.4e} "
                    f"| {r['error_vs_finest']:.3f} | {r['max_abs_error_over_absmax']:.4e} "
                    f"| {100 * r['scale_overhead']:.2f} |"
                )
    lines += [
        "",
        f"## choice (tolerance {100 * args.tolerance:.0f}%, jump {100 * args.jump:.0f}%; default block {DEFAULT_BLOCK}: "
        f"int8 scale overhead {100 * scale_overhead(8, DEFAULT_BLOCK):.2f}%)",
        "",
        f"| tensors, bits | err {DEFAULT_BLOCK} / err {BLOCKS[0]} | err {DEFAULT_BLOCK} / err {DEFAULT_BLOCK // 2} "
        f"| {DEFAULT_BLOCK} within tol. of {BLOCKS[0]} | largest block within tol. of {BLOCKS[0]} "
        "| largest block before first jump |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for key, c in choices.items():
        lines.append(
            f"| {key} | {c['error_ratio_default_vs_finest']:.3f} | {c['error_ratio_default_vs_half']:.3f} "
            f"| {'yes' if c['default_within_tolerance_of_finest'] else 'no'} "
            f"| {c['largest_block_within_tolerance_of_finest']} | {c['largest_block_before_first_jump']} |"
        )
    print("\n".join(lines), flush=True)

    from zeropp_jax import provenance

    out = {
        "provenance": provenance.record(),
        "steps": args.steps,
        "seed": args.seed,
        "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads},
        "tolerance": args.tolerance,
        "jump": args.jump,
        "blocks": list(BLOCKS),
        "default_block": DEFAULT_BLOCK,
        "results": results,
        "choice": choices,
        "seconds": round(time.perf_counter() - started, 1),
    }
    line = json.dumps(out)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
