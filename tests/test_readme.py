"""The README's Python examples run as written (so the README stays true)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.timeout(120)
def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README should show Python examples"
    monkeypatch.chdir(tmp_path)
    exec(compile("\n".join(blocks), str(README), "exec"), {"__name__": "readme"})
    assert (tmp_path / "volume.zarr").exists()
