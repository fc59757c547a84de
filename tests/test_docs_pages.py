"""The Python examples of docs/records.md and docs/index.md run as written (so the pages stay true)."""

import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _run_first_block(name: str, tmp_path, monkeypatch) -> dict:
    """Run the first Python block of docs/``name`` (a page's walkthrough) in ``tmp_path``; its namespace."""
    page = DOCS / name
    block = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)[0]
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs"}
    exec(compile(block, str(page), "exec"), namespace)
    return namespace


@pytest.mark.timeout(120)
def test_records_page_example_runs(tmp_path, monkeypatch):
    # the page's walkthrough, its first block; the later ones are fragments (meshes, the PyG recipe), whose
    # code tests/records/test_records_meshes.py runs
    namespace = _run_first_block("records.md", tmp_path, monkeypatch)
    assert (tmp_path / "clouds" / ".stoker-stats.json").exists()
    assert namespace["result"].written == 4
    assert int(namespace["stats"]["points"].count) == 10 + 13 + 16 + 19
    st = namespace["stats"]["points"]
    want = (namespace["sample"]["points"] - st.mean.float()) / st.std.float()
    torch.testing.assert_close(namespace["x"], want)
    state = namespace["state"]
    assert state["epoch"] == 1 and state["steps"] == 4  # both epochs read through
    batch = namespace["batch"]
    assert set(batch) == {"points", "knn4", "label", "batch"}  # joined along N, one node batch vector (PyG's)
    assert batch.num_samples == 2 and tuple(batch["label"].shape) == (2, 1)  # label (1,) stacked
    assert int(batch["knn4"].max()) < batch["points"].shape[0] == batch["batch"].shape[0]


@pytest.mark.timeout(120)
def test_site_index_example_runs(tmp_path, monkeypatch):
    namespace = _run_first_block("index.md", tmp_path, monkeypatch)  # the page's walkthrough
    z, x = namespace["z"], namespace["x"]
    assert (namespace["crop"] == z[0:32, 100:228, 7:135]).all()
    assert tuple(x.shape) == (4, 32, 128, 128) and x.dtype == torch.float32


def test_every_code_fence_of_the_pages_opens_and_closes_on_its_own_line():
    """A fence with text after it ("``` A remote URI...") closes nothing in Markdown: the code block ran
    into the next paragraph, and the command above it was drawn as inline code on one line."""
    pages = sorted(DOCS.glob("*.md")) + [DOCS.parent / "README.md"]
    for page in pages:
        fences = [(n, line.strip()) for n, line in enumerate(page.read_text().splitlines(), 1)
                  if line.lstrip().startswith("```")]
        bad = [f"{page.name}:{n}: {line}" for n, line in fences if not re.fullmatch(r"```[\w+-]*", line)]
        assert bad == [], bad
        opened = [line for _, line in fences[::2]]
        closed = [line for _, line in fences[1::2]]
        assert len(fences) % 2 == 0 and all(c == "```" for c in closed), (page.name, opened, closed)


def test_the_inference_page_says_a_stride_past_the_tile_leaves_gaps(tmp_path):
    """docs/inference.md said tiles start every stride "so every voxel is in some tile", for any stride; a
    stride larger than the tile leaves voxels no tile covers (on purpose, as TileGrid's docstring says), which
    the writer then leaves at the fill value. The page says so now."""
    import zarr

    import stoker

    uri = str(tmp_path / "line.zarr")
    zarr.create_array(uri, shape=(20,), chunks=(8,), dtype="u1")
    covered = {v for s in stoker.TileGrid([uri], (4,), stride=(6,)) for v in range(*s.aabb[0])}
    assert len(covered) < 20
    text = " ".join((DOCS / "inference.md").read_text().split())
    assert "a larger stride leaves gaps" in text


def test_the_inference_page_says_a_grid_of_arrays_all_too_short_is_refused(tmp_path):
    """docs/inference.md said an array shorter than the tile "gets no tile ..., with a warning": true beside an
    array that holds one; a grid none of whose arrays holds a tile is an InvalidArgument, as it says now."""
    import warnings

    import zarr

    import stoker

    short, long = str(tmp_path / "short.zarr"), str(tmp_path / "long.zarr")
    zarr.create_array(short, shape=(6,), chunks=(6,), dtype="u1")
    zarr.create_array(long, shape=(20,), chunks=(8,), dtype="u1")
    with pytest.warns(UserWarning, match="shorter than the tile"):
        assert len(stoker.TileGrid([short, long], (8,))) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(stoker.InvalidArgument, match="no array can hold"):
            stoker.TileGrid([short], (8,))
    text = " ".join((DOCS / "inference.md").read_text().split())
    assert "a grid whose arrays are all too short for one is an `InvalidArgument`" in text


def test_the_dataloader_page_names_the_error_of_a_float16_overflow_after_normalize(tmp_path):
    """docs/dataloader.md said a Normalize result past 65504 "in float16" is an InvalidArgument; on a batch
    tensor made in float32 and rounded to "f16" it is a DtypeMismatch (a user catching InvalidArgument missed
    it), on a float16 field an InvalidArgument. The page says which is which now."""
    import zarr

    import stoker
    from stoker.transforms import Normalize

    uri = str(tmp_path / "a.zarr")
    zarr.create_array(uri, shape=(4, 4), chunks=(4, 4), dtype="f4")[:] = 7.5
    box = [(0, 4), (0, 4)]

    def first(cfg, samples):
        with stoker.Pipeline(cfg) as p:
            p.push(samples)
            with p.pop(timeout=20):
                pass

    huge = dict(mean=0.0, std=1e-4)  # 7.5 / 1e-4 = 75000 > 65504
    with pytest.raises(stoker.DtypeMismatch, match="65504"):
        first(stoker.Config(batch_size=1, dtype="f16", transform=Normalize(**huge)), [stoker.Sample(uri, box)])
    fields = [stoker.Sample({"a": (uri, box), "b": (uri, box)})]
    with pytest.raises(stoker.InvalidArgument, match="65504"):
        first(stoker.Config(batch_size=1, dtype={"a": "f16", "b": "f32"}, transform=Normalize(**huge, field="a")),
              fields)
    text = " ".join((DOCS / "dataloader.md").read_text().split())
    assert 'a result past 65504 rounded into `"f16"` is a `DtypeMismatch`' in text
    assert "on a float16 field a result past 65504 is an `InvalidArgument`" in text
