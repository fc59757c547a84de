"""EpochCursor: where one rank is in the epochs of a split order, and the state that saves it.

The position is what was consumed, never what was produced ahead: the epoch, the
earlier runs of it (each ``(world_size, policy, even, steps)``, on any world size),
and the samples of the current run's split this rank consumed. The crop samplers'
:class:`~stoker.RankShare` and the records :class:`~stoker.records.Loader` both keep one.

>>> cursor = EpochCursor(size=10, rank=1, world_size=3)
>>> list(cursor.share())                        # this rank's positions in the epoch's order
[1, 4, 7, 0]
>>> state = cursor.after(2).state({"seed": 0})  # once this rank consumed 2 samples
>>> (state.epoch, state.steps, state.position)  # 6 samples consumed by the 3 ranks together
(0, 2, 6)
>>> CursorState.from_dict(state.to_dict()) == state
True

:meth:`CursorState.from_dict` also reads the states saved before the cursor: a
``RankShare`` state without a version, and a records ``Loader`` state of format
``stoker-records-loader`` version 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from . import partition
from ..errors import InvalidArgument

FORMAT = "stoker-epoch-cursor"
VERSION = 2
LOADER_FORMAT = "stoker-records-loader"  # the records Loader's states before the cursor (version 1)
_CURSOR_KEYS = ("format", "version", "epoch", "position", "world_size", "rank", "policy", "even", "steps",
                "segments")


class Run(NamedTuple):
    """One earlier run of an epoch: its world size, split and the samples each of its ranks consumed."""

    world_size: int
    policy: str
    even: str
    steps: int


@dataclass(frozen=True)
class CursorState:
    """A saved :class:`EpochCursor` (JSON-able through :meth:`to_dict`).

    ``order`` holds what identifies the order (a source's ``fingerprint`` and ``seed``; a loader's
    ``size``, ``seed``, ``shuffle`` and ``names``); the owner compares it with its own.
    ``position`` is what all ranks together consumed of the epoch, for people and logs.
    """

    epoch: int
    world_size: int
    rank: int
    policy: str
    even: str
    steps: int
    segments: tuple[Run, ...] = ()
    position: int | None = None
    order: Mapping[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def to_dict(self) -> dict:
        """The state as plain data; the order's fields sit beside the cursor's (as they always did)."""
        return {"format": FORMAT, "version": self.version, "epoch": self.epoch, "position": self.position,
                "world_size": self.world_size, "rank": self.rank, "policy": self.policy, "even": self.even,
                "steps": self.steps, "segments": [list(r) for r in self.segments], **self.order}

    @classmethod
    def from_dict(cls, state: Any) -> "CursorState":
        """A state saved by :meth:`to_dict`, or by stoker before the cursor (InvalidArgument naming what is
        wrong otherwise)."""
        if not isinstance(state, Mapping):
            raise InvalidArgument(f"an epoch cursor state is a dict, got {type(state).__name__}")
        fmt, version = state.get("format"), state.get("version")
        if fmt == FORMAT:
            if version != VERSION:
                raise InvalidArgument(f"epoch cursor state version {version!r}; this stoker reads {VERSION} (and the "
                                      "unversioned states before it): save the state again with this stoker, or "
                                      "start the epoch again", version=version)
            policy = state.get("policy")
        elif fmt == LOADER_FORMAT:
            if version != 1:
                raise InvalidArgument(f"Loader state version {version!r}; this stoker reads 1 (and {FORMAT} "
                                      f"{VERSION})", version=version)
            policy = "strided"  # the Loader always split strided
        elif fmt is None and "fingerprint" in state:  # a RankShare state from before the cursor
            policy = state.get("policy", "strided")
        else:
            raise InvalidArgument(f"not a stoker epoch cursor state (format {fmt!r}; expected {FORMAT!r}): pass "
                                  "the state_dict() of a stoker RankShare, Pipeline source or records Loader")
        return cls._parse(state, policy)

    @classmethod
    def _parse(cls, state: Mapping[str, Any], policy: Any) -> "CursorState":
        try:
            segments = tuple(Run(int(s[0]), str(s[1]), str(s[2]), int(s[3])) for s in state.get("segments", []))
            steps = int(state.get("steps", 0))
            epoch, world = int(state["epoch"]), int(state.get("world_size", 1))
            rank, even = int(state.get("rank", 0)), state.get("even", "wrap")
            position = None if state.get("position") is None else int(state["position"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise InvalidArgument(f"malformed epoch cursor state ({type(exc).__name__}: {exc}); pass a "
                                  "state_dict() as saved") from None
        for run in segments:
            if run.world_size < 1 or run.steps < 0 or run.policy not in partition.POLICIES or \
                    run.even not in partition.EVEN:
                raise InvalidArgument(f"malformed epoch cursor state: earlier run {list(run)} needs world_size >= "
                                      f"1, policy in {partition.POLICIES}, even in {partition.EVEN}, steps >= 0")
        if epoch < 0 or steps < 0 or world < 1 or not 0 <= rank < world or even not in partition.EVEN or \
                policy not in partition.POLICIES:
            raise InvalidArgument(f"malformed epoch cursor state: epoch={epoch}, steps={steps}, world_size={world}, "
                                  f"rank={rank}, policy={policy!r}, even={even!r}")
        order = {k: v for k, v in state.items() if k not in _CURSOR_KEYS}
        return cls(epoch, world, rank, policy, even, steps, segments, position, order)


class EpochCursor:
    """One rank's place in the epochs of an order of ``size`` samples split over ``world_size`` ranks.

    ``epoch``; ``segments``, the earlier runs of this epoch (other splits, replayed to find what remains);
    ``steps``, the samples of this run's split this rank consumed.
    """

    def __init__(self, size: int, rank: int, world_size: int, policy: str = "strided", even: str = "wrap") -> None:
        self.rank, self.world_size = partition.check(rank, world_size, policy, even)
        self.size, self.policy, self.even = int(size), policy, even
        self.epoch = 0
        self.segments: list[Run] = []
        self.steps = 0

    def place(self, epoch: int, segments: list[Run], steps: int) -> None:
        """Move to ``steps`` samples into the split that follows ``segments`` in ``epoch``."""
        self.epoch, self.segments, self.steps = epoch, segments, steps

    def at(self, epoch: int, segments: list[Run], steps: int) -> "EpochCursor":
        """A copy of this cursor placed elsewhere."""
        other = EpochCursor(self.size, self.rank, self.world_size, self.policy, self.even)
        other.place(epoch, list(segments), steps)
        return other

    def remaining(self) -> partition.Positions:
        """The positions of the epoch's order that the earlier runs left."""
        return partition.remaining_after(self.size, self.segments)

    def share(self) -> partition.RankPositions:
        """This rank's positions in the current split, in order (the consumed ones included)."""
        return partition.rank_positions(self.remaining(), self.rank, self.world_size, self.policy, self.even)

    def after(self, n: int, forever: bool = False) -> "EpochCursor":
        """A copy once ``n`` more samples are consumed; ``forever`` carries on into the following epochs."""
        other = self.at(self.epoch, self.segments, self.steps + n)
        per_epoch = len(other.share())
        while forever and per_epoch and other.steps >= per_epoch:
            other.place(other.epoch + 1, [], other.steps - per_epoch)
            per_epoch = len(other.share())
        return other

    def position(self) -> int:
        """Samples of the epoch all ranks together consumed."""
        remaining = self.remaining()
        done = len(partition.consumed(remaining, self.world_size, self.steps, self.policy, self.even))
        if self.even == "drop" and self.steps >= partition.per_rank(len(remaining), self.world_size, self.even):
            done = len(remaining)  # the run took its whole share: the epoch is over, its dropped tail too
        return self.size - len(remaining) + done

    def state(self, order: Mapping[str, Any]) -> CursorState:
        """This place as a state; ``order`` identifies the order (see :class:`CursorState`)."""
        return CursorState(self.epoch, self.world_size, self.rank, self.policy, self.even, self.steps,
                           tuple(self.segments), self.position(), dict(order))

    def _check_fits(self, runs: list[Run]) -> None:
        """InvalidArgument unless each run consumed at most a rank's share of what the runs before it left of
        this cursor's ``size`` samples (a state of another, larger dataset, or edited, would else be read as
        an epoch with nothing, or less than nothing, left)."""
        for k, run in enumerate(runs):
            left = len(partition.remaining_after(self.size, runs[:k]))
            share = partition.per_rank(left, run.world_size, run.even)
            if run.steps > share:
                raise InvalidArgument(
                    f"this epoch cursor state does not fit a dataset of {self.size} samples: a run on "
                    f"{run.world_size} ranks consumed {run.steps} samples per rank where {left} were left "
                    f"({share} per rank); was it saved for another dataset?", size=self.size)

    def load(self, state: CursorState, keep_split: bool) -> None:
        """Continue from ``state`` (saved on any world size): nothing of the epoch repeated or skipped.

        With ``keep_split`` a state saved on this very split continues it exactly (its wrapped tail too);
        otherwise, and on any other split, the saved run becomes an earlier run and what it left is split
        anew over this world size.
        """
        segments = list(state.segments)
        self._check_fits(segments + [Run(state.world_size, state.policy, state.even, state.steps)])
        same = (state.world_size, state.policy, state.even) == (self.world_size, self.policy, self.even)
        if keep_split and same:
            self.place(state.epoch, segments, state.steps)
            return
        if state.steps:
            segments.append(Run(state.world_size, state.policy, state.even, state.steps))
        self.place(state.epoch, segments, 0)
