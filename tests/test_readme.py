"""The README's Python example runs as written (on 8 simulated devices)."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_runs(capsys):
    text = README.read_text()
    section = text[text.index("## Python API"):]
    # The runnable example: the block that trains the example GPT end to end.
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    code = next(b for b in blocks if "full_params =" in b)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    loss = float(capsys.readouterr().out.split()[-1])
    assert np.isfinite(loss) and loss < np.log(256)
    full = namespace["full_params"]
    assert full["embed"]["tokens"].shape == (256, 64)


def test_readme_quickstart_has_the_two_commands():
    text = README.read_text()
    quick = text[text.index("## Quickstart"):text.index("## Python API")]
    commands = re.findall(r"```bash\n(.*?)\n```", quick, re.S)
    assert commands == ["pip install -e . && zeropp-train",
                        "pip install -e '.[test]' && python -m pytest -q -n 2 --dist loadfile"]
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()  # CI runs exactly the README's command
