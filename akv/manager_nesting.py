"""Which managers a task has entered, so that leaving them out of order is a typed error.

anyio task groups must be left in the reverse order of entering them in one
task; a manager owns one, so leaving an outer manager while an inner one is
still open would break the inner task group. :func:`entered` records a
manager when its ``async with`` starts; :func:`check_exit_order` refuses to
leave one while a later one of the same task is still open.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Any

from akv.errors import WrongExitOrder

#: Managers entered in this task (its context), oldest first.
_ENTERED: ContextVar[tuple[weakref.ref, ...]] = ContextVar("akv_entered_managers", default=())


def entered(manager: Any) -> None:
    """Record that ``manager`` was entered in the current task (after the ones still open)."""
    _ENTERED.set((*(r for r in _ENTERED.get() if _is_open(r())), weakref.ref(manager)))


def check_exit_order(manager: Any) -> None:
    """Forget ``manager`` as entered in this task, unless a later one is still open.

    Raises:
        WrongExitOrder: A manager entered after ``manager`` in this task is
            still open (their task groups nest inside ``manager``'s).
    """
    entered_now = [r() for r in _ENTERED.get()]
    mine = next((i for i, m in enumerate(entered_now) if m is manager), None)
    later = [] if mine is None else [m for m in entered_now[mine + 1 :] if _is_open(m)]
    if later:
        raise WrongExitOrder(
            f"leave KVCacheManagers in the reverse order of entering them: {len(later)} manager(s) "
            "entered after this one in this task are still open (their task groups nest inside this "
            "one's). Its actors are stopped now; leave it again after those to end its task group"
        )
    _ENTERED.set(tuple(r for r in _ENTERED.get() if r() is not manager))


def _is_open(manager: Any) -> bool:
    """Whether ``manager`` (a dereferenced entry) is alive and not yet left."""
    return manager is not None and manager._tg is not None
