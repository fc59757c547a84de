"""stoker is a real package: ``python -m build`` makes an sdist and, from it, a wheel that installs into a fresh
virtual environment, where ``stoker --help`` runs and a crop reads what zarr-python wrote.

The fresh environment gets the wheel with ``--no-deps``; its heavy dependencies (torch, zarr, numcodecs) are
made visible by a ``.pth`` line naming this interpreter's site-packages, which ``site`` appends after the new
environment's own site-packages, so the wheel's ``stoker`` is the one imported (checked). Nothing is downloaded:
the build runs without isolation, on this interpreter's setuptools.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import zarr

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _compiler() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None


def _run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, **kw)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist, and the wheel built from it (as ``python -m build`` does with no target named)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)], cwd=out)
    (sdist,) = out.glob("stoker-*.tar.gz")
    (wheel,) = out.glob("stoker-*.whl")
    return sdist, wheel


def test_sdist_holds_sources_tests_and_docs(dist):
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    csrc = {p.relative_to(REPO).as_posix() for p in (REPO / "src/stoker/csrc").iterdir() if p.suffix in (".c", ".h")}
    assert csrc and csrc <= names, f"missing C sources: {sorted(csrc - names)}"
    assert {"setup.py", "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "src/stoker/py.typed",
            "src/stoker/__init__.py",
            "docs/records.md", "mkdocs.yml", "tests/test_packaging.py"} <= names
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "__pycache__" in n]


def test_wheel_contents(dist):
    _, wheel = dist
    names = zipfile.ZipFile(wheel).namelist()
    assert "stoker/py.typed" in names
    assert "stoker/__init__.py" in names and "stoker/records/loader.py" in names
    assert any(n.startswith("stoker-0") and n.endswith(".dist-info/entry_points.txt") for n in names)
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]  # the one pyproject names
    assert "Apache License" in zipfile.ZipFile(wheel).read(license_file).decode()
    native = [n for n in names if n.startswith("stoker/_native") and n.endswith((".so", ".pyd"))]
    if _compiler():
        assert len(native) == 1, names
    # the tests' module (decode_files) is built in place only: a wheel never ships it
    assert not [n for n in names if n.startswith("stoker/_testing")], names
    stray = [n for n in names if not n.startswith(("stoker/", "stoker-"))
             or "__pycache__" in n or n.endswith(".pyc") or "/csrc/" in n]
    assert not stray, stray


def test_wheel_installs_into_a_fresh_venv_and_reads(dist, tmp_path):
    _, wheel = dist
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps", "--no-index",
          str(wheel)])
    own = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    # after the venv's own site-packages: this interpreter's, for torch, zarr, numcodecs... (their .pth files,
    # an editable stoker's among them, are not run: only the folders are appended to sys.path)
    outer = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    (own / "zz_outer_site_packages.pth").write_text("\n".join(outer) + "\n")

    help_text = _run([str(venv / "bin" / "stoker"), "--help"], cwd=tmp_path)
    assert "usage" in help_text.lower() and "bench" in help_text

    data = np.arange(24 * 40 * 12, dtype=np.float32).reshape(24, 40, 12)
    arr = zarr.create_array(str(tmp_path / "v.zarr"), shape=data.shape, chunks=(8, 16, 12), dtype="float32")
    arr[:] = data
    script = (
        "import sys, numpy, stoker, stoker.engine.cpu.native\n"
        "print(stoker.__file__)\n"
        "print(stoker.engine.cpu.native.Engine is not None)\n"
        "a = stoker.open_array(sys.argv[1])\n"
        "numpy.save(sys.argv[2], a.read([(3, 21), (5, 37), (0, 12)]))\n"
    )
    out = _run([str(py), "-c", script, str(tmp_path / "v.zarr"), str(tmp_path / "crop.npy")], cwd=tmp_path)
    where, native = out.split()[:2]
    assert Path(where).resolve().parent == (own / "stoker").resolve(), where  # the wheel's, not src/
    if _compiler():
        assert native == "True", "the wheel's compiled reader did not load"
    np.testing.assert_array_equal(np.load(tmp_path / "crop.npy"), data[3:21, 5:37, 0:12])


def test_building_prints_no_warning_about_the_c_sources_folder(tmp_path):
    """The build step that copies the package (build_py, run by pip install, make demo, python -m build) said a
    page of warnings about 'stoker.csrc' being an undeclared package: MANIFEST.in's C sources were counted as
    package data. It copies the Python modules and py.typed, never csrc/, and says nothing about it."""
    tree = tmp_path / "tree"
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        tree.mkdir(exist_ok=True)
        shutil.copy(REPO / name, tree / name)
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("*.so", "*.pyc", "__pycache__",
                                                                              "*.egg-info"))
    done = subprocess.run([sys.executable, "setup.py", "build_py", "--build-lib", str(tmp_path / "lib")], cwd=tree,
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "stoker.csrc" not in said and "Package would be ignored" not in said, said[-3000:]
    built = {p.relative_to(tmp_path / "lib").as_posix() for p in (tmp_path / "lib").rglob("*") if p.is_file()}
    assert {"stoker/py.typed", "stoker/__init__.py", "stoker/records/loader.py"} <= built
    assert not [n for n in built if "/csrc/" in n]
