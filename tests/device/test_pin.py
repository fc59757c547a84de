"""stoker.device.pin: the traversal behind pin_object/to_device, the CPU behaviour, and (on a GPU) real pinning."""

from __future__ import annotations

import dataclasses
import enum
import time
import warnings
from collections import OrderedDict, namedtuple
from typing import Generic, TypeVar

import numpy as np
import pytest
import torch

import stoker
import stoker.device.pin as pin
from stoker.device.prefetch import DevicePrefetcher

pytestmark = pytest.mark.timeout(60)

Pair = namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass(frozen=True)
class Frame:
    coords: np.ndarray
    label: str
    extra: torch.Tensor = dataclasses.field(default=None, init=False)


class SelfPinning:
    def __init__(self, t):
        self.t = t
        self.pinned = False

    def pin_memory(self):
        out = SelfPinning(self.t)
        out.pinned = True
        return out


class Opaque:
    def __init__(self):
        self.name = "x"
        self.coords = torch.zeros(3)


class Harmless:
    def __init__(self):
        self.name = "only metadata"


def _recording():
    seen = []

    def leaf(t, path):
        seen.append(path)
        return t.clone() + 1

    return seen, leaf


def test_map_batch_keeps_types_and_reaches_every_leaf():
    frame = Frame(coords=np.zeros((2, 3), np.float32), label="f")
    object.__setattr__(frame, "extra", torch.ones(1))
    batch = {"x": torch.zeros(2), "pair": Pair(torch.zeros(1), [np.zeros(1, np.int64), 3, "s", None]),
             "frame": frame, "od": OrderedDict(k=torch.zeros(1)), "self": SelfPinning(torch.zeros(1)),
             "tuple": (torch.zeros(1),), "meta": Harmless()}
    seen, leaf = _recording()
    out = pin.map_batch(batch, leaf, hook=pin._method_hook("pin_memory"))
    assert isinstance(out["pair"], Pair) and isinstance(out["pair"].b, list)
    assert isinstance(out["frame"], Frame) and out["frame"].label == "f"
    assert isinstance(out["frame"].coords, torch.Tensor) and torch.equal(out["frame"].coords, torch.ones(2, 3))
    assert torch.equal(out["frame"].extra, torch.full((1,), 2.0))  # non-init field handled too
    assert isinstance(out["od"], OrderedDict) and isinstance(out["tuple"], tuple)
    assert out["self"].pinned  # the Pinnable protocol is honoured
    assert out["meta"] is batch["meta"] and out["pair"].b[1:] == [3, "s", None]
    assert sorted(seen) == sorted([
        "batch['x']", "batch['pair'].a", "batch['pair'].b[0]", "batch['frame'].coords", "batch['frame'].extra",
        "batch['od']['k']", "batch['tuple'][0]",
    ])
    assert torch.equal(batch["x"], torch.zeros(2))  # input untouched


def test_map_batch_reaches_tensors_in_deques_sets_and_defaultdicts():
    """Regression: a deque (a history of frames) or a set of tensors came back unmoved and unpinned, with no
    error, and a defaultdict lost its default_factory (it came back a plain dict)."""
    from collections import defaultdict, deque

    frames = deque([torch.zeros(1), torch.zeros(2)], maxlen=4)
    by_key = defaultdict(list, k=[torch.zeros(3)])
    batch = {"frames": frames, "ids": {torch.zeros(4)}, "frozen": frozenset([torch.zeros(5)]), "by_key": by_key}
    seen, leaf = _recording()
    out = pin.map_batch(batch, leaf)
    assert isinstance(out["frames"], deque) and out["frames"].maxlen == 4
    assert [t.tolist() for t in out["frames"]] == [[1.0], [1.0, 1.0]]
    assert isinstance(out["ids"], set) and [t.tolist() for t in out["ids"]] == [[1.0] * 4]
    assert isinstance(out["frozen"], frozenset) and [t.tolist() for t in out["frozen"]] == [[1.0] * 5]
    assert isinstance(out["by_key"], defaultdict) and out["by_key"].default_factory is list
    assert out["by_key"]["k"][0].tolist() == [1.0] * 3
    assert len(seen) == 5
    assert sorted(t.numel() for t in pin.tensors_in(batch)) == [1, 2, 3, 4, 5]  # record_stream reaches them too


class _Meta(dict):
    """A dict batch whose constructor needs more than its items."""

    def __init__(self, items, meta):
        super().__init__(items)
        self.meta = meta


def test_map_batch_moves_user_dicts_and_keeps_dict_subclasses():
    """Regression: a UserDict came back holding its old, unmoved tensors (the copy of its attributes put the
    input's ``data`` back over the moved items), and a dict subclass whose constructor takes more than the
    items came back a plain dict without its attributes: both silently."""
    from collections import UserDict

    user = UserDict(x=torch.zeros(2))
    meta = _Meta({"x": torch.zeros(1)}, meta="tile 3")
    seen, leaf = _recording()
    out = pin.map_batch({"user": user, "meta": meta}, leaf)
    assert isinstance(out["user"], UserDict) and out["user"]["x"].tolist() == [1.0, 1.0]
    assert out["user"].data is not user.data and user["x"].tolist() == [0.0, 0.0]
    assert type(out["meta"]) is _Meta and out["meta"].meta == "tile 3" and out["meta"]["x"].tolist() == [1.0]
    assert len(seen) == 2


def test_map_batch_moves_the_tensor_attributes_of_mapping_subclasses():
    """Regression: a mapping subclass's attributes were copied as they were: a UserDict's ``mask`` and a dict
    subclass's ``extra`` (rebuilt by the copy route) came back the same CPU tensors, never moved, and
    tensors_in found only the items' tensors (so DevicePrefetcher's record_stream missed the attribute's).
    They are walked as a dataclass's fields are; a UserDict's ``data`` (its items) is still not copied."""
    from collections import UserDict

    class Masked(UserDict):
        pass

    user = Masked(x=torch.zeros(2))
    user.mask = torch.zeros(3)
    meta = _Meta({"x": torch.zeros(1)}, meta="tile 3")
    meta.extra = torch.zeros(4)
    assert sorted(t.numel() for t in pin.tensors_in({"u": user, "m": meta})) == [1, 2, 3, 4]
    seen, leaf = _recording()
    out = pin.map_batch({"user": user, "meta": meta}, leaf)
    assert type(out["user"]) is Masked and out["user"]["x"].tolist() == [1.0, 1.0]
    assert out["user"].mask.tolist() == [1.0] * 3 and user.mask.tolist() == [0.0] * 3
    assert out["user"].data is not user.data and set(out["user"].data) == {"x"}
    assert type(out["meta"]) is _Meta and out["meta"].meta == "tile 3"
    assert out["meta"].extra.tolist() == [1.0] * 4 and meta.extra.tolist() == [0.0] * 4
    assert sorted(seen) == ["batch['meta'].extra", "batch['meta']['x']", "batch['user'].mask", "batch['user']['x']"]


def test_map_batch_keeps_numpy_scalars_shapes_and_reads_big_endian_arrays():
    """Regression: a 0-d numpy array (a per-batch loss weight) became a tensor of shape (1,), silently
    changing how it broadcasts and stacks; a big-endian array (as zarr v2 stores '>i4') raised torch's
    ValueError about byte orders instead of being moved."""
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    out = pin.to_device({"w": np.array(0.5), "flag": np.array(True), "ids": big}, torch.device("cpu"))
    assert out["w"].shape == () and out["w"].item() == 0.5
    assert out["flag"].shape == () and out["flag"].dtype == torch.bool
    assert out["ids"].dtype == torch.int32 and out["ids"].tolist() == big.tolist()


def test_unknown_leaf_with_array_data_names_its_path():
    batch = {"streams": [torch.zeros(1), torch.zeros(1), Opaque()]}
    with pytest.raises(TypeError, match=r"batch\['streams'\]\[2\]\.coords") as info:
        pin.map_batch(batch, lambda t, p: t, hook=pin._method_hook("pin_memory"))
    assert "Pinnable" in str(info.value) and "implement pin_memory()" in str(info.value)
    with pytest.raises(TypeError, match=r"implement to\(device"):
        pin.to_device(batch, torch.device("cpu"))
    with pytest.raises(TypeError, match="numeric"):
        pin.map_batch(np.array(["a"]), lambda t, p: t)


class Movable:
    """A custom batch class (no dataclass) that pins and moves itself."""

    def __init__(self, points, moved_to=None):
        self.points = points
        self.moved_to = moved_to

    def pin_memory(self):
        return Movable(self.points.pin_memory())

    def to(self, device, non_blocking=False):
        return Movable(self.points.to(device, non_blocking=non_blocking), moved_to=torch.device(device))


def test_to_device_lets_a_custom_batch_move_itself():
    """Regression: a Pinnable non-dataclass batch was pinned, then refused by to_device."""
    batch = {"m": Movable(torch.arange(4.0)), "x": torch.zeros(2)}
    out = pin.to_device(batch, torch.device("cpu"))
    assert isinstance(out["m"], Movable) and out["m"].moved_to == torch.device("cpu")
    assert torch.equal(out["m"].points, torch.arange(4.0))
    assert [t.shape for t in pin.tensors_in(out)] == [(4,), (2,)]  # what record_stream is applied to


def test_pin_object_without_cuda_returns_input_and_warns_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pin, "_warned_no_cuda", False)
    batch = {"x": torch.zeros(3)}
    with pytest.warns(RuntimeWarning, match="nothing was pinned"):
        assert pin.pin_object(batch) is batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pin.pin_object(batch) is batch  # once only


def test_prefetcher_on_cpu_is_a_pass_through():
    items = [{"x": torch.arange(3)}, {"x": torch.arange(4)}]
    with DevicePrefetcher(items, device="cpu") as pf:
        out = list(pf)
    assert all(a is b for a, b in zip(out, items)) and len(out) == 2


def test_prefetcher_passes_source_errors_through():
    def broken():
        yield torch.zeros(1)
        raise KeyError("source failed")

    with pytest.raises(KeyError, match="source failed"):
        list(DevicePrefetcher(broken(), device="cpu"))


def test_tensors_in_reaches_every_depth_and_ends_on_cycles():
    """record_stream must see every tensor map_batch moved, however deep, and a cyclic batch must not hang."""
    deep = {"x": torch.zeros(1)}
    for i in range(20):
        deep = [deep, torch.full((2,), float(i))] if i % 2 else {"level": deep}
    found = list(pin.tensors_in(deep))
    assert len(found) == 11 and any(t.shape == (1,) for t in found)
    cyclic = {"t": torch.ones(3)}
    cyclic["self"] = cyclic
    cyclic["pair"] = [cyclic, torch.ones(4)]
    assert sorted(t.numel() for t in pin.tensors_in(cyclic)) == [3, 4]


def test_tensors_in_follows_plain_objects_six_deep_only():
    """A self-moving batch's attributes are searched; a model or dataset it refers to is not walked whole."""
    class Node:
        def __init__(self, child, t):
            self.child, self.t = child, t

    chain = None
    for i in range(10):  # Node 9 is outermost: its tensor is 1 object deep, node 0's is 10 deep
        chain = Node(chain, torch.full((1,), float(i)))
    assert sorted(int(t.item()) for t in pin.tensors_in(chain)) == [4, 5, 6, 7, 8, 9]
    assert len(list(pin.tensors_in([[{"batch": chain}]]))) == 6  # containers do not count


def test_tensors_in_finds_an_object_reached_deep_first_and_shallow_later():
    """An object first met at the depth limit is still walked when a shorter path reaches it."""
    class Box:
        def __init__(self, inner):
            self.inner = inner

    holder = Box(torch.ones(3))  # its tensor is one object deep
    chain = holder
    for _ in range(6):  # holder at the end of six wrappers: met there first, too deep to walk
        chain = Box(chain)
    for order in ([chain, holder], [holder, chain]):
        assert [t.numel() for t in pin.tensors_in(order)] == [3], order


def test_prefetcher_refuses_an_endless_poll_interval():
    with pytest.raises(stoker.InvalidArgument, match="finite number of seconds"):
        DevicePrefetcher([], device="cpu", timeout_s=float("inf"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_prefetcher_asked_for_cuda_without_cuda_says_so():
    for device in ("cuda", "cuda:1", 0):
        with pytest.raises(stoker.InvalidArgument, match="torch sees no CUDA device"):
            DevicePrefetcher([torch.zeros(1)], device=device)
    assert DevicePrefetcher([], device=None).passthrough


def test_prefetcher_checks_depth_and_timeout():
    with pytest.raises(stoker.InvalidArgument, match="depth must be an integer >= 1"):
        DevicePrefetcher([], device="cpu", depth=0)
    with pytest.raises(stoker.InvalidArgument, match="timeout_s must be a finite number of seconds > 0"):
        DevicePrefetcher([], device="cpu", timeout_s=0)


# -- on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_pin_object_pins_a_custom_nested_batch():
    frame = Frame(coords=np.zeros((4, 3), np.float32), label="f")
    batch = {"frames": [frame, frame], "x": torch.zeros(8), "p": Pair(torch.zeros(2), np.ones(3))}
    out = pin.pin_object(batch)
    assert out["x"].is_pinned() and out["p"].a.is_pinned() and out["p"].b.is_pinned()
    assert all(f.coords.is_pinned() for f in out["frames"])
    again = pin.pin_object(out)
    assert again["x"].data_ptr() == out["x"].data_ptr()  # already pinned: not copied again


@pytest.mark.cuda
def test_prefetcher_delivers_fenced_device_batches():
    batches = [{"x": torch.full((1 << 20,), float(i))} for i in range(6)]
    seen = 0
    with DevicePrefetcher(batches, device="cuda", depth=2) as pf:
        for i, b in enumerate(pf):
            assert b["x"].is_cuda
            y = (b["x"] * 2).sum().item()  # runs on the consumer's stream after the fence
            assert y == 2.0 * i * (1 << 20)
            seen += 1
    assert seen == 6


class Length:
    """A value with a unit whose ``to`` converts units (pint's Quantity: ``q.to("m")``), no device move."""

    METRES = {"m": 1.0, "km": 1000.0}

    def __init__(self, value, unit):
        self.value, self.unit = value, unit

    def to(self, unit, **contexts):
        return Length(self.value * self.METRES[self.unit] / self.METRES[unit], unit)


def test_to_device_leaves_an_object_whose_to_takes_no_device_as_it_is():
    """to_device called ``.to(device, non_blocking=...)`` on any object with a ``to``: a batch carrying a unit
    quantity (pint's, whose ``to`` converts units) failed with that ``to``'s own error (pint: an
    AttributeError about 'NoneType'), and the Trainer with it. Such an object is now taken as one without a
    ``to``: a scalar passes as it is (a RuntimeWarning names its type), one holding tensors is a TypeError
    naming where; objects whose ``to`` moves them (Movable, a Module) still move themselves."""
    dx = Length(3.0, "km")
    with pytest.warns(RuntimeWarning, match=r"a Length was not moved: its to\(device, non_blocking=True\)"):
        out = pin.to_device({"x": torch.zeros(2), "dx": dx}, torch.device("cpu"))
    assert out["dx"] is dx and (dx.value, dx.unit) == (3.0, "km")
    with pytest.warns(RuntimeWarning, match="Length"), \
            pytest.raises(TypeError, match=r"cannot move batch\['dx'\]\.value.*its own to\(\) is no device move"):
        pin.to_device({"dx": Length(torch.arange(3.0), "km")}, torch.device("cpu"))
    module = torch.nn.Linear(2, 2)
    out = pin.to_device({"m": Movable(torch.arange(4.0)), "net": module}, torch.device("cpu"))
    assert out["m"].moved_to == torch.device("cpu") and out["net"] is module


class NoKeywords:
    """A batch class whose ``to(device)`` moves it but takes no ``non_blocking``."""

    def __init__(self, x):
        self.x = x

    def to(self, device):
        return NoKeywords(self.x.to(device))


def test_the_error_of_a_refused_to_says_what_it_raised():
    """The TypeError for an object holding tensors whose own ``to()`` raised said only that it "is no device
    move": what it raised (here: no ``non_blocking`` keyword, which a one-line fix of the class mends) was in a
    warning only. It is now in the message, and the error's cause."""
    with pytest.warns(RuntimeWarning, match="NoKeywords"), pytest.raises(TypeError) as err:
        pin.to_device({"b": NoKeywords(torch.ones(2))}, torch.device("cpu"))
    assert "its own to() is no device move" in str(err.value) and "non_blocking" in str(err.value)
    assert isinstance(err.value.__cause__, TypeError) and "non_blocking" in str(err.value.__cause__)


@pytest.mark.cuda
def test_prefetcher_moves_a_self_moving_custom_batch():
    batches = [Movable(torch.full((1 << 16,), float(i))) for i in range(3)]
    with DevicePrefetcher(batches, device="cuda", depth=2) as pf:
        out = [(b.moved_to.type, b.points.is_cuda, b.points[0].item()) for b in pf]
    assert out == [("cuda", True, float(i)) for i in range(3)]


@pytest.mark.cuda
def test_prefetcher_close_is_prompt():
    def endless():
        while True:
            yield torch.zeros(1 << 16)

    pf = DevicePrefetcher(endless(), device="cuda", depth=2)
    it = iter(pf)
    next(it)
    t0 = time.monotonic()
    pf.close()
    assert time.monotonic() - t0 < 1.5


@pytest.mark.cuda
def test_prefetcher_cuda_without_index_is_the_callers_device():
    """The producer thread starts on device 0; "cuda" must still mean the caller's current device."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs to tell the caller's device from device 0")
    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(last)
    try:
        pf = DevicePrefetcher([{"x": torch.zeros(4)}], device="cuda")
        assert pf.device == torch.device("cuda", last)
        assert [b["x"].device for b in pf] == [torch.device("cuda", last)]
    finally:
        torch.cuda.set_device(0)


@pytest.mark.cuda
def test_prefetcher_iterates_again_like_the_cpu_pass_through():
    batches = [torch.full((8,), float(i)) for i in range(3)]
    pf = DevicePrefetcher(batches, device="cuda", depth=1)
    first = [b.sum().item() for b in pf]
    second = [b.sum().item() for b in pf]
    assert first == second == [0.0, 8.0, 16.0]


@pytest.mark.cuda
def test_prefetcher_reports_a_device_it_cannot_use():
    pf = DevicePrefetcher([torch.zeros(1)], device=torch.cuda.device_count())  # one past the last GPU
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        list(pf)


def test_map_batch_maps_a_tensor_met_twice_once():
    """A tensor (or a list) in two places of a batch is mapped once, both places holding the one result as
    in the input: two device copies would double its memory and part what the batch shares."""
    t, shared = torch.zeros(3), [torch.zeros(1)]
    batch = {"a": t, "b": [t, Pair(t, shared)], "c": shared, "n": np.zeros(2)}
    batch["m"] = batch["n"]
    seen, leaf = _recording()
    out = pin.map_batch(batch, leaf)
    assert out["a"] is out["b"][0] is out["b"][1].a and out["a"].tolist() == [1.0] * 3
    assert out["c"] is out["b"][1].b and out["m"] is out["n"]
    assert sorted(seen) == ["batch['a']", "batch['b'][1].b[0]", "batch['n']"]


def test_map_batch_names_a_batch_that_contains_itself():
    """Regression: a batch that contains itself (a list appended to itself, a dict holding itself) ran into
    RecursionError; it is a TypeError naming where the batch comes back."""
    loop = [torch.zeros(1)]
    loop.append({"back": loop})
    with pytest.raises(TypeError, match=r"cannot move batch\[1\]\['back'\]: it is batch again"):
        pin.map_batch(loop, lambda t, p: t)
    with pytest.raises(TypeError, match="contains itself"):
        pin.to_device(loop, torch.device("cpu"))


@dataclasses.dataclass
class _Scaled:
    x: torch.Tensor
    scale: dataclasses.InitVar[float] = 1.0

    def __post_init__(self, scale):
        self.x = self.x * scale
        self.mask = self.x > 0  # an attribute of its own, made here


def test_map_batch_copies_a_dataclass_without_running_its_post_init_again():
    """Regression: a dataclass was rebuilt by dataclasses.replace, which runs __post_init__ again: a scaling
    there applied twice to the moved batch (silently), and an InitVar field refused (ValueError). It is copied
    and its attributes mapped: the values as they were, the mask __post_init__ made moved too."""
    batch = _Scaled(torch.tensor([1.0, -2.0]), scale=3.0)
    seen, leaf = _recording()
    out = pin.map_batch(batch, leaf)
    assert type(out) is _Scaled and out.x.tolist() == [4.0, -5.0]  # 3x, then the leaf's +1: not 9x
    assert out.mask.tolist() == [2, 1] and sorted(seen) == ["batch.mask", "batch.x"]
    assert batch.x.tolist() == [3.0, -6.0]  # the input untouched


T = TypeVar("T")


@dataclasses.dataclass
class _GenericBatch(Generic[T]):
    x: torch.Tensor
    meta: T


class _Helper:
    """An object of the user's own, holding an array map_batch cannot reach (not a field of the batch)."""

    def __init__(self) -> None:
        self.table = np.zeros(3)


def test_map_batch_passes_a_dataclass_attributes_that_hold_no_tensors_as_they_are():
    """Regression: every attribute of a dataclass was walked: a Generic dataclass's ``__orig_class__`` (set by
    ``Batch[str](...)``) led to the torch.Tensor class through its annotations, and a helper object holding an
    array was refused, both with a TypeError. Fields, and attributes holding tensors or arrays in containers,
    are moved; dunder attributes and other objects pass unchanged."""
    batch = _GenericBatch[str](torch.zeros(2), "a")
    batch.helper = _Helper()
    batch.masks = {"m": [torch.ones(1)], "n": []}  # plain data holding a tensor: moved
    seen, leaf = _recording()
    out = pin.map_batch(batch, leaf)
    assert out.x.tolist() == [1.0, 1.0] and out.meta == "a"
    assert out.__orig_class__ is batch.__orig_class__ and out.helper is batch.helper
    assert out.masks["m"][0].tolist() == [2.0] and out.masks["n"] == []
    assert sorted(seen) == ["batch.masks['m'][0]", "batch.x"]
    assert pin.to_device(batch, torch.device("cpu")).meta == "a"


@dataclasses.dataclass(frozen=True)
class _SelfCopying:
    x: torch.Tensor

    def __copy__(self):
        return self  # an immutable type's shortcut


def test_map_batch_never_moves_into_a_dataclass_whose_copy_is_itself():
    """Regression: ``copy.copy`` of a dataclass whose ``__copy__`` returns ``self`` gave the input, whose
    attributes were then replaced in place (a frozen one's too): the caller's batch changed under it."""
    batch = _SelfCopying(torch.zeros(2))
    before = batch.x
    seen, leaf = _recording()
    out = pin.map_batch(batch, leaf)
    assert out is not batch and type(out) is _SelfCopying and out.x.tolist() == [1.0, 1.0]
    assert batch.x is before and batch.x.tolist() == [0.0, 0.0]


class _Slotted:
    __slots__ = "tensor"


class _MoreSlots(_Slotted):
    __slots__ = ("u", "__private")


class _SlottedDict(dict):
    __slots__ = ("mask",)


def test_map_batch_reaches_the_slots_of_every_class():
    """Regression: only the most derived class's ``__slots__`` were looked at (and a string one letter by
    letter): a tensor in a base class's slot passed unmoved, unnamed, and tensors_in missed it; a dict
    subclass's slot attribute was dropped from the rebuilt batch."""
    obj = _MoreSlots()
    obj.tensor, obj.u, obj._MoreSlots__private = torch.zeros(1), 3, "no array"
    assert [t.numel() for t in pin.tensors_in(obj)] == [1]
    with pytest.raises(TypeError, match=r"cannot move batch\[0\]\.tensor \(_MoreSlots"):
        pin.map_batch([obj], lambda t, p: t)
    obj.tensor, obj._MoreSlots__private = None, torch.zeros(2)
    with pytest.raises(TypeError, match=r"cannot move batch\[0\]\._MoreSlots__private \(_MoreSlots"):
        pin.map_batch([obj], lambda t, p: t)
    masked = _SlottedDict(x=torch.zeros(1))
    masked.mask = torch.zeros(2)
    seen, leaf = _recording()
    out = pin.map_batch(masked, leaf)
    assert type(out) is _SlottedDict and out["x"].tolist() == [1.0] and out.mask.tolist() == [1.0, 1.0]
    assert sorted(seen) == ["batch.mask", "batch['x']"]


@dataclasses.dataclass(frozen=True, slots=True)
class _FrozenSlots:
    x: torch.Tensor
    n: int


def test_map_batch_copies_frozen_and_slotted_dataclasses():
    out = pin.map_batch(_FrozenSlots(torch.zeros(2), 5), lambda t, p: t + 1)
    assert type(out) is _FrozenSlots and out.x.tolist() == [1.0, 1.0] and out.n == 5


class _Kind(enum.Enum):
    A = 1


@dataclasses.dataclass
class _Tagged:
    x: torch.Tensor

    def __post_init__(self):
        self.extra = [self.x * 2, _Helper()]  # a tensor beside a helper object
        self.tagged = {"m": self.x > 0, "kind": _Kind.A}  # a tensor beside an enum
        self.pair = (np.ones(2, np.float32), _Kind)  # an array beside a class


def test_map_batch_moves_the_tensors_beside_other_objects_in_a_dataclass_attribute():
    """Regression: an attribute that is no field, holding a container with a tensor beside an enum or a helper
    object, was passed whole, its tensor not moved (not pinned, left on the CPU), silently. Its tensors and arrays
    are mapped; its other leaves pass as they are (no TypeError)."""
    batch = _Tagged(torch.zeros(2))
    seen, leaf = _recording()
    out = pin.map_batch(batch, leaf)
    assert out.extra[0].tolist() == [1.0, 1.0] and out.extra[1] is batch.extra[1]
    assert out.tagged["m"].tolist() == [1, 1] and out.tagged["kind"] is _Kind.A
    assert isinstance(out.pair[0], torch.Tensor) and out.pair[0].tolist() == [2.0, 2.0] and out.pair[1] is _Kind
    assert sorted(seen) == ["batch.extra[0]", "batch.pair[0]", "batch.tagged['m']", "batch.x"]
    assert batch.extra[0].tolist() == [0.0, 0.0]  # the input untouched
    batch.again = batch.extra  # one list in two attributes: one copy, as in the input
    out = pin.map_batch(batch, leaf)
    assert out.again is out.extra and out.extra is not batch.extra
