"""Where a block's K/V lives (its location), kept apart from what it holds (its key).

A cached block has two names. Its **key** (:mod:`akv.core.block_key`) says
*what* it holds: a chained hash of its tokens and every block above it, the
same in every process and on every machine. Its **location** says *where*
those K/V tensors are now: a medium and an index in that medium. The prefix
tree (:class:`~akv.core.radix_tree.RadixTree`) stores, per block, its
location and the tokens that verify a match; the key is derived from those
tokens on demand. A block that moves between media (demoted to host memory,
saved in a snapshot, offered to a shared store) keeps its key and its place
in the tree and changes only its location.

Today every block the tree holds is on the device, and its location index is
its device block id (one id names the same slot in every layer's tensor).
The other media are reserved so that a host tier, snapshots and a remote
store fit without another change to the tree's layout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Medium(enum.IntEnum):
    """The kind of memory a block's K/V is in.

    Attributes:
        DEVICE: The accelerator's KV pool; the index is a device block id.
        HOST: Reserved: a slot of a host-memory pool of the same layout.
        SNAPSHOT: Reserved: a block of a snapshot file on disk.
        REMOTE: Reserved: an entry of a shared store (keyed by content).
    """

    DEVICE = 0
    HOST = 1
    SNAPSHOT = 2
    REMOTE = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Location:
    """Where one block's K/V is: a medium and an index in it.

    Args:
        medium: The medium (:class:`Medium`).
        index: Position in that medium (for :attr:`Medium.DEVICE`, the
            device block id); an int ``>= 0``.

    Raises:
        ValueError: ``medium`` is not a :class:`Medium`, or ``index`` is not
            an int ``>= 0``.
    """

    medium: Medium
    index: int

    def __post_init__(self) -> None:
        if not isinstance(self.medium, Medium):
            raise ValueError(f"medium must be a Medium, got {self.medium!r}")
        if type(self.index) is not int or self.index < 0:
            raise ValueError(f"index must be an int >= 0, got {self.index!r}")

    @classmethod
    def device(cls, block_id: int) -> Location:
        """The location of device block ``block_id``.

        Raises:
            ValueError: ``block_id`` is not an int ``>= 0``.
        """
        return cls(medium=Medium.DEVICE, index=block_id)
