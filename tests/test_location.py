"""Locations (where a block's K/V is) are validated, and the tree reports its blocks' device locations."""

from __future__ import annotations

import pytest

from akv.core.location import Location, Medium
from akv.core.radix_tree import RadixTree


def test_location_fields_are_validated() -> None:
    assert Location.device(7) == Location(medium=Medium.DEVICE, index=7)
    assert Location(medium=Medium.HOST, index=0).medium is Medium.HOST
    for medium, index in ((0, 1), ("device", 1), (Medium.DEVICE, -1), (Medium.DEVICE, 1.0), (Medium.DEVICE, True)):
        with pytest.raises(ValueError):
            Location(medium=medium, index=index)


def test_tree_blocks_are_on_the_device_at_their_block_id() -> None:
    tree = RadixTree(2)
    tokens = bytes(range(16))  # two blocks of two int32 tokens
    assert tree.insert("ns", None, tokens, [5, 9]) == 2
    assert [tree.location(b) for b in (5, 9)] == [Location.device(5), Location.device(9)]
    with pytest.raises(KeyError):
        tree.location(6)
    assert tree.remove_leaves([9]) == ([9], [])
    with pytest.raises(KeyError):
        tree.location(9)
