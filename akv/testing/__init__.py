"""Test helpers shipped with akv, so applications embedding it can run them too.

:mod:`akv.testing.state_machine` holds a Hypothesis ``RuleBasedStateMachine``
that drives a :class:`~akv.core.shard_state.ShardState` against a plain-Python
model (``ShardStateMachine``; ``PendingCopiesMachine`` keeps copy-on-write
copies pending across steps). :mod:`akv.testing.manager_machine` holds
``ManagerMachine``: the whole :class:`~akv.manager.KVCacheManager` with its
actors and real K/V tensors against the plain model of
:mod:`akv.testing.prefix_model` (its hooks and invariants in
:mod:`akv.testing.manager_checks`, its steps drawn by
:mod:`akv.testing.step_plans`; docs/testing.md: running it against your own
storage). Hypothesis is a development dependency, so it is imported only when
a machine is first used::

    from akv.testing import ManagerMachine, ShardStateMachine, TestShardStateMachine
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "ManagerMachine": "manager_machine",
    "PendingCopiesMachine": "state_machine",
    "ShardStateMachine": "state_machine",
    "TestManagerMachine": "manager_machine",
    "TestPendingCopiesMachine": "state_machine",
    "TestShardStateMachine": "state_machine",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        module = importlib.import_module(f"akv.testing.{_MODULES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'akv.testing' has no attribute {name!r}")
