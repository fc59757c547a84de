"""The README's Python examples run as written (so the README stays true)."""

import os
import re
import subprocess
import sys
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


@pytest.mark.timeout(120)
def test_readme_examples_run_again_in_the_same_folder(tmp_path, monkeypatch):
    """A reader runs the examples twice (after an edit, say): the arrays the first run wrote are replaced,
    not a ContainsArrayError."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    code = compile("\n".join(blocks), str(README), "exec")
    for _ in range(2):
        exec(code, {"__name__": "readme"})
    assert (tmp_path / "volume.zarr").exists() and (tmp_path / "t2m.zarr").exists()


@pytest.mark.timeout(300)
def test_readme_training_example_runs_as_its_own_file(tmp_path, monkeypatch):
    """The Trainer block, saved as train.py beside the volume the first block writes, runs with python."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})  # writes volume.zarr
    (script,) = [b for b in blocks if "st.launch(main" in b]
    (tmp_path / "train.py").write_text(script)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs/readme/ckpt").iterdir()) == ["step-000000005.pt",
                                                                                 "step-000000010.pt"]


def test_readme_install_block_names_every_extra():
    """Each extra of pyproject.toml has its line in the README's Install block (stoker bench's was missing,
    so a reader could not learn that tensorstore comes with `.[bench]`)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the package supports 3.10

    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = README.read_text().split("## Install", 1)[1].split("```", 2)[1]
    named = set(re.findall(r'pip install -e "\.\[([\w-]+)\]"', install)) | set(re.findall(r'"\.\[([\w-]+)\]"', install))
    assert sorted(set(extras) - named - {"lint", "docs"}) == [], install  # lint and docs: make lint, make docs


def test_readme_errors_section_names_every_error_class():
    """"All errors derive from stoker.StokerError": the section names each one stoker raises."""
    import inspect

    import stoker.errors

    text = README.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    classes = [name for name, obj in vars(stoker.errors).items()
               if inspect.isclass(obj) and issubclass(obj, stoker.errors.StokerError)]
    assert [name for name in classes if f"`{name}`" not in text and f"`stoker.{name}`" not in text] == []


def test_every_error_the_readme_names_is_an_attribute_of_stoker():
    """The README lists the errors as stoker's (`except stoker.NonFiniteLoss:`); MissingDependency was only in
    stoker.errors, so `except stoker.MissingDependency` was an AttributeError inside the handler."""
    import inspect

    import stoker
    import stoker.errors

    classes = [name for name, obj in vars(stoker.errors).items()
               if inspect.isclass(obj) and issubclass(obj, stoker.errors.StokerError)]
    assert [name for name in classes if getattr(stoker, name, None) is not getattr(stoker.errors, name)] == []
    assert [name for name in classes if name not in stoker.__all__] == []
