"""A cache-aware router across instances, fed by their cache events.

:class:`CacheAwareRouter` keeps one :class:`~akv.events.index.InstanceIndex`
per instance (a manager, or any engine that publishes akv's or vLLM-shaped
events), fed in process (:meth:`CacheAwareRouter.apply` with batches from a
subscription) or from a JSON-lines file (:meth:`CacheAwareRouter.apply_jsonl`).
For a prompt it computes the chain keys once (``chain_keys``) and walks each
instance's index: the longest cached prefix wins, ties go to the instance
with the fewest running sequences, then to the one registered first. An
instance running more than ``max_running`` sequences is skipped unless all
are. Once the router has applied every batch up to an instance's latest
sequence number, :meth:`CacheAwareRouter.longest_prefix` answers what that
instance's ``lookup()`` answers.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

import structlog

from akv.core.block_key import chain_keys
from akv.core.ids import describe, plain_id
from akv.core.tokens import as_token_array
from akv.errors import InvalidInput
from akv.events.index import DEFAULT_MAX_PENDING, InstanceIndex
from akv.events.jsonl import read_jsonl
from akv.events.types import CachedKey, EventBatch

__all__ = ["CacheAwareRouter"]

_TOKEN_LIMIT = 2**31


class CacheAwareRouter:
    """Picks, for a prompt, the instance with the longest cached prefix (see the module docstring).

    Single-owner (one task or thread feeds and queries it).

    Args:
        instances: Instance names, plain values (:mod:`akv.core.ids`), distinct.
        block_size: Tokens per block of every instance (an int >= 1).
        max_running: Load cap: an instance with more running sequences is
            skipped unless every instance has more (``None``: no cap).
        max_pending: Batches kept per stale instance until its resync.
        logger: structlog logger (``structlog.get_logger("akv")`` unless given).

    Raises:
        InvalidInput: A bad argument (a repeated or non-plain instance name, ...).
    """

    __slots__ = ("_indexes", "_max_pending", "_route_log", "block_size", "max_running")

    def __init__(
        self,
        instances: Iterable[Hashable] = (),
        *,
        block_size: int,
        max_running: int | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        logger: Any = None,
    ) -> None:
        if type(block_size) is not int or block_size < 1:
            raise InvalidInput(f"block_size of CacheAwareRouter must be an int >= 1, got {describe(block_size)}")
        if max_running is not None and (type(max_running) is not int or max_running < 0):
            raise InvalidInput(f"max_running must be None or an int >= 0, got {describe(max_running)}")
        InstanceIndex(block_size, max_pending=max_pending)  # validates max_pending before anything is kept
        self.block_size = block_size
        self.max_running = max_running
        self._max_pending = max_pending
        self._indexes: dict[Hashable, InstanceIndex] = {}
        self._route_log = (logger or structlog.get_logger("akv")).bind(component="router")
        for instance in instances:
            self.add_instance(instance)

    @property
    def instances(self) -> tuple:
        """The instance names, in registration order."""
        return tuple(self._indexes)

    def add_instance(self, instance: Hashable) -> None:
        """Register an instance with an empty index, current as of sequence number 0.

        Raises:
            InvalidInput: ``instance`` is not plain or already registered.
        """
        instance = plain_id(instance, "instance of CacheAwareRouter")
        if instance in self._indexes:
            raise InvalidInput(f"instance {describe(instance)} is already registered")
        self._indexes[instance] = InstanceIndex(self.block_size, max_pending=self._max_pending)

    def remove_instance(self, instance: Hashable) -> None:
        """Forget an instance and its index.

        Raises:
            InvalidInput: ``instance`` is not registered.
        """
        self._indexes.pop(self._key(instance))

    def _key(self, instance: Hashable) -> Hashable:
        instance = plain_id(instance, "instance of CacheAwareRouter")
        if instance not in self._indexes:
            raise InvalidInput(f"unknown instance {describe(instance)}; registered: {describe(self.instances)}")
        return instance

    def index(self, instance: Hashable) -> InstanceIndex:
        """The index of one instance (its staleness, sequence numbers and keys).

        Raises:
            InvalidInput: ``instance`` is not registered.
        """
        return self._indexes[self._key(instance)]

    def apply(self, instance: Hashable, batch: EventBatch) -> bool:
        """Apply an instance's next batch (see :meth:`InstanceIndex.apply`).

        Returns:
            Whether the instance's index is current (``False``: stale, call :meth:`resync`).

        Raises:
            InvalidInput: Unknown instance; a duplicate or out-of-order batch;
                events that do not fit the index (the index is unchanged).
        """
        index = self.index(instance)
        was_stale = index.stale
        current = index.apply(batch)
        if not current and not was_stale:
            self._route_log.info("router.index_stale", instance=instance, seq=batch.seq, applied_seq=index.applied_seq)
        return current

    def apply_jsonl(self, instance: Hashable, path: str | Path) -> bool:
        """Apply every batch of a JSON-lines events file (``akv replay --events-out``), in file order.

        Returns:
            Whether the instance's index is current after the last batch.

        Raises:
            InvalidInput: The file cannot be read, a malformed line, or a
                batch :meth:`apply` refuses (the batches before it stay applied).
        """
        index = self.index(instance)
        for batch in read_jsonl(path):
            self.apply(instance, batch)
        return not index.stale

    def resync(self, instance: Hashable, cached_keys: Iterable[CachedKey], as_of_seq: int) -> None:
        """Replace an instance's index by its snapshot, then apply the batches kept after ``as_of_seq``.

        Raises:
            EventsGap: The snapshot leaves a hole (see :meth:`InstanceIndex.resync`); nothing changed.
            InvalidInput: Unknown instance or a malformed snapshot; nothing changed.
        """
        index = self.index(instance)
        index.resync(cached_keys, as_of_seq)
        self._route_log.info("router.index_resynced", instance=instance, as_of_seq=as_of_seq, seq=index.applied_seq)

    def _prompt_keys(self, prompt: Any, namespace: Hashable) -> list[bytes]:
        """Chain keys of the blocks of ``prompt`` a lookup can hit (never the one with the last token)."""
        tokens = as_token_array(prompt, _TOKEN_LIMIT, what="prompt")
        blocks = (len(tokens) - 1) // self.block_size
        if not blocks:
            plain_id(namespace, "namespace", allow_none=True)
            return []
        return chain_keys(tokens[: blocks * self.block_size], self.block_size, namespace)

    def longest_prefix(
        self, instance: Hashable, prompt: Any, namespace: Hashable = None, *, medium: str | None = None
    ) -> int:
        """Prompt tokens the instance holds in its prefix cache, as its ``lookup()`` counts them.

        At most ``(len(prompt) - 1) // block_size`` blocks (the last token is
        always computed); 0 for a stale instance. O(prompt) for the keys.

        Args:
            instance: A registered instance.
            prompt: Token ids, ints in ``[0, 2**31)``.
            namespace: ``None`` or a plain value.
            medium: Count blocks of this tier only (``None``: any tier).

        Returns:
            Tokens, a multiple of ``block_size``.

        Raises:
            InvalidInput: Unknown instance, or a non-plain namespace.
            InvalidTokens: Bad prompt.
        """
        index = self.index(instance)
        return index.prefix_blocks(self._prompt_keys(prompt, namespace), medium) * self.block_size

    def _running(self, running: dict | None) -> dict:
        """``running`` validated: known instances, ints >= 0; missing instances count 0."""
        if running is None:
            return {}
        if type(running) is not dict:
            raise InvalidInput(f"running must be a dict of instance -> running sequences, got {describe(running)}")
        out = {}
        for instance, count in running.items():
            if type(count) is not int or count < 0:
                raise InvalidInput(f"running[{describe(instance)}] must be an int >= 0, got {describe(count)}")
            out[self._key(instance)] = count
        return out

    def pick(self, prompt: Any, namespace: Hashable = None, running: dict | None = None) -> Hashable:
        """The instance to serve ``prompt``: longest cached prefix, then fewest running, then first registered.

        Instances above ``max_running`` are skipped unless all are. The
        prompt's keys are computed once; each instance's walk is O(blocks matched).

        Args:
            prompt: Token ids, ints in ``[0, 2**31)``.
            namespace: ``None`` or a plain value.
            running: Instance -> running sequences (missing instances count 0).

        Returns:
            A registered instance.

        Raises:
            InvalidInput: No instance registered; an unknown instance or a bad
                count in ``running``; a non-plain namespace.
            InvalidTokens: Bad prompt.
        """
        if not self._indexes:
            raise InvalidInput("pick() needs at least one registered instance")
        loads = self._running(running)
        keys = self._prompt_keys(prompt, namespace)
        candidates = list(self._indexes)
        if self.max_running is not None:
            under = [i for i in candidates if loads.get(i, 0) <= self.max_running]
            candidates = under or candidates
        order = {instance: n for n, instance in enumerate(self._indexes)}
        return max(
            candidates,
            key=lambda i: (self._indexes[i].prefix_blocks(keys), -loads.get(i, 0), -order[i]),
        )
