"""``Trainer.precompile``: every variant of the qgZ schedule compiled before its first use."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zp
from zeropp_jax.step.compiling import CompileAhead
from zeropp_jax.step.schedule import QgzSchedule

from _util import mesh_of

# A program lowered, compiled, or loaded from the persistent compilation cache
# (tests/conftest.py): none of them happens for a step found in jit's cache.
COMPILING = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
             "/jax/core/compile/backend_compile_duration",
             "/jax/compilation_cache/cache_retrieval_time_sec")


def _mlp(rows=16):
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(16, 16)).astype(np.float32) * 0.3,
              "w2": rng.normal(size=(16, 1)).astype(np.float32) * 0.3}
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    batch = {"x": x, "y": x.sum(axis=1, keepdims=True) * 0.1}

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    return params, batch, loss


def _trainer(warmup=2, **config):
    params, batch, loss = _mlp()
    config = zp.ZeroConfig(qgz="1bit", qgz_warmup_steps=warmup, **config)
    trainer = zp.make_trainer(loss, optax.adam(0.01), params, mesh=mesh_of(2, 4), config=config)
    return trainer, trainer.init(params), batch


@contextlib.contextmanager
def _compiles(events=COMPILING):
    """``(thread name, start, end)`` of each of ``events`` in the block (a
    program lowered, compiled or loaded; ``perf_counter`` seconds)."""
    spans = []

    def listen(event, seconds, **kwargs):
        if event in events:
            end = time.perf_counter()
            spans.append((threading.current_thread().name, end - seconds, end))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield spans
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _run(trainer, state, batch, steps):
    losses, compressed = [], []
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
        compressed.append(int(metrics["compressed"]))
    return losses, compressed


def test_precompiled_steps_compile_nothing():
    """After ``precompile`` the warm-up's steps and the compressed ones after
    it run from jit's cache (nothing lowered or compiled), with the losses of
    a trainer that compiled each at first use; without it, both compile there."""
    trainer, state, batch = _trainer()
    with _compiles() as cold:
        expected = _run(trainer, state, batch, 4)
    assert expected[1] == [0, 0, 1, 1]
    assert len(cold) >= 2  # the control: each variant compiled at its first step

    trainer, state, batch = _trainer()
    seconds = trainer.precompile(state, batch)
    assert list(seconds) == [False, True] and all(s > 0 for s in seconds.values())
    with _compiles() as warm:
        assert _run(trainer, state, batch, 4) == expected
    assert warm == []


def test_background_precompile_compiles_in_a_worker_the_step_waits_for():
    """``background=True`` returns at once; the step's variants lower and
    compile in the worker only: a step waits for its variant there (no
    compile twice)."""
    trainer, state, batch = _trainer()
    expected = _run(*_trainer(), 4)
    with _compiles() as compiled:
        futures = trainer.precompile(state, batch, background=True)
        assert list(futures) == [False, True]
        assert _run(trainer, state, batch, 4) == expected
        seconds = {compress: future.result() for compress, future in futures.items()}
    assert all(s > 0 for s in seconds.values())
    assert compiled and all(name.startswith("zeropp-precompile") for name, *_ in compiled), compiled


def test_lower_waits_for_a_variant_the_worker_compiles():
    """``lower`` (the communication report's compile) of a variant still
    compiling in the background waits for it: nothing compiles twice; a second
    background precompile hands back the futures of the first."""
    trainer, state, batch = _trainer()
    with _compiles() as compiled:
        futures = trainer.precompile(state, batch, background=True)
        assert trainer.precompile(state, batch, background=True) == futures
        trainer.lower(state, batch, compress=True).compile()
        trainer.compile_from_shapes(jax.eval_shape(lambda: _mlp()[0]), batch, compress=False)
    assert compiled and all(name.startswith("zeropp-precompile") for name, *_ in compiled), compiled


def test_the_trainers_compiles_beside_a_background_precompile_wait_their_turn():
    """The trainer keeps its own compiles to one at a time beside its worker
    (a load from the persistent cache beside the worker's compile once
    crashed XLA:CPU): an ``evaluate`` right after a background precompile
    compiles only once the worker is idle; steps of the worker's variants run
    meanwhile."""
    trainer, state, batch = _trainer()
    with _compiles(COMPILING[1:]) as spans:  # XLA's compiles and loads, not lowering
        futures = trainer.precompile(state, batch, background=True)
        trainer.evaluate(state, batch)
        assert all(f.done() for f in futures.values())  # evaluate waited for the worker
        _run(trainer, state, batch, 3)
    worker = [s for s in spans if s[0].startswith("zeropp-precompile")]
    caller = [s for s in spans if not s[0].startswith("zeropp-precompile")]
    assert worker and caller
    overlaps = [(w, c) for w in worker for c in caller if c[1] < w[2] and w[1] < c[2]]
    assert not overlaps, overlaps


@pytest.mark.parametrize("call", [
    lambda trainer, state, batch, params: trainer.gather_params(state),
    lambda trainer, state, batch, params: trainer.init(params),
    lambda trainer, state, batch, params: trainer.init_from(lambda: params),
    lambda trainer, state, batch, params: trainer.precompile(state, batch),
    lambda trainer, state, batch, params: trainer.step(state, batch, compress=False),
    lambda trainer, state, batch, params: trainer.wait_for_precompile(),
], ids=["gather_params", "init", "init_from", "precompile", "step_of_another_variant", "wait"])
def test_each_trainer_call_that_compiles_waits_for_the_worker(call):
    """Each returns only after the background compiles (here of the
    compressed step alone: no warm-up) have ended."""
    params, batch, loss = _mlp()
    trainer = zp.make_trainer(loss, optax.adam(0.02), params, mesh=mesh_of(2, 4),
                              config=zp.ZeroConfig(qgz="1bit"))
    state = trainer.init(params)
    futures = trainer.precompile(state, batch, background=True)
    assert list(futures) == [True]
    call(trainer, state, batch, params)
    assert all(f.done() for f in futures.values())


def test_a_variant_the_worker_does_not_compile_waits_until_it_is_idle():
    ahead = CompileAhead()
    released = threading.Event()
    futures = ahead.start({True: lambda: released.wait(60.0)})
    waiter = threading.Thread(target=ahead.wait, args=(False,))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not futures[True].done()
    released.set()
    waiter.join(60.0)
    assert not waiter.is_alive() and futures[True].done()
    ahead.wait(True)  # the worker's own variant: at once, done


def test_queued_compiles_are_cancelled_at_exit(tmp_path):
    """A program that ends while the worker compiles waits for that compile
    only: the queued ones are cancelled (a real interpreter exit)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import pathlib, time
        from zeropp_jax.step.compiling import CompileAhead
        out = pathlib.Path({str(tmp_path)!r})
        def running():
            time.sleep(1.0)
            (out / "running").write_text("done")
        def queued():
            (out / "queued").write_text("done")
        CompileAhead().start({{False: running, True: queued}})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert (tmp_path / "running").exists() and not (tmp_path / "queued").exists()


def test_with_pgle_nothing_is_compiled_and_a_warning_says_so():
    trainer, state, batch = _trainer()
    jax.config.update("jax_enable_pgle", True)
    try:
        with pytest.warns(UserWarning, match="compiles nothing with PGLE on"):
            assert trainer.precompile(state, batch) == {}
    finally:
        jax.config.update("jax_enable_pgle", False)


def test_precompile_checks_its_state_and_batch():
    trainer, state, batch = _trainer()
    with pytest.raises(TypeError, match="trainer.precompile takes the TrainState"):
        trainer.precompile(state.params, batch)
    with pytest.raises(ValueError, match="divisible by devices x grad_accum"):
        trainer.precompile(state, jax.tree.map(lambda b: b[:12], batch))
    with pytest.raises(ValueError, match="arrays are not on this trainer's mesh"):
        trainer.precompile(jax.device_get(state), batch)
    trainer.step(state, batch)  # donates state
    with pytest.raises(ValueError, match="consumed"):
        trainer.precompile(state, batch)


@pytest.mark.parametrize("schedule, step, variants", [
    (QgzSchedule(active=False), 0, (False,)),
    (QgzSchedule(active=True), 0, (True,)),
    (QgzSchedule(active=True, warmup_steps=3), 0, (False, True)),
    (QgzSchedule(active=True, warmup_steps=3), 2, (False, True)),
    (QgzSchedule(active=True, warmup_steps=3), 3, (True,)),  # the warm-up over: one variant left
    (QgzSchedule(active=True, warmup_steps=3, refresh_every=5), 7, (False, True)),  # a refresh
    (QgzSchedule(active=True, warmup_steps=3, refresh_every=5), 9, (True, False)),
    (QgzSchedule(active=True, min_grad_rms=1e-3), 10, (True, False)),  # the gate
])
def test_schedule_variants_from(schedule, step, variants):
    assert schedule.variants_from(step) == variants
    assert schedule.compress_at(step, float("inf")) == variants[0]


def test_the_gate_decides_the_first_variant_from_the_states_gradient():
    gated = QgzSchedule(active=True, min_grad_rms=1e-3)
    assert gated.variants_from(10, 1e-4) == (False, True)  # held back by the gate
    assert gated.variants_from(10, jnp.float32(1e-2)) == (True, False)
    trainer, state, batch = _trainer(warmup=0, qgz_min_grad_rms=1e9)  # every step gated once run
    assert list(trainer.precompile(state, batch)) == [True, False]  # inf before the first step
    state, _ = trainer.step(state, batch)
    assert list(trainer.precompile(state, batch)) == [False, True]


def test_the_stall_benchmark_draws_its_timelines(tmp_path, monkeypatch):
    """``benchmarks/compile_stall.py``'s figure from a run's JSON (the script sets
    XLA_FLAGS when imported: kept out of this process's environment)."""
    import importlib.util
    import os
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "compile_stall.py"
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    spec = importlib.util.spec_from_file_location("compile_stall", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def mode(name, starts, compile_s=None, finished=None):
        return {"step_start_at_s": starts, "step_s": [1.0] * len(starts),
                "compressed": [0, 1, 1][: len(starts)], "compile_s": compile_s,
                "compile_finished_at_s": finished,
                "precompile_call_s": 2.0 if name == "precompile" else 0.0}

    result = {"config": {"layers": 2, "warmup": 1}, "git": "abc1234", "modes": {
        "first-use": mode("first-use", [0.0, 1.0, 5.0]),
        "precompile": mode("precompile", [2.0, 3.0, 4.0], {"false": 1.0, "true": 1.0}),
        "background": mode("background", [0.0, 1.5, 2.5], {"false": 1.0, "true": 1.2},
                           {"false": 1.0, "true": 2.2})}}
    out = tmp_path / "stall.png"
    (tmp_path / "run.txt").write_text("| table |\n" + json.dumps(result) + "\n")
    assert module.main(["--replot", str(tmp_path / "run.txt"), "--figure", str(out)]) == 0
    assert out.stat().st_size > 10_000
