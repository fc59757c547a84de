"""The device side: which device a pipeline delivers to, pinning custom batches, prefetching onto a GPU.

>>> from stoker.device import DevicePrefetcher, pin_object
>>> batch = pin_object({"x": torch.randn(8, 3)})      # pinned where CUDA is available
>>> for b in DevicePrefetcher(loader, device="cuda"):
...     ...

Modules: :mod:`~stoker.device.resolve` (Config.device against torch's current device, one resolver),
:mod:`~stoker.device.pin` (pin_object, to_device, map_batch), :mod:`~stoker.device.prefetch`
(DevicePrefetcher).
"""

from .pin import Pinnable, map_batch, pin_object, to_device
from .prefetch import DevicePrefetcher

__all__ = ["DevicePrefetcher", "Pinnable", "map_batch", "pin_object", "to_device"]
