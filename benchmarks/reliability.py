"""Replays issue 20's reliability probes against the command-line tools; prints a table.

Each probe runs ``zeropp-train`` / ``zeropp-export`` / ``zeropp-launch`` in a
fresh process on a tiny model (2x4 simulated CPU devices) and compares what
happened with what must happen. Run from the repository root::

  python benchmarks/reliability.py            # about 2 minutes on 2 CPU cores

Exit status 0 when every row passes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

TRAIN = [sys.executable, "-m", "zeropp_jax.cli.train", "--no-progress", "--mesh", "2x4",
         "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
         "--batch-size", "8", "--dtype", "fp32", "--preset", "zero3"]
EXPORT = [sys.executable, "-m", "zeropp_jax.cli.export"]
LAUNCH = [sys.executable, "-m", "zeropp_jax.cli.launch"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def last_error(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return f"rc {proc.returncode}: {lines[-1][:90] if lines else ''}"


def flip_data_bytes(step_dir: str) -> None:
    """Rewrites the largest params data file with one byte changed in its middle."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "params"))
             for f in fs if os.sep + "d" + os.sep in os.path.join(r, f) + os.sep]
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


def probes(tmp: str):
    """Yields ``(probe, expected, observed, passed)``."""
    ckpt, metrics = os.path.join(tmp, "ckpt"), os.path.join(tmp, "m.jsonl")
    base = TRAIN + ["--checkpoint-dir", ckpt, "--save-every", "2", "--keep", "2",
                    "--metrics-out", metrics]

    p = run(TRAIN + ["--lr", "inf"])
    yield "--lr inf", "usage error (rc 2)", last_error(p), p.returncode == 2 and "finite" in p.stderr

    p = run(TRAIN + ["--metrics-out", os.path.join(tmp, "missing", "m.jsonl")])
    ok = p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr
    yield "--metrics-out in a missing directory", "one-line error", last_error(p), ok

    p = run(TRAIN + ["--steps", "6", "--lr", "30"])
    ok = p.returncode == 1 and '"diverged": true' in p.stdout
    yield "--lr 30 (finite blow-up)", "diverged, rc 1", last_error(p), ok

    p = run(base + ["--steps", "6"])
    yield "train 6 steps, save every 2", "rc 0", last_error(p), p.returncode == 0

    p = run(base + ["--steps", "8", "--resume", "--heads", "4"])
    ok = p.returncode == 2 and "--heads" in p.stderr
    yield "resume with --heads 4 (saved 2)", "error naming --heads", last_error(p), ok

    p = run(base + ["--steps", "8", "--resume", "--lr-schedule", "constant"])
    ok = p.returncode == 2 and "--lr-schedule cosine" in p.stderr
    yield "resume cosine -> constant", "error naming the fix", last_error(p), ok

    saved = os.path.join(tmp, "ckpt-copy")
    shutil.copytree(ckpt, saved)
    flip_data_bytes(os.path.join(ckpt, "6"))
    p = run(base + ["--steps", "8", "--resume"])
    ok = (p.returncode == 0 and f"resumed from {ckpt}/4" in p.stdout
          and os.path.isdir(os.path.join(ckpt, "6.corrupt")))
    yield "flipped bytes in the newest checkpoint", "resume from 4, 6.corrupt", last_error(p), ok
    steps = [json.loads(line)["step"] for line in open(metrics)]
    yield "metrics after resume", "one line per step 0..7", f"steps {steps}", steps == list(range(8))

    p = run(EXPORT + [saved, tmp])
    ok = p.returncode == 2 and "is a directory" in p.stderr and "Traceback" not in p.stderr
    yield "zeropp-export onto a directory", "one-line error", last_error(p), ok

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = run(LAUNCH + ["-n", "2", "--port", str(port), "--", sys.executable, "-c", "pass"])
    ok = p.returncode == 2 and "in use" in p.stderr
    yield "zeropp-launch on a port in use", "one-line error", last_error(p), ok


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for probe, expected, observed, passed in probes(tmp):
            rows.append((probe, expected, observed, "pass" if passed else "FAIL"))
            print(" | ".join(rows[-1]), flush=True)
    print()
    widths = [max(len(r[i]) for r in rows + [("probe", "expected", "observed", "")]) for i in range(4)]
    for row in [("probe", "expected", "observed", "")] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    return 0 if all(r[3] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
