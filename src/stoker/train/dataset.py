"""``CropDataset``: a sample source's batches as a ``torch.utils.data.IterableDataset``.

>>> source = stoker.RandomCrops([[t2m, u10, v10]], sample_shape=(8, 64, 64), seed=0, samples_per_epoch=4096)
>>> ds = stoker.CropDataset(source, stoker.Config(batch_size=16, dtype="f32"))
>>> loader = torch.utils.data.DataLoader(ds, batch_size=None)     # stoker batches; num_workers=0
>>> for x in loader:                                              # (16, 3, 8, 64, 64) float32
...     ...

or ``torchdata.stateful_dataloader.StatefulDataLoader(ds, batch_size=None)``, whose ``state_dict`` then
carries this dataset's position (see docs/dataloader.md).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
from typing import Any, Iterator

import torch

from ..checks import integer
from ..config import Config
from ..engine.batch import to_tensors
from ..engine.buffers import SPARE_SLOT_BYTES
from ..engine.pipeline.facade import Pipeline
from ..errors import InvalidArgument, PoolStarved, ShutdownError, StokerError
from ..sampling.sample import Sample
from ..sampling.samplers import RankShare, SampleSource


class CropDataset(torch.utils.data.IterableDataset):
    """This rank's batches of ``source`` (a :class:`~stoker.SampleSource`, split here by
    ``source.for_rank()``: the rank from torch.distributed or ``RANK``/``WORLD_SIZE``; or a
    :class:`~stoker.RankShare`), made by a :class:`~stoker.Pipeline` of ``cfg``.

    A SampleSource is split again whenever the process group says otherwise than it did at
    construction: a dataset built before ``init_process_group`` (in the launcher, in a
    ``LightningDataModule.__init__``) and used in the ranks takes each rank's share, not the whole epoch.
    A RankShare is used as given.

    Use it with ``DataLoader(ds, batch_size=None)`` (the batches are already made) and ``num_workers=0``:
    the pipeline runs its own threads. Worker processes would each open a pipeline over the same share
    and deliver every sample once per worker, so iterating in a worker raises ``InvalidArgument``.

    Each ``iter()`` runs one epoch from the position saved last: a loop that stopped early continues where it
    stopped, and once an epoch is used up the next ``iter()`` starts the next epoch (or call
    :meth:`set_epoch`). ``len()`` is the batches the next ``iter()`` yields.

    What a batch costs: with ``copy=False`` (the default) each batch is a zero-copy view of a pipeline slot.
    It is never overwritten while you hold it: a slot is reused only once no tensor views it. Holding more
    than ``lookahead_batches`` of them (a list of batches, or a fetcher that prefetches) leaves the pipeline
    without slots until you drop one (``PoolStarved`` after ``pop_timeout_s``). ``copy=True`` clones each
    batch (one batch-sized copy, memory of your own) and the slot goes back at once.

    Samples of named fields (``stoker.Sample({"raw": ..., "labels": ...})``) give a ``dict[str, Tensor]`` per
    batch, field name to that field's batch (see :class:`~stoker.FieldBatch`); ``copy`` clones each.

    ``with_samples=True`` yields ``(samples, x)`` pairs, ``samples`` the batch's :class:`~stoker.Sample` s in
    order (where each crop came from: what :class:`~stoker.TileWriter` needs to place predictions). Over a
    :class:`~stoker.TileGrid` the last batch of an epoch comes at its true size whatever ``cfg.drop_last``
    says: a grid's epoch is never cut short.

    A grid's epoch (a source with ``complete_epochs``, on the CPU) is also read further ahead than
    ``cfg.lookahead_batches``: up to the whole epoch, as many batch slots as fit in a quarter of
    ``cfg.host_buffer_bytes`` and 256 MiB (:func:`read_ahead`), and next to the pipeline's room for reading and
    decoding one file's chunks (never fewer than ``lookahead_batches``). Neighbouring tiles share chunks, and the compiled engine
    decodes a chunk once for every batch in flight that needs it: a 128x256x256 volume's 32 chunks took
    about 100 decodes for its 32 tiles of 96^3 (batches of 4) at 2 batches ahead, 33-36 with all 8 in flight.

    ``state_dict()``/``load_state_dict()`` give and take the source's position as of the last batch
    yielded (the state :meth:`Pipeline.state_dict` reports), so a state taken after k batches resumes with
    batch k + 1, on any world size; ``StatefulDataLoader`` (torchdata) calls them.

    ``persistent=True`` keeps the pipeline from one epoch to the next, as ``DataLoader(persistent_workers=True)``
    keeps its workers: its threads, batch slots and opened arrays, and over an object store with a disk cache
    (``Config.cache_dir``) the generations it learnt, so a second epoch reads from the cache asking the store
    nothing within ``cache_staleness_s``, as a training loop's one pipeline does (a new pipeline revalidates
    every object it opens: over S3 or HTTP a second epoch then ran at 0.3-0.7x the local files' rate, where the
    same pipeline's ran at about 1x; docs/remote.md). The price: the batch slots (up to ``host_buffer_bytes``)
    stay taken between epochs, also while another dataset (a validation set) runs. Only an epoch read to its end
    keeps its pipeline (one stopped early, by ``break`` or an error, is closed, as without); :meth:`close`, or
    dropping the dataset, closes it.

    >>> ds = stoker.CropDataset(source, cfg, persistent=True)
    >>> for epoch in range(10):
    ...     for x in DataLoader(ds, batch_size=None): ...
    >>> ds.close()
    """

    def __init__(self, source: SampleSource | RankShare, cfg: Config, copy: bool = False,
                 with_samples: bool = False, persistent: bool = False) -> None:
        super().__init__()
        self._follow_group = isinstance(source, SampleSource)  # the rank is ours to pick, and to re-pick
        if isinstance(source, SampleSource):
            source = source.for_rank()
        if not isinstance(source, RankShare):
            raise InvalidArgument(f"CropDataset takes a stoker.SampleSource or RankShare (RandomCrops, TileGrid, "
                                  f"SampleList, or their .for_rank()), got {type(source).__name__}")
        if not isinstance(cfg, Config):
            raise InvalidArgument(f"CropDataset needs a stoker.Config, got {type(cfg).__name__}")
        self._complete = bool(getattr(source.source, "complete_epochs", False))
        if self._complete and cfg.drop_last:
            cfg = dataclasses.replace(cfg, drop_last=False)  # every tile is inferred: the short last batch too
        self.source, self.cfg, self.copy, self.with_samples = source, cfg, bool(copy), bool(with_samples)
        self.persistent = bool(persistent)
        self._state = source.state_dict()  # the position as of the last batch yielded
        # the epoch of a state load_state_dict gave that no iteration has started from yet: set_epoch of that
        # epoch keeps it (the usual epoch loop after a resume); _hold: kept so, a complete epoch stays complete
        # (its iteration yields nothing) instead of moving on to the next epoch
        self._loaded: int | None = None
        self._hold = False
        self._run = 0  # bumped by every iter() and load: an older iteration stops reporting positions
        self._live: Pipeline | None = None  # the pipeline of the current iteration
        # persistent: the pipeline of the last epoch read to its end, drained, and the read_ahead it was made with
        self._kept: tuple[Pipeline, int] | None = None
        # _run's bump and the kept pipeline's hand-overs: a close() on another thread as an epoch ends either
        # finds the pipeline kept (and closes it) or makes the iteration close it, never leaves it kept
        self._lock = threading.Lock()

    # -- position ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The source's position as of the last batch yielded (a RankShare state)."""
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` at the next ``iter()`` (a state of this dataset, or of a pipeline's source,
        saved on any world size). An iteration under way ends."""
        loaded = self._fresh(state)  # checks the fingerprint and the state now
        # kept as given, not as this split's reading of it: a dataset given a state before the process group
        # is up (rank 0 of 1 then) resumes it on the split it was saved on exactly, its wrapped tail too
        self._state = copy.deepcopy(dict(state))
        self._loaded, self._hold = loaded.epoch, False
        self._stop()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next ``iter()``. An iteration under way ends. Right after
        :meth:`load_state_dict` of a position in ``epoch`` (no iteration since) the position is kept, so the
        usual loop resumes exactly (a position at the end of ``epoch``: that epoch yields nothing)::

            ds.load_state_dict(saved)                # epoch 3, 5 batches in
            for epoch in range(3, n_epochs):
                ds.set_epoch(epoch)                  # epoch 3 continues with its batch 6
                for x in DataLoader(ds, batch_size=None): ...
        """
        epoch = integer("set_epoch: epoch", epoch, 0, knob="epoch")
        if self._loaded is not None and epoch == self._loaded:
            self._hold = True
            self._stop()
            return
        src = self._fresh(None)
        src.set_epoch(epoch)
        self._state = src.state_dict()
        self._loaded, self._hold = None, False
        self._stop()

    def close(self) -> None:
        """End the iteration under way and close the pipeline kept between epochs (``persistent=True``); the
        dataset can be iterated again (with a new pipeline)."""
        self._stop()
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            kept[0].close()

    def __enter__(self) -> "CropDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _stop(self) -> None:
        """End the iteration under way (its generator returns at its next step) and close its pipeline."""
        with self._lock:
            self._run += 1
            live, self._live = self._live, None
        if live is not None:
            live.close()

    def _follow(self) -> None:
        """Shard a SampleSource again when the process group's rank or size is not the one it was sharded
        for. Positions are global (a state describes the whole epoch), so the saved one stays valid."""
        dist = torch.distributed
        if not self._follow_group or not (dist.is_available() and dist.is_initialized()):
            return
        s = self.source
        rank, world = dist.get_rank(), dist.get_world_size()
        if (s.rank, s.world_size) != (rank, world):
            self.source = RankShare(s.source, rank, world, s.policy, s.even)

    def _fresh(self, state: dict | None) -> RankShare:
        """A view of this rank's share at ``state`` (the pipeline's cursor writes into the one it pulls from,
        so every iteration gets its own)."""
        self._follow()
        s = self.source
        src = RankShare(s.source, s.rank, s.world_size, s.policy, s.even)
        if state is not None:
            src.load_state_dict(state)
        return src

    def _batches(self, samples: int) -> int:
        b = self.cfg.batch_size
        return samples // b if self.cfg.drop_last else -(-samples // b)

    def _positioned(self) -> RankShare:
        """The source at the saved position; past the end of an epoch, at the start of the next."""
        src = self._fresh(self._state)
        if self._batches(len(src)) == 0 and not self._hold:
            src.set_epoch(src.epoch + 1)
            self._state = src.state_dict()
        return src

    def __len__(self) -> int:
        """Batches the next ``iter()`` yields (this rank's rest of the epoch it runs)."""
        return self._batches(len(self._positioned()))

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if torch.utils.data.get_worker_info() is not None:
            raise InvalidArgument(
                "CropDataset runs in the main process: use DataLoader(..., num_workers=0). Its pipeline already "
                "reads and decodes on its own threads, and each worker process would open a pipeline over the "
                "same samples and deliver every one of them once per worker", knob="num_workers")
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # a generator: nothing runs before the first next(), so a load_state_dict between iter() and the
        # first batch (StatefulDataLoader does so) is what the pipeline starts from
        self._stop()
        run = self._run
        source = self._positioned()
        self._loaded, self._hold = None, False  # (a later set_epoch of this epoch starts it again)
        ahead = read_ahead(self.cfg, source) if self._complete else 0
        pipeline = self._pipeline(ahead)
        ended = False  # the epoch read to its end: a persistent dataset keeps the pipeline
        try:
            self._live = pipeline
            pipeline.push(source)
            try:
                for batch in pipeline:
                    x = to_tensors(batch)  # a dict of the fields' tensors for samples of named fields
                    samples = batch.samples
                    if self.copy:
                        x = {k: v.clone() for k, v in x.items()} if isinstance(x, dict) else x.clone()
                    batch.release()  # the slot is reused only once x (and every view of it) is gone
                    if not isinstance(x, dict):  # (the Trainer counts a dict's samples by its first tensor)
                        x.num_samples = int(x.shape[0])  # type: ignore[attr-defined]  # what the Trainer counts
                    if run != self._run:
                        return  # a newer iteration or a load took over: this one is stale
                    # (the last push's: a persistent pipeline forgets those before it, drop_used_up)
                    self._state = pipeline.state_dict()["sources"][-1]
                    yield (samples, x) if self.with_samples else x
                ended = run == self._run
            except ShutdownError:
                if run == self._run:
                    raise
                return  # closed by a newer iteration or a load
            except PoolStarved as e:
                if not getattr(e, "consumer_holds_all", False):
                    raise
                # a DataLoader given batch_size=k keeps k of these views until it collates them: with k past
                # the slots, the likeliest holder when the loop itself keeps no batch
                raise PoolStarved(
                    f"{e.message} In a DataLoader, pass batch_size=None: a DataLoader with a batch_size holds "
                    f"that many of this CropDataset's batches (each already {self.cfg.batch_size} samples) to "
                    "collate them", **e.context) from e
            finally:
                if self._live is pipeline:
                    self._live = None
        finally:
            self._keep_or_close(pipeline, ahead, ended, run)
        if run == self._run:  # used up: the next iter() starts the next epoch
            self._positioned()

    def _pipeline(self, ahead: int) -> Pipeline:
        """The pipeline kept from the last epoch (``persistent``), when it reads as far ahead as this one is to;
        else a new one."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None and kept[1] == ahead:
            return kept[0]
        if kept is not None:
            kept[0].close()
        return Pipeline(self.cfg, read_ahead=ahead)

    def _keep_or_close(self, pipeline: Pipeline, ahead: int, ended: bool, run: int) -> None:
        """After iteration ``run``: keep ``pipeline`` for the next epoch (``persistent``, the epoch ``ended``,
        read to its end), the samples its epoch left that do not fill a batch dropped; else close it. Kept only
        while ``run`` is still the latest (under the lock): a close(), load or newer iteration since then (from
        another thread) means nobody would close it."""
        if ended and self.persistent:
            try:
                pipeline.drop_used_up()
            except StokerError:  # not drained after all (an error sticks, a close raced): not kept
                pipeline.close()
                return
            with self._lock:
                if run == self._run and self._kept is None:
                    self._kept = (pipeline, ahead)
                    return
        pipeline.close()

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "_live": None, "_kept": None}  # a pipeline is a process's own
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"CropDataset({type(self.source.source).__name__}, rank {self.source.rank} of "
                f"{self.source.world_size}, batch_size={self.cfg.batch_size}, copy={self.copy}, "
                f"with_samples={self.with_samples}, persistent={self.persistent})")


#: the share of ``host_buffer_bytes`` the batch slots of a grid's epoch read ahead may take (:func:`read_ahead`)
READ_AHEAD_SHARE = 4


def read_ahead(cfg: Config, source: RankShare) -> int:
    """The batches to make ahead over an epoch of tiles (``Pipeline(cfg, read_ahead=...)``): up to the batches
    of ``source``'s epoch left (less the one the consumer holds), as many slots as fit in
    ``host_buffer_bytes // READ_AHEAD_SHARE`` and in the spare slots' bound (``SPARE_SLOT_BYTES``), never fewer
    than ``cfg.lookahead_batches``. A wish: the executor grants what host_buffer_bytes holds next to its room
    for reading and decoding one file's chunks (CpuExecutor.prepare). Only CPU pipelines: a GPU's slots are in
    its memory.

    >>> read_ahead(stoker.Config(batch_size=4, dtype="f32"), grid.for_rank())   # 32 tiles of 96^3
    7
    """
    on_cpu = cfg.device == "cpu" or (cfg.device is None and not torch.cuda.is_available())
    batches = -(-len(source) // cfg.batch_size)
    if not on_cpu or batches - 1 <= cfg.lookahead_batches:
        return cfg.lookahead_batches
    slot = cfg.batch_size * _sample_bytes(source.source.sample(source.epoch, 0), cfg)
    # within what a closed pipeline's spare slots keep, too: the next volume's slots are then these, not new pages
    fit = min(cfg.host_buffer_bytes // READ_AHEAD_SHARE, SPARE_SLOT_BYTES) // max(slot, 1)
    ahead = min(batches - 1, fit - 1)
    return max(ahead, cfg.lookahead_batches)


def _sample_bytes(sample: Sample, cfg: Config) -> int:
    """What a sample of ``sample``'s shape takes in a batch slot, at most: its elements times the batch's
    element size (8 when the source decides it: ``dtype="native"`` or one per field), with a float32 work
    slot's 4 more for 16-bit floats (a transform, CF attributes)."""
    shapes = list(sample.shape.values()) if sample.fields is not None else [sample.shape]
    dtype = cfg.dtype if isinstance(cfg.dtype, str) else None
    itemsize = {"f32": 4, "i32": 4, "bf16": 2 + 4, "f16": 2 + 4, "i64": 8}.get(dtype or "", 8 + 4)
    return sum(math.prod(shape) for shape in shapes) * itemsize
