"""Test helpers shipped with akv, so applications embedding it can run them too.

:mod:`akv.testing.state_machine` holds a Hypothesis ``RuleBasedStateMachine``
that drives a :class:`~akv.core.shard_state.ShardState` against a plain-Python
model (``ShardStateMachine``; ``PendingCopiesMachine`` keeps copy-on-write
copies pending across steps). Hypothesis is a development dependency, so it is
imported only when a machine is first used::

    from akv.testing import ShardStateMachine, TestShardStateMachine
"""

from __future__ import annotations

from typing import Any

__all__ = ["PendingCopiesMachine", "ShardStateMachine", "TestPendingCopiesMachine", "TestShardStateMachine"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from akv.testing import state_machine

        return getattr(state_machine, name)
    raise AttributeError(f"module 'akv.testing' has no attribute {name!r}")
