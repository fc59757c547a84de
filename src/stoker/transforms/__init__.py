"""Batch transforms: ``Config(transform=...)`` runs one on every batch, on the batch's device, before the
consumer sees it.

>>> from stoker.transforms import FillNaN, Normalize, RandomFlip
>>> cfg = stoker.Config(batch_size=8, dtype="f32",
...                     transform=[FillNaN(0.0), Normalize(mean=[280.0, 0.0, 0.0], std=[12.0, 5.0, 5.0]),
...                                RandomFlip(axes=(-2, -1), seed=0)])

A transform is any callable ``batch -> batch`` on a tensor of shape ``(B, *sample_shape)`` (``(B, C, *box)``
for samples of several arrays), or on a dict ``{field name: (B, ...) tensor}`` for samples of named fields
(``Normalize(..., field="raw")`` and ``FillNaN(..., field=...)`` act on one field of such a batch), which it
gets once per batch, on the consumer's thread in ``pop``, after every field is ready. It runs
after the cast to the output dtype, in the batch's slot: on the CPU on the pipeline thread that finished the
batch, on a GPU on the pipeline's side stream before the event the consumer waits on. With ``dtype='bf16'``
or ``'f16'`` the batch is made and transformed in float32 and rounded to the 16-bit output once, after the
transform (a float32 work slot per batch in flight, counted in ``host_buffer_bytes``; on a GPU a float32 work
buffer in ``device_buffer_bytes``), so ``Normalize`` near a large mean loses nothing to an early rounding.
A batch of named fields is not: its transform runs at ``pop`` on each field as delivered, a ``'bf16'`` field
already rounded (values near 280 are 2 apart, and normalising them by a std of 3 is off by up to a third of
it). Ask for ``'f32'`` for a field ``Normalize`` acts on (``dtype={"raw": "f32", "labels": "native"}``).

**Keys.** A transform whose ``takes_keys`` attribute is true (a :class:`Keyed` subclass) is called
``t(batch, keys)``: ``keys`` is an int64 array ``(B, 2)``, each sample's ``(epoch, index)`` (the same as
``Batch.keys``). For a sample of a :class:`~stoker.SampleSource` pushed as its ``RankShare`` it is the epoch
and the sample's index in that epoch's global order, so a resumed run, on any world size, sees the same keys;
for a sample pushed as a plain sequence or iterable it is ``(0, n)``, ``n`` the samples of such pushes
pulled into the pipeline before it. :func:`uniform` draws numbers from keys with a counter-based hash (no
generator state): the built-ins :class:`RandomFlip` and :class:`RandomTranspose` draw per sample from
``(seed, epoch, index)``, so their draws do not depend on the order batches finish in, on the consumer's
speed, on the thread or on the device. :class:`Compose` passes the keys on; any other callable is called
``t(batch)``.

**CF attributes.** Arrays' CF attributes (``Config(cf=True)``, the default: packed values unpacked, fills to
NaN, as xarray decodes them) are decoded in the slot just before the transform, so it sees the decoded values
(``FillNaN`` after a ``_FillValue``).

It should work in place and return its argument (the built-ins do: no extra batch-sized buffer); a new
tensor of the batch's shape, dtype and device it returns is copied back into the slot (one batch copy; two
for a view of the batch such as ``b.transpose(-2, -1)``); any
other result (another shape, dtype or device: never cast back silently) is an
:class:`~stoker.errors.InvalidArgument` naming the transform. Its errors reach the consumer at ``pop``, like
a read error of that batch.

On the CPU, transforms of different batches may run at the same time on several pipeline threads, in no
particular batch order: a transform must be thread-safe, and one that draws random numbers should draw them
from the keys, not from a generator whose state depends on the order of its calls. The built-ins are both.

Its time is the ``transform`` stage of ``Pipeline.stats()``: on the CPU the transform and the rounding to
a 16-bit output; on a GPU the time to enqueue it (the kernels run on the side stream, with the copy).
"""

from .augment import RandomFlip, RandomTranspose
from .compose import Compose, Keyed, Transform, apply, as_transform, takes_keys
from .keys import uniform
from .values import FillNaN, Normalize

__all__ = ["Compose", "FillNaN", "Keyed", "Normalize", "RandomFlip", "RandomTranspose", "Transform", "apply",
           "as_transform", "takes_keys", "uniform"]
