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
    namespace = {"__name__": "readme"}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)
    assert (tmp_path / "volume.zarr").exists()
    # The training example's launch line is behind a __main__ guard (spawned ranks import the script);
    # run its main here as one in-process rank, the same code path each spawned rank takes.
    from stoker.train import launch

    rate = launch(namespace["main"], "volume.zarr", nprocs=1, use_cuda=False)
    assert rate > 0
    assert sorted(p.name for p in (tmp_path / "runs/readme/ckpt").iterdir()) == ["step-000000005.pt",
                                                                                 "step-000000010.pt"]
