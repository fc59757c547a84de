"""infer_tiles.py: a model over a whole OME-Zarr level, tile by tile, on several ranks, written back to Zarr.

Launch one process per GPU with torchrun (or run it plainly for one process):

    torchrun --standalone --nproc_per_node=2 examples/infer_tiles.py \
        --image /data/cells.ome.zarr --level 0 --out /data/cells-labels.zarr --output labels

Options:

    --image URI         an OME-Zarr image group; --level picks one of its multiscale levels (default 0).
    --out URI           the array to write (created; a restarted job skips the regions already written).
    --output KIND       "labels" (uint8, argmax of each tile's prediction, no blending: each tile's centre
                        tiles the volume) or "probabilities" (float32, one channel per class, Hann-blended).
    --tile Z Y X        the model's input tile (default 32 32 32); --crop C: the margin of each prediction
                        that is dropped (default 8: the valid output of a 32^3 tile is 16^3).
    --chunks Z Y X      the output's chunks (default 32 32 32).
    --batch-size B      tiles per batch, per rank (default 4).
    --pad MODE          tiles that reach past the borders, as sliding-window inference lays them out ("zero",
                        "fill", "reflect" or "edge": what the model sees outside the volume); every tile's
                        centre is then cropped out of it, also at the borders. Default: no padding (the
                        last tile of an axis ends at the border, whose margin is kept).

The model here is a tiny, fixed 3D convolution so the example runs anywhere; put yours in its place.
Every rank reads its share of the tiles (TileGrid.for_rank), predicts, and hands the batch to the
TileWriter with the samples that made it; the writer blends and writes each output region once, on one rank.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import stoker


def tiny_model(classes: int) -> torch.nn.Module:
    """Two 3x3x3 convolutions with fixed weights: any seed, any rank, the same model."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv3d(4, classes, 3, padding=1)).eval()


def level_uri(image: str, level: int) -> str:
    """The array of multiscale level ``level`` of an OME-Zarr image (v0.4 .zattrs or v0.5 zarr.json)."""
    import zarr

    attrs = zarr.open_group(image, mode="r").attrs.asdict()
    multiscales = attrs.get("ome", attrs).get("multiscales")
    if not multiscales:
        raise SystemExit(f"{image} is not an OME-Zarr image: no multiscales in its attributes")
    return f"{image.rstrip('/')}/{multiscales[0]['datasets'][level]['path']}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", required=True)
    p.add_argument("--level", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--output", choices=("labels", "probabilities"), default="labels")
    p.add_argument("--tile", type=int, nargs=3, default=(32, 32, 32))
    p.add_argument("--crop", type=int, default=8)
    p.add_argument("--chunks", type=int, nargs=3, default=(32, 32, 32))
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--pad", choices=("zero", "fill", "reflect", "edge"), default=None)
    args = p.parse_args()

    if "RANK" in os.environ and not dist.is_initialized():  # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = stoker.rank_info().rank, stoker.rank_info().world_size
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"

    uri = level_uri(args.image, args.level)
    tile = tuple(args.tile)
    stride = tuple(t - 2 * args.crop for t in tile)  # the tiles' centres tile the volume
    grid = stoker.TileGrid([uri], tile, stride=stride, pad=args.pad)
    volume = stoker.open_array(uri).shape
    labels = args.output == "labels"
    writer = stoker.TileWriter(
        args.out, volume if labels else (args.classes, *volume),
        tuple(args.chunks) if labels else (args.classes, *args.chunks),
        "uint8" if labels else "float32", blend="none" if labels else "hann", crop=args.crop, grid=grid,
        fill_value=255 if labels else 0)
    cfg = stoker.Config(batch_size=args.batch_size, dtype="f32", sample_shape=tile, device="cpu")
    data = stoker.CropDataset(writer.pending(grid), cfg, with_samples=True)  # split over the ranks here
    model = tiny_model(args.classes).to(device)
    tiles = 0
    with torch.inference_mode():
        for samples, x in data:
            logits = model(x[:, None].to(device))
            writer.write(samples, logits.argmax(1).to(torch.uint8) if labels else logits.softmax(1))
            tiles += len(samples)
    writer.close()
    # one write of a whole line: the ranks share the launcher's stdout, and print() writes the text and its
    # newline apart, so two ranks' lines could run together
    summary = {"rank": rank, "world_size": world, "tiles": tiles, "regions_written": writer.written}
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
