"""RadixTree (the prefix cache index) and block_keys, asserted exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from akv.core.radix_tree import RadixTree, block_keys

BS = 4
NS = ("shard0", None)


def key(*tokens: int) -> bytes:
    """The tree key of one block of tokens: little-endian int32 bytes."""
    assert len(tokens) == BS
    return np.array(tokens, dtype="<i4").tobytes()


K0, K1, K2, K3 = key(0, 1, 2, 3), key(4, 5, 6, 7), key(8, 9, 10, 11), key(12, 13, 14, 15)
KX = key(7, 7, 7, 7)


@pytest.fixture
def tree() -> RadixTree:
    t = RadixTree(BS)
    assert t.insert(NS, None, K0 + K1 + K2, [5, 6, 7]) == 3
    return t


# ------------------------------------------------------------------ block_keys
def test_block_keys_are_per_block_int32_bytes() -> None:
    tokens = np.arange(10, dtype=np.int32)
    keys = block_keys(tokens, BS, 2)
    assert keys == [K0, K1]
    assert [len(k) for k in keys] == [16, 16]
    assert block_keys(tokens, BS, 0) == []
    assert block_keys(np.array([1, 2, 3, 4], dtype=np.int32), 2, 2) == [
        np.array([1, 2], dtype="<i4").tobytes(),
        np.array([3, 4], dtype="<i4").tobytes(),
    ]


def test_block_keys_ignore_tokens_past_the_full_blocks() -> None:
    a = block_keys(np.array([0, 1, 2, 3, 99], dtype=np.int32), BS, 1)
    b = block_keys(np.array([0, 1, 2, 3, 42, 43], dtype=np.int32), BS, 1)
    assert a == b == [K0]


def test_block_keys_distinguish_token_order() -> None:
    assert block_keys(np.array([1, 0, 2, 3], dtype=np.int32), BS, 1) != [K0]


# ------------------------------------------------------------------------ match
def test_match_longest_prefix(tree: RadixTree) -> None:
    assert tree.match(NS, K0 + K1 + K2) == [5, 6, 7]
    assert tree.match(NS, K0 + K1 + K2 + K3) == [5, 6, 7]
    assert tree.match(NS, K0 + K1) == [5, 6]
    assert tree.match(NS, K0 + KX + K2) == [5]
    assert tree.match(NS, KX) == []
    assert tree.match(NS, b"") == []
    assert len(tree) == 3
    assert 5 in tree and 7 in tree and 8 not in tree


def test_same_block_tokens_under_another_prefix_never_hit(tree: RadixTree) -> None:
    # K1 and K2 are cached, but only below K0: on their own, or below another
    # block, they are different prefixes.
    assert tree.match(NS, K1) == []
    assert tree.match(NS, K1 + K2) == []
    assert tree.match(NS, KX + K1 + K2) == []
    assert tree.lookup(NS, K2) == 0


def test_namespaces_isolate(tree: RadixTree) -> None:
    other = ("shard0", "tenant-b")
    assert tree.match(other, K0 + K1) == []
    assert tree.lookup(other, K0) == 0
    assert tree.insert(other, None, K0 + K1, [20, 21]) == 2
    assert tree.match(other, K0 + K1 + K2) == [20, 21]
    assert tree.match(NS, K0 + K1 + K2) == [5, 6, 7]
    assert tree.match(("shard1", None), K0) == []
    assert sorted(tree.block_ids()) == [5, 6, 7, 20, 21]
    tree.check()


def test_lookup_equals_match_length(tree: RadixTree) -> None:
    assert tree.lookup(NS, K0 + K1 + K2 + K3) == 3
    assert tree.lookup(NS, K0 + KX) == 1
    assert tree.lookup(("nowhere",), K0) == 0
    assert len(tree) == 3
    tree.check()


# ----------------------------------------------------------------------- insert
def test_insert_below_a_parent_block(tree: RadixTree) -> None:
    assert tree.insert(NS, 6, KX, [9]) == 1
    assert tree.match(NS, K0 + K1 + KX) == [5, 6, 9]
    assert tree.match(NS, K0 + K1 + K2) == [5, 6, 7]
    assert tree.path(9) == [5, 6, 9]
    assert tree.is_leaf(9) and tree.is_leaf(7) and not tree.is_leaf(6)
    tree.check()


def test_insert_below_unknown_parent_returns_zero(tree: RadixTree) -> None:
    assert tree.insert(NS, 99, K3, [8]) == 0
    assert 8 not in tree
    assert len(tree) == 3


def test_insert_of_already_published_chain_counts_it(tree: RadixTree) -> None:
    assert tree.insert(NS, None, K0 + K1 + K2, [5, 6, 7]) == 3
    assert tree.insert(NS, 7, K3, [8]) == 1
    assert tree.insert(NS, None, K0 + K1 + K2 + K3, [5, 6, 7, 8]) == 4
    assert len(tree) == 4
    tree.check()


def test_insert_stops_at_a_duplicate_block(tree: RadixTree) -> None:
    # The same tokens computed twice (as block 9 instead of 6): the chain ends
    # there and neither 9 nor anything after it is published.
    assert tree.insert(NS, None, K0 + K1 + K3, [5, 9, 10]) == 1
    assert 9 not in tree and 10 not in tree
    assert tree.insert(NS, None, K0 + K1, [11, 12]) == 0
    assert 11 not in tree and 12 not in tree
    assert len(tree) == 3
    assert tree.match(NS, K0 + K1 + K2) == [5, 6, 7]
    tree.check()


def test_insert_rejects_a_block_already_elsewhere(tree: RadixTree) -> None:
    with pytest.raises(ValueError, match="block 7 is already in the prefix cache elsewhere"):
        tree.insert(NS, None, KX, [7])
    assert tree.match(NS, KX) == []
    assert tree.path(7) == [5, 6, 7]
    tree.check()


def test_insert_rejects_mismatched_lengths(tree: RadixTree) -> None:
    with pytest.raises(ValueError, match="2 blocks of tokens for 1 blocks"):
        tree.insert(NS, None, K0 + K1, [5])
    assert len(tree) == 3


# ----------------------------------------------------------------------- remove
def test_remove_leaves_refuses_inner_nodes(tree: RadixTree) -> None:
    assert tree.remove_leaves([5, 6]) == ([], [5, 6])
    assert tree.remove_leaves([99]) == ([], [99])
    assert len(tree) == 3
    assert tree.remove_leaves([7]) == ([7], [])
    assert tree.match(NS, K0 + K1 + K2) == [5, 6]
    assert 7 not in tree
    tree.check()


def test_remove_leaves_in_order_takes_parent_after_child(tree: RadixTree) -> None:
    assert tree.remove_leaves([7, 6, 5]) == ([7, 6, 5], [])
    assert len(tree) == 0
    assert tree.match(NS, K0) == []
    assert tree.block_ids() == []
    # The namespace root survives; the same tokens can be published again under new ids.
    assert tree.insert(NS, None, K0, [30]) == 1
    assert tree.match(NS, K0 + K1) == [30]
    tree.check()


def test_remove_leaves_parent_before_child_is_refused(tree: RadixTree) -> None:
    assert tree.remove_leaves([6, 7]) == ([7], [6])
    assert tree.match(NS, K0 + K1 + K2) == [5, 6]
    tree.check()


def test_remove_then_same_id_can_be_inserted_elsewhere(tree: RadixTree) -> None:
    tree.remove_leaves([7])
    assert tree.insert(NS, None, KX, [7]) == 1
    assert tree.path(7) == [7]
    tree.check()


# ------------------------------------------------------------------- path/check
def test_path_of_unknown_block_raises(tree: RadixTree) -> None:
    assert tree.path(5) == [5]
    assert tree.path(7) == [5, 6, 7]
    with pytest.raises(KeyError):
        tree.path(42)


# ------------------------------------------------------- against a plain model
class _ModelTree:
    """The tree's contract in the plainest form: (parent, key) -> block, one op at a time.

    A namespace's root is the node ``("root", namespace)``; blocks are ints.
    """

    def __init__(self) -> None:
        self.child: dict[tuple[object, bytes], int] = {}
        self.parent: dict[int, object] = {}

    def insert(self, parent: int | None, keys: list[bytes], ids: list[int], namespace=NS) -> int:
        if parent is not None and parent not in self.parent:
            return 0
        node, done = ("root", namespace) if parent is None else parent, 0
        for k, b in zip(keys, ids):
            found = self.child.get((node, k))
            if found is None:
                break
            if found != b:
                return done
            node, done = b, done + 1
        new = ids[done:]
        if any(b in self.parent for b in new) or len(set(new)) != len(new):
            raise ValueError("already in the prefix cache elsewhere")
        for k, b in zip(keys[done:], new):
            self.child[(node, k)] = b
            self.parent[b] = node
            node = b
        return len(ids)

    def match(self, namespace, keys: list[bytes]) -> list[int]:
        node, out = ("root", namespace), []
        for k in keys:
            node = self.child.get((node, k))
            if node is None:
                break
            out.append(node)
        return out

    def remove_leaves(self, ids: list[int]) -> tuple[list[int], list[int]]:
        removed, refused = [], []
        for b in ids:
            if b not in self.parent or any(p == b for p in self.parent.values()):
                refused.append(b)
                continue
            del self.child[next(e for e, c in self.child.items() if c == b)]
            del self.parent[b]
            removed.append(b)
        return removed, refused


#: Two tenants' namespaces: the same tokens under each are different prefixes.
NAMESPACES = (NS, ("shard0", "tenant-b"))


@st.composite
def _tree_ops(draw):
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        if draw(st.booleans()):
            parent = draw(st.one_of(st.none(), st.integers(0, 40)))
            n = draw(st.integers(1, 20))
            keys = [key(t, 0, 0, 0) for t in draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))]
            ids = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
            ops.append(("insert", parent, keys, ids, draw(st.sampled_from(NAMESPACES))))
        elif draw(st.booleans()):  # a prompt's lookup, in either namespace
            keys = [key(t, 0, 0, 0) for t in draw(st.lists(st.integers(0, 2), max_size=8))]
            ops.append(("match", draw(st.sampled_from(NAMESPACES)), keys))
        elif draw(st.booleans()):
            ops.append(("remove", draw(st.lists(st.integers(0, 40), max_size=40))))
        elif draw(st.booleans()):  # a decode step's single-block publishes
            items = draw(
                st.lists(
                    st.tuples(st.one_of(st.none(), st.integers(0, 40)), st.integers(0, 2), st.integers(0, 40)),
                    max_size=8,
                )
            )
            ops.append(("insert_blocks", [(p, key(t, 0, 0, 0), b) for p, t, b in items]))
        else:  # blocks that are in the tree, a drawn share of them, deepest first or shuffled
            ops.append(("remove_cached", draw(st.booleans()), draw(st.randoms(use_true_random=False))))
    return ops


def _cached_batch(model: _ModelTree, deepest_first: bool, rnd) -> list[int]:
    def depth(b):
        d = 0
        while isinstance(b, int):
            b, d = model.parent[b], d + 1
        return d

    ids = rnd.sample(sorted(model.parent), rnd.randint(0, len(model.parent)))
    if deepest_first:
        ids.sort(key=depth, reverse=True)
    if ids and rnd.random() < 0.25:  # one block listed twice
        ids.insert(rnd.randint(0, len(ids)), rnd.choice(ids))
    return ids


@settings(max_examples=300, deadline=None)
@given(_tree_ops())
# A chain 1-2-3 with a branch 4 below 2: removing the inner blocks 2 and 1
# before (and after) their children must be refused, then succeed leaf first.
@example(
    [
        ("insert", None, [key(0, 0, 0, 0), key(1, 0, 0, 0), key(2, 0, 0, 0)], [1, 2, 3], NS),
        ("insert", 2, [key(0, 0, 0, 0)], [4], NS),
        ("remove", [2, 1, 3]),
        ("remove", [1, 4, 2, 1]),
    ]
)
# The same tokens published by two tenants under different block ids: each
# namespace matches its own blocks (a key without the namespace would merge them).
@example(
    [
        ("insert", None, [key(0, 0, 0, 0), key(1, 0, 0, 0)], [1, 2], NS),
        ("insert", None, [key(0, 0, 0, 0), key(1, 0, 0, 0)], [3, 4], NAMESPACES[1]),
        ("match", NS, [key(0, 0, 0, 0), key(1, 0, 0, 0), key(2, 0, 0, 0)]),
        ("match", NAMESPACES[1], [key(0, 0, 0, 0), key(1, 0, 0, 0)]),
        ("remove", [2, 1]),
        ("match", NAMESPACES[1], [key(0, 0, 0, 0)]),
    ]
)
def test_insert_and_remove_agree_with_a_plain_model(ops) -> None:
    """Random chains in (two namespaces), lookups, random and in-tree batches out:
    the results (published counts, matches, removed and refused ids, errors,
    every path and leaf) equal the plain model's, and a rejected insert changes
    nothing."""
    tree, model = RadixTree(BS), _ModelTree()
    for op in ops:
        if op[0] == "insert":
            _, parent, keys, ids, ns = op
            try:
                want = model.insert(parent, keys, ids, ns)
            except ValueError:
                before = sorted(tree.block_ids())
                with pytest.raises(
                    ValueError, match=r"already in the prefix cache elsewhere|listed twice in one chain"
                ):
                    tree.insert(ns, parent, b"".join(keys), ids)
                assert sorted(tree.block_ids()) == before
            else:
                assert tree.insert(ns, parent, b"".join(keys), ids) == want
        elif op[0] == "match":
            _, ns, keys = op
            assert tree.match(ns, b"".join(keys)) == model.match(ns, keys)
            assert tree.lookup(ns, b"".join(keys)) == len(model.match(ns, keys))
        elif op[0] == "insert_blocks":
            saved = (dict(model.child), dict(model.parent))
            try:
                want = [model.insert(p, [k], [b]) for p, k, b in op[1]]
            except ValueError:
                model.child, model.parent = saved
                before = sorted(tree.block_ids())
                with pytest.raises(ValueError, match="already in the prefix cache elsewhere"):
                    tree.insert_blocks([(NS, p, k, b) for p, k, b in op[1]])
                assert sorted(tree.block_ids()) == before
            else:
                assert tree.insert_blocks([(NS, p, k, b) for p, k, b in op[1]]) == want
        else:
            ids = op[1] if op[0] == "remove" else _cached_batch(model, *op[1:])
            assert tree.remove_leaves(ids) == model.remove_leaves(ids)
        tree.check()
        assert sorted(tree.block_ids()) == sorted(model.parent)
        for b in model.parent:
            path, node = [], b
            while isinstance(node, int):
                path.append(node)
                node = model.parent[node]
            assert tree.path(b) == path[::-1]
            assert tree.is_leaf(b) == all(p != b for p in model.parent.values())


def test_remove_of_a_whole_chain_leaf_first() -> None:
    t = RadixTree(BS)
    keys = [key(i, 0, 0, 0) for i in range(40)]
    ids = list(range(100, 140))
    assert t.insert(NS, None, b"".join(keys), ids) == 40
    assert t.insert(NS, 119, KX, [200]) == 1  # a branch: 119 has two children
    assert t.remove_leaves(ids[:19:-1]) == (ids[:19:-1], [])  # 139..120, leaf first
    assert t.is_leaf(200) and not t.is_leaf(119)
    assert t.remove_leaves([119, *ids[18::-1]]) == ([], [119, *ids[18::-1]])
    assert t.remove_leaves([200, *ids[19::-1]]) == ([200, *ids[19::-1]], [])
    assert len(t) == 0
    t.check()


def test_rejected_insert_undoes_only_its_own_blocks() -> None:
    t = RadixTree(BS)
    assert t.insert(NS, None, K0 + K1, [5, 6]) == 2
    # Walks 5 and 6, adds 9 below 6, then meets 6 again: only 9 is taken back.
    with pytest.raises(ValueError, match="block 6 is already in the prefix cache elsewhere"):
        t.insert(NS, None, K0 + K1 + K2 + K3, [5, 6, 9, 6])
    assert t.match(NS, K0 + K1 + K2) == [5, 6] and t.is_leaf(6) and 9 not in t
    with pytest.raises(ValueError, match="block 10 is listed twice in one chain"):
        t.insert(NS, 6, K2 + K3 + KX, [10, 11, 10])
    assert len(t) == 2 and 10 not in t and 11 not in t
    t.check()


def test_block_ids_outside_the_lists_are_not_in_the_tree(tree: RadixTree) -> None:
    for b in (-1, -3, 8, 10**6):
        assert b not in tree and not tree.is_leaf(b)
        with pytest.raises(KeyError):
            tree.path(b)
    assert tree.remove_leaves([-1, 10**6, 7]) == ([7], [-1, 10**6])
    with pytest.raises(ValueError, match="negative block id"):
        tree.insert(NS, None, KX, [-2])
    assert tree.insert(NS, None, KX, [10**5]) == 1 and tree.path(10**5) == [10**5]
    assert tree.block_ids() == [5, 6, 10**5]
    tree.check()
