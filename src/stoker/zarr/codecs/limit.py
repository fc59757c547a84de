"""What the bounded decoders share: the error for an output past its bound."""

from __future__ import annotations

import numpy as np


class TooLarge(ValueError):
    """The stored bytes decode to more than ``bound`` bytes (the caller words the error with its context)."""

    def __init__(self, codec_id: str, bound: int, claimed: int | None = None) -> None:
        said = f" (its header says {claimed})" if claimed is not None else ""
        super().__init__(f"{codec_id} output exceeds {bound} bytes{said}")
        self.codec_id, self.bound, self.claimed = codec_id, bound, claimed


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first byte: what ``a.ctypes.data`` gives, without its costly object."""
    return a.__array_interface__["data"][0]
