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
