"""``zeropp-train``: train the example GPT on the default data with ZeRO-3/ZeRO++.

Example::

  zeropp-train --mesh 2x4 --preset zeropp --steps 300 --metrics-out m.jsonl
  # checkpoint every 100 steps; after a stop, the same command with --resume
  # continues from the newest readable checkpoint (on any mesh):
  zeropp-train --mesh 2x4 --steps 300 --checkpoint-dir ckpt --save-every 100 --resume
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time

from zeropp_jax import provenance
from zeropp_jax.cli import common, data_flags, guards, held_out, resume
from zeropp_jax.files import output_problem

DEFAULT_PRESET = "zeropp"

PROG = "zeropp-train"  # the name in --help and in error lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train the example byte-level GPT with ZeRO-3 / ZeRO++ "
        "sharded data parallelism over a (node, local) mesh. Runs the "
        f"{DEFAULT_PRESET} preset unless --preset says otherwise.",
    )
    parser.add_argument("--steps", type=common.positive_int, default=300,
                        help="optimizer steps (default: %(default)s)")
    parser.add_argument("--metrics-out", default=None, help="JSON lines file, one line per step")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--allow-divergence", action="store_true",
        help="exit 0 even when the run diverged (final loss above twice the lowest "
        "loss of the first 10%% of steps and above the first loss; see "
        "zeropp_jax.cli.guards.diverged)",
    )
    g = parser.add_argument_group("checkpoints (Orbax; see zeropp_jax.checkpoint)")
    g.add_argument(
        "--checkpoint-dir", default=None, metavar="DIR",
        help="save checkpoints (params, optimizer and qgZ state, step) under DIR, "
        "at the end of training and every --save-every steps",
    )
    g.add_argument(
        "--save-every", type=common.positive_int, default=None, metavar="N",
        help="also save every N steps (default: only at the end)",
    )
    g.add_argument(
        "--keep", type=common.positive_int, default=3, metavar="K",
        help="keep the newest K checkpoints (default: 3)",
    )
    g.add_argument(
        "--resume", action="store_true",
        help="continue from the newest readable checkpoint in --checkpoint-dir "
        "(any mesh); start from step 0 if there is none",
    )
    held_out.add_flags(parser)
    common.add_common_args(parser)
    # The main job shows the point of the library: ZeRO++ (ZeroConfig's own
    # default, and zeropp-comm's, stays plain ZeRO-3).
    parser.set_defaults(preset=DEFAULT_PRESET)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run(common.parse_and_prepare(parser, argv, check=_check_checkpoint_args))


def _check_checkpoint_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.checkpoint_dir is None:
        keep = args.keep != parser.get_default("keep")  # a --keep of the default is harmless
        for flag, value in (("--save-every", args.save_every), ("--resume", args.resume),
                            ("--keep", keep)):
            if value:
                parser.error(f"{flag} needs --checkpoint-dir (add --checkpoint-dir DIR, "
                             f"or leave {flag} out)")
    elif os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        parser.error(f"--checkpoint-dir {args.checkpoint_dir} is a file")
    if args.metrics_out is not None:
        problem = output_problem("--metrics-out", args.metrics_out,
                                 {"--data": args.data, "--eval-data": args.eval_data})
        if problem:
            parser.error(problem)
    held_out.check_flags(parser, args)
    if args.lr_warmup is not None and args.lr_warmup >= args.steps:
        parser.error(f"--lr-warmup {args.lr_warmup} is not shorter than --steps {args.steps}: "
                     "the learning rate would never reach --lr; shorten the warm-up")


def run(args: argparse.Namespace) -> int:
    import jax
    import numpy as np
    from tqdm import tqdm

    from zeropp_jax import distributed
    from zeropp_jax.models import gpt

    try:
        batches, vocab, data_print = data_flags.load_batches(args)
        evaluation = held_out.load(args, vocab, jax.process_count())
        mesh = common.build_mesh(args)
        model_cfg = common.build_model(args, vocab)
        params_shapes = jax.eval_shape(
            lambda key: gpt.init_params(model_cfg, key), jax.random.key(args.seed)
        )
        trainer = common.build_trainer(args, mesh, model_cfg, params_shapes)
    except (ValueError, FileNotFoundError) as e:
        common.fail(PROG, str(e))

    is_main = jax.process_index() == 0
    info = trainer.describe()
    if is_main:
        print(
            f"zeropp-train: preset={args.preset} mesh={trainer.nodes}x{trainer.local} "
            f"({jax.devices()[0].platform}) params={info['params']:,} "
            f"dtype={info['compute_dtype']} tokens={data_print.tokens:,} vocab={vocab}",
            flush=True,
        )
    common.warn(PROG, guards.start_warnings(trainer, args.steps)
                + held_out.start_warnings(args, evaluation, jax.process_count()))
    record_of_run = guards.run_record(args, dataclasses.asdict(model_cfg), data_print)
    ckpt, state, restored_meta = resume.open_checkpoints(args, trainer, is_main, record_of_run)
    if state is None:
        # Each unit drawn already split: no device holds the whole model.
        state = trainer.init_from(lambda key: gpt.init_params(model_cfg, key),
                                  jax.random.key(args.seed))
    # The data position is the step: batch k is a pure function of (seed, k).
    first_step = int(state.step)
    if first_step >= args.steps:
        if is_main:
            print(f"zeropp-train: the checkpoint is at step {first_step} >= --steps "
                  f"{args.steps}; nothing to train", flush=True)
        if ckpt is not None:
            ckpt.close()
        return 0

    metrics_file = _open_metrics(args.metrics_out, first_step) if is_main else None
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(
        total=args.steps, initial=first_step, disable=args.no_progress or not is_main,
        unit="step", dynamic_ncols=True, file=sys.stderr,
    )
    # Every variant the schedule will take compiles in the background from
    # here, the first step's first (the first step waits for it): no stop for
    # a compile where the warm-up ends or a refresh or the gate switches.
    trainer.precompile(state, _local_rows(batches, first_step), background=True)
    history: list[float] = []
    eval_losses: dict[int, float] = {}  # steps done -> held-out loss
    eval_seconds = 0.0
    bounded: list[float] = []  # 1-bit Adam: coordinates held at Adam's bound, per step
    pending = None  # metrics of the previous step, read one step late
    start = last_time = time.perf_counter()

    def record(step: int, metrics, eval_loss: float | None) -> None:
        nonlocal last_time
        values = {k: int(v) if k in ("compressed", "bounded") else float(v)
                  for k, v in jax.device_get(metrics).items()}
        values.update({} if eval_loss is None else {"eval_loss": eval_loss})
        if not math.isfinite(values["loss"]):
            bar.close()
            common.fail(
                PROG,
                f"loss became {values['loss']} at step {step}: the parameters or the "
                f"gradient are not finite; training diverged (try a lower --lr than "
                f"{args.lr}) or the data hold extreme values{_kept(ckpt)}"
            )
        now = time.perf_counter()
        history.append(values["loss"])
        bounded.extend([values["bounded"]] if "bounded" in values else [])
        tok_s = tokens_per_step / max(now - last_time, 1e-9)
        last_time = now
        bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{tok_s:,.0f}", **(
            {} if eval_loss is None else {"eval": f"{eval_loss:.4f}"}))
        bar.update(1)
        if metrics_file is not None:
            line = {"step": step, **values, "time": now - start}
            metrics_file.write(json.dumps(line) + "\n")
            metrics_file.flush()

    # The qgZ schedule (trainer.schedule, the library's) is decided on the
    # host from the step number; only a gradient-RMS gate reads the previous
    # step's RMS from the state, and only on the steps it decides.
    # The newest saved step, from what every process knows alike (not from a
    # listing of the directory, which may differ between processes).
    last_saved = first_step if restored_meta is not None else None  # resumed from it
    stopped_at = None  # the step a preemption notice (SIGTERM) or Ctrl-C stopped the run at
    # The notice covers the loop and the saves after it: a second SIGTERM while
    # the preemption checkpoint is written is noted again, not fatal; a second Ctrl-C is.
    with distributed.PreemptionNotice() as notice:
        try:
            for step in range(first_step, args.steps):
                if notice.reached(step):
                    stopped_at = step
                    break
                batch = trainer.shard_batch(_local_rows(batches, step))
                compress = trainer.schedule.compress_at(step, state.opt_state.qgz.grad_rms)
                state, metrics = trainer.step(state, batch, compress=compress)
                if pending is not None:
                    record(*pending)
                done = step + 1
                if evaluation is not None and evaluation.due(done, args.steps):
                    jax.block_until_ready(state)  # the step's time is not the evaluation's
                    eval_start = time.perf_counter()
                    eval_losses[done], problem = held_out.loss_or_problem(trainer, state, evaluation)
                    if problem:  # the trained steps are logged and saved first
                        record(step, metrics, None)
                        if ckpt is not None:
                            _save(ckpt, done, state, trainer, record_of_run, args.lr)
                        common.fail(PROG, f"--eval-data {args.eval_data}: after step {done}, "
                                          f"{problem}{_kept(ckpt)}")
                    spent = time.perf_counter() - eval_start  # not training time
                    eval_seconds += spent
                    last_time += spent
                pending = (step, metrics, eval_losses.get(done))
                periodic = args.save_every and done % args.save_every == 0
                if ckpt is not None and (periodic or done == args.steps):
                    # Every step up to the save is checked and logged before it.
                    record(*pending)
                    pending = None
                    _save(ckpt, done, state, trainer, record_of_run, args.lr)
                    last_saved = done
            if pending is not None:
                record(*pending)
            if stopped_at is not None and ckpt is not None and stopped_at != last_saved:
                _save(ckpt, stopped_at, state, trainer, record_of_run, args.lr)
        finally:
            if ckpt is not None:
                ckpt.close()  # waits for the last (asynchronous) save
    if stopped_at is None and notice.received == signal.SIGINT:
        # A Ctrl-C in the last step or while its checkpoint was finished (the
        # step is saved if there is a --checkpoint-dir): stop before the report.
        stopped_at = args.steps
    bar.close()
    elapsed = time.perf_counter() - start - eval_seconds
    if metrics_file is not None:
        metrics_file.close()
    if stopped_at is not None:
        if is_main:
            kept = (f"checkpoint {ckpt.step_path(stopped_at)} holds it: the same command "
                    "with --resume continues" if ckpt is not None else
                    "no --checkpoint-dir, so the trained steps are not saved")
            why = ("Ctrl-C (SIGINT; a second one stops at once)"
                   if notice.received == signal.SIGINT else "a preemption notice (SIGTERM)")
            print(f"zeropp-train: stopped at step {stopped_at} of {args.steps} on "
                  f"{why}; {kept}", file=sys.stderr, flush=True)
        return notice.exit_status

    diverged = guards.diverged(history)
    if is_main:
        print("zeropp-train: compiling the step's variants for the communication report ...",
              flush=True)
    # Every process compiles them (no process waits alone at the exit barrier
    # of jax.distributed, which times out); process 0 reports.
    from zeropp_jax.analysis import headline

    batch_shape = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), np.int32)
    figures = headline.step_bytes(trainer, params_shapes, batch_shape, steps=args.steps)
    if is_main:
        n = len(history)
        tail = history[-max(1, n // 10):]
        summary = {
            "preset": args.preset,
            "mesh": f"{trainer.nodes}x{trainer.local}",
            "steps": n,
            "first_step": first_step,
            "first_loss": history[0],
            "final_loss": history[-1],
            "mean_loss_last_10pct": float(np.mean(tail)),
            "diverged": diverged,
            "seconds": round(elapsed, 2),
            "tokens_per_second": round(n * tokens_per_step / elapsed, 1),
        }
        if eval_losses:  # the held-out loss after the last step (and at each --eval-every)
            summary.update(eval_loss=eval_losses[args.steps], eval_rows=len(evaluation.rows),
                           eval_losses={str(k): v for k, v in eval_losses.items()},
                           eval_seconds=round(eval_seconds, 2))
        if bounded:  # compressed steps that held some, and how many coordinates in all
            summary["bounded"] = {"steps": sum(map(bool, bounded)), "coordinates": int(sum(bounded))}
        summary.update(figures)
        # where the figures came from: every flag's value, the code's commit, the machine
        summary["flags"] = vars(args)
        summary["provenance"] = provenance.record()
        print("summary: " + json.dumps(summary, default=str), flush=True)
        for line in headline.summary_line(summary, steps=args.steps).splitlines():
            print("zeropp-train: " + line, flush=True)
        if diverged:
            print(
                f"zeropp-train: warning: the run diverged: final loss {history[-1]:.6g} is above "
                f"the first loss {history[0]:.6g} and twice the lowest of the first 10% of "
                f"steps (try a lower --lr than {args.lr}; --allow-divergence exits 0)",
                file=sys.stderr, flush=True,
            )
    return 1 if diverged and not args.allow_divergence else 0


def _save(ckpt, step: int, state, trainer, record_of_run: dict, lr: float) -> None:
    """Saves checkpoint ``step``; a state that is not finite stops the run instead."""
    from zeropp_jax.checkpoint import NonFiniteStateError

    try:
        ckpt.save(step, state, trainer, record_of_run)
    except NonFiniteStateError as e:
        common.fail(PROG, f"{e}; the update of step {step - 1} made them so: the learning "
                          f"rate may be too high (try a lower --lr than {lr}){_kept(ckpt)}")


def _kept(ckpt) -> str:
    """Names the newest checkpoint that stays (for an error message), or nothing."""
    if ckpt is None:
        return ""
    ckpt.wait()
    steps = ckpt.all_steps()
    return f"; the newest checkpoint, step {steps[-1]}, stays" if steps else ""


def _open_metrics(path: str | None, first_step: int):
    """The metrics file; a resumed run keeps one line of each earlier step."""
    if path is None:
        return None
    guards.rewrite_metrics(path, first_step)
    return open(path, "a")


def _local_rows(batches, step: int):
    import jax

    if jax.process_count() == 1:
        return batches.batch_at(step)
    return batches.local_batch_at(
        step, process_index=jax.process_index(), process_count=jax.process_count()
    )


if __name__ == "__main__":
    sys.exit(main())
