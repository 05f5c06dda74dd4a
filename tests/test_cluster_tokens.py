"""benchmarks/cluster_tokens.py: workloads parsed, rows collected, merged and drawn (no cluster)."""

import importlib.util
import json
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "cluster_tokens.py"
_spec = importlib.util.spec_from_file_location("cluster_tokens", _PATH)
ct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ct)


def test_workloads_and_widths_parse_and_bad_ones_say_why(capsys):
    options, bench = ct.parse_args(["--workloads", "8x32,16X128", "--d-models", "128,256", "--",
                                    "--rates", "50,0", "--dtype", "bfloat16"])
    assert options.workloads == [(8, 32), (16, 128)]
    assert options.d_models == [128, 256]
    assert bench == ["--rates", "50,0", "--dtype", "bfloat16"]
    for argv, words in ((["--workloads", "12x32"], ["12x32", "multiple", "8"]),
                        (["--workloads", "8by32"], ["8by32", "BATCHxSEQ"]),
                        (["--", "--seq-len", "64"], ["--seq-len", "--workloads"]),
                        (["--d-models", "0"], ["--d-models", "positive"])):
        with pytest.raises(SystemExit) as e:
            ct.parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), (argv, err)


def _bench(step_times):
    """A zeropp-cluster-bench JSON with the given {(preset, rate): step s}."""
    base = {rate: t for (p, rate), t in step_times.items() if p == ct.BASELINE}
    return {"command": ["zeropp-cluster-bench"], "records": [
        {"preset": p, "rate_mbit": rate, "step_time_s": t, "cycle_step_time_s": t,
         "speedup_vs_zero3_2level": base[rate] / t, "cycle_speedup_vs_zero3_2level": base[rate] / t,
         "predicted_speedup_vs_zero3_2level": None if rate == 0 else 0.9 * base[rate] / t,
         "link_bytes_per_node_per_step": 1e6}
        for (p, rate), t in step_times.items()]}


def test_rows_merge_and_draw(tmp_path, monkeypatch, capsys):
    first = ct.rows(128, 8, 32, _bench({(ct.BASELINE, 50.0): 0.4, ("zeropp", 50.0): 0.2,
                                        (ct.BASELINE, 0.0): 0.2, ("zeropp", 0.0): 0.21}))
    assert [r["tokens_per_device"] for r in first] == [32] * 4
    assert first[1]["speedup_vs_zero3_2level"] == pytest.approx(2.0)
    second = ct.rows(256, 16, 128, _bench({(ct.BASELINE, 50.0): 2.0, ("zeropp", 50.0): 1.0,
                                           (ct.BASELINE, 0.0): 0.8, ("zeropp", 0.0): 1.0}))
    paths = []
    for i, table in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps({"bench_commands": [["b"]], "rows": table}))
    figure, merged = tmp_path / "fig.png", tmp_path / "all.json"
    monkeypatch.setattr(sys, "argv", ["cluster_tokens.py"])
    assert ct.main(["--from-json", *map(str, paths), "--figure", str(figure),
                    "--json", str(merged)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == first + second == json.loads(merged.read_text())["rows"]
    assert figure.stat().st_size > 10_000
    # where the runs were made stays with the rows: each earlier file's record
    assert out["sources"] == [{"path": str(p), "provenance": None} for p in paths]


def test_sources_and_partial_results_of_a_sweep(tmp_path, monkeypatch, capsys):
    """A live sweep keeps every bench's provenance; a failed workload stops the
    sweep with its exit code after the finished ones are printed and written;
    outputs and --from-json files are checked before anything runs."""
    benches = iter([_bench({(ct.BASELINE, 50.0): 0.4, ("zeropp", 50.0): 0.2})])

    def run_workload(d_model, batch, seq, flags, out_dir):
        bench = next(benches, None)
        if bench is None:
            raise ct.WorkloadFailed(3)
        return {**bench, "provenance": {"git": "abc"}}

    monkeypatch.setattr(ct, "run_workload", run_workload)
    monkeypatch.setattr(sys, "argv", ["cluster_tokens.py"])
    saved = tmp_path / "partial.json"
    assert ct.main(["--workloads", "8x32,8x64", "--json", str(saved)]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(saved.read_text())
    assert len(out["rows"]) == 2 and out["failed"] == {"d_model": 128, "workload": "8x64",
                                                       "exit_code": 3}
    assert out["sources"] == [{"d_model": 128, "workload": "8x32", "provenance": {"git": "abc"}}]
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps(_bench({(ct.BASELINE, 0.0): 1.0})))
    for argv, words in ((["--figure", str(tmp_path / "f.xyz")], ["--figure", "file type"]),
                        (["--json", str(tmp_path / "no" / "x.json")], ["--json", "does not exist"]),
                        (["--from-json", str(tmp_path / "missing.json")], ["--from-json", "No such"]),
                        (["--from-json", str(bench_json)], ["not this script's --json"])):
        with pytest.raises(SystemExit) as e:
            ct.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and all(w in err for w in words), (argv, err)
