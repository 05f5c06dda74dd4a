"""Every notebook in notebooks/ runs top to bottom and writes its figures.

Runs small so the four fit in CI's time: short training (``ZEROPP_NB_STEPS``),
one gradient-accumulation setting (``ZEROPP_NB_ACCUMS``; accumulation's
bytes are tests/test_zeropp.py's) and four of the convergence study's nine
runs (``ZEROPP_NB_RUNS``; the other five configurations train in
tests/test_zeropp.py, test_momentum.py and test_dither.py). Figures go to a temporary folder, never
over the committed ones.
"""

import pathlib

import nbclient
import nbformat
import pytest

pytestmark = pytest.mark.slow  # every notebook runs top to bottom

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
# notebook -> figures it must write
FIGURES = {
    "01_quantization_error.ipynb": ["quantization_error.png"],
    "02_communication_volume.ipynb": ["comm_volume.png"],
    "03_convergence.ipynb": ["convergence.png"],
    "04_scaling.ipynb": ["scaling_bandwidth.png", "scaling_nodes.png"],
}
# Steps of training in the notebooks that train (the full runs use 200-400);
# 8 keeps a warm-up step before the compressed ones.
CI_STEPS = "8"
# 03_convergence's runs at CI size: the reference and one per code path the
# figure shows (1-bit Adam, 1-bit gradients with error feedback, zeropp).
CI_RUNS = "zero3|qgz (1-bit Adam)|qgz 1-bit gradients + EF|zeropp"


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(FIGURES)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_and_saves_figures(name, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROPP_FIGURES", str(tmp_path))
    monkeypatch.setenv("ZEROPP_NB_STEPS", CI_STEPS)
    monkeypatch.setenv("ZEROPP_NB_ACCUMS", "1")
    monkeypatch.setenv("ZEROPP_NB_RUNS", CI_RUNS)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TQDM_DISABLE", "1")  # no progress bars in the captured output
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        book, timeout=900, kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    for figure in FIGURES[name]:
        png = tmp_path / figure
        assert png.exists(), f"{name} did not write {figure}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
