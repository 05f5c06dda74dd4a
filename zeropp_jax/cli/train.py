"""``zeropp-train``: train the example GPT on the default data with ZeRO-3/ZeRO++.

Example::

  zeropp-train --mesh 2x4 --preset zeropp --steps 300 --metrics-out m.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from zeropp_jax.cli import common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeropp-train",
        description="Train the example byte-level GPT with ZeRO-3 / ZeRO++ "
        "sharded data parallelism over a (node, local) mesh.",
    )
    parser.add_argument("--steps", type=common.positive_int, default=300, help="optimizer steps")
    parser.add_argument("--metrics-out", default=None, help="JSON lines file, one line per step")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    common.add_common_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = common.parse_and_prepare(build_parser(), argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    import jax
    import numpy as np
    from tqdm import tqdm

    from zeropp_jax import data
    from zeropp_jax.models import gpt

    try:
        tokens, vocab = data.load_tokens(args.data)
        batches = data.TokenBatches(
            tokens, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed
        )
        mesh = common.build_mesh(args)
        model_cfg = common.build_model(args, vocab)
        params_shapes = jax.eval_shape(
            lambda key: gpt.init_params(model_cfg, key), jax.random.key(args.seed)
        )
        trainer = common.build_trainer(args, mesh, model_cfg, params_shapes)
    except (ValueError, FileNotFoundError) as e:
        common.fail(str(e))

    is_main = jax.process_index() == 0
    info = trainer.describe()
    if is_main:
        print(
            f"zeropp-train: preset={args.preset} mesh={trainer.nodes}x{trainer.local} "
            f"({jax.devices()[0].platform}) params={info['params']:,} "
            f"dtype={info['compute_dtype']} tokens={len(tokens):,} vocab={vocab}",
            flush=True,
        )
    params = gpt.init_params(model_cfg, jax.random.key(args.seed))
    state = trainer.init(params)
    del params

    metrics_file = open(args.metrics_out, "w") if (args.metrics_out and is_main) else None
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(
        total=args.steps, disable=args.no_progress or not is_main,
        unit="step", dynamic_ncols=True, file=sys.stderr,
    )
    history: list[float] = []
    pending = None  # metrics of the previous step, read one step late
    start = time.perf_counter()
    last_time = start

    def record(step: int, metrics) -> float:
        nonlocal last_time
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(values["loss"]):
            bar.close()
            common.fail(
                f"loss became {values['loss']} at step {step}: training diverged or a "
                "parameter/gradient is not finite (try a lower --lr)"
            )
        now = time.perf_counter()
        history.append(values["loss"])
        tok_s = tokens_per_step / max(now - last_time, 1e-9)
        last_time = now
        bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{tok_s:,.0f}")
        bar.update(1)
        if metrics_file is not None:
            line = {"step": step, **values, "compressed": int(values["compressed"]), "time": now - start}
            metrics_file.write(json.dumps(line) + "\n")
            metrics_file.flush()
        return values["grad_rms"]

    # The qgZ schedule is decided here, on the host, from the step number and
    # the last gradient RMS already read back (metrics are read one step late
    # so the device never waits for the host).
    last_rms = float("inf")
    for step in range(args.steps):
        batch = trainer.shard_batch(_local_rows(batches, step))
        compress = trainer.compress_at(step, last_rms)
        state, metrics = trainer.step(state, batch, compress=compress)
        if pending is not None:
            last_rms = record(*pending)
        pending = (step, metrics)
    if pending is not None:
        record(*pending)
    bar.close()
    elapsed = time.perf_counter() - start
    if metrics_file is not None:
        metrics_file.close()

    if is_main:
        n = len(history)
        tail = history[-max(1, n // 10):]
        summary = {
            "preset": args.preset,
            "mesh": f"{trainer.nodes}x{trainer.local}",
            "steps": n,
            "first_loss": history[0],
            "final_loss": history[-1],
            "mean_loss_last_10pct": float(np.mean(tail)),
            "seconds": round(elapsed, 2),
            "tokens_per_second": round(n * tokens_per_step / elapsed, 1),
        }
        print("summary: " + json.dumps(summary), flush=True)
    return 0


def _local_rows(batches, step: int):
    import jax

    if jax.process_count() == 1:
        return batches.batch_at(step)
    return batches.local_batch_at(
        step, process_index=jax.process_index(), process_count=jax.process_count()
    )


if __name__ == "__main__":
    sys.exit(main())
