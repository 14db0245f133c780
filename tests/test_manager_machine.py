"""KVCacheManager with its actors and real tensors against the plain prefix model (akv.testing)."""

from __future__ import annotations

from akv.testing import ManagerMachine, TestManagerMachine

__all__ = ["TestManagerMachine"]


def test_machine_is_exported_with_its_settings() -> None:
    assert TestManagerMachine is ManagerMachine.TestCase
    assert (TestManagerMachine.settings.max_examples, TestManagerMachine.settings.stateful_step_count) == (40, 30)
