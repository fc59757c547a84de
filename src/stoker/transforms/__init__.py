"""Batch transforms: ``Config(transform=...)`` runs one on every batch, on the batch's device, before the
consumer sees it.

>>> from stoker.transforms import FillNaN, Normalize
>>> cfg = stoker.Config(batch_size=8, dtype="f32",
...                     transform=[FillNaN(0.0), Normalize(mean=[280.0, 0.0, 0.0], std=[12.0, 5.0, 5.0])])

A transform is any callable ``batch -> batch`` on a tensor of shape ``(B, *sample_shape)`` (``(B, C, *box)``
for samples of several arrays). It runs after the cast to the output dtype, in the batch's slot: on the CPU
on the pipeline thread that finished the batch, on a GPU on the pipeline's side stream before the event the
consumer waits on. With ``dtype='bf16'`` or ``'f16'`` the batch is made and transformed in float32 and
rounded to the 16-bit output once, after the transform (a float32 work slot per batch in flight, counted
in ``host_buffer_bytes``; on a GPU a float32 work buffer in ``device_buffer_bytes``), so ``Normalize`` near
a large mean loses nothing to an early rounding. Arrays' CF attributes (``Config(cf=True)``, the default:
packed values unpacked, fills to NaN, as xarray decodes them) are decoded in the same place just before the
transform, so it sees the decoded values (``FillNaN`` after a ``_FillValue``).

It should work in place and return its argument (the built-ins do: no extra batch-sized buffer); a new
tensor of the batch's shape, dtype and device it returns is copied back into the slot (one batch copy); any
other result (another shape, dtype or device: never cast back silently) is an
:class:`~stoker.errors.InvalidArgument` naming the transform. Its errors reach the consumer at ``pop``, like
a read error of that batch.

On the CPU, transforms of different batches may run at the same time on several pipeline threads, in no
particular batch order: a transform must be thread-safe, and one that draws random numbers should not
rely on the order of its calls. The built-ins are both.

Its time is the ``transform`` stage of ``Pipeline.stats()``: on the CPU the transform and the rounding to
a 16-bit output; on a GPU the time to enqueue it (the kernels run on the side stream, with the copy).
"""

from .compose import Compose, Transform, apply, as_transform
from .values import FillNaN, Normalize

__all__ = ["Compose", "FillNaN", "Normalize", "Transform", "apply", "as_transform"]
