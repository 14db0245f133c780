"""A small actor runtime on anyio: bounded inbox, ask, one message at a time.

Each actor owns its state exclusively and serves messages from a bounded
memory-object stream, one at a time, so its state needs no lock. ``ask`` sends
a message and waits for the reply; the reply never hangs:

- a handler that raises an :class:`~akv.errors.AkvError` fails only that ask
  (the handler validated before changing anything, so the actor goes on);
- a handler that raises anything else crashes the actor: that ask and every
  queued or later ask fail with :class:`~akv.errors.ActorCrashed`, and the
  ``on_crash`` callback (the manager) stops every other actor the same way;
- an actor stopped while messages wait fails them with the stop error
  (:class:`~akv.errors.ManagerClosed` on an orderly close).

Ask graphs must stay acyclic (two actors asking each other deadlock); the
graph akv uses is drawn in docs/architecture.md.

Modelled on Pykka (asks fail back to the asker; queued asks fail on stop) and
anyio memory object streams (bounded, closable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import structlog

from akv.errors import ActorCrashed, AkvError, ManagerClosed


class Reply:
    """One-shot reply slot of an ask."""

    __slots__ = ("_error", "_event", "_value")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any) -> None:
        """Deliver the result (ignored if already settled)."""
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def fail(self, error: BaseException) -> None:
        """Deliver an error (ignored if already settled)."""
        if not self._event.is_set():
            self._error = error
            self._event.set()

    @property
    def settled(self) -> bool:
        """Whether a result or an error was delivered."""
        return self._event.is_set()

    async def wait(self) -> Any:
        """Wait for the result; re-raise a delivered error."""
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Actor:
    """Base class: subclasses implement :meth:`handle`.

    Args:
        name: Name used in logs, metrics and errors.
        inbox_capacity: Bound of the inbox (messages); senders wait when full.
        logger: structlog logger to bind ``actor=name`` on.
    """

    def __init__(self, name: str, inbox_capacity: int, logger: Any = None) -> None:
        self.name = name
        self._send, self._recv = anyio.create_memory_object_stream[tuple[Any, Reply]](inbox_capacity)
        self._stop_error: BaseException | None = None
        self._scope: anyio.CancelScope | None = None
        self._current: Reply | None = None
        self.on_crash: Callable[[Actor, BaseException], None] | None = None
        self.log = (logger or structlog.get_logger("akv")).bind(actor=name)
        #: Highest number of messages seen waiting in the inbox.
        self.max_inbox_depth = 0
        self.messages_handled = 0

    # ------------------------------------------------------------- callers
    @property
    def inbox_depth(self) -> int:
        """Messages waiting in the inbox now."""
        return self._send.statistics().current_buffer_used

    async def ask(self, msg: Any) -> Any:
        """Send ``msg`` and wait for the handler's result.

        Raises:
            AkvError: Whatever typed error the handler raised.
            ActorCrashed: The actor (or another) crashed.
            ManagerClosed: The actor is stopped or stopping.
        """
        if self._stop_error is not None:
            raise self._stop_error
        reply = Reply()
        try:
            await self._send.send((msg, reply))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self._stop_error or ManagerClosed(f"actor {self.name!r} is stopped") from None
        depth = self._send.statistics().current_buffer_used
        if depth > self.max_inbox_depth:
            self.max_inbox_depth = depth
        return await reply.wait()

    def close(self) -> None:
        """Orderly stop: accept no more messages, finish the queued ones, then exit."""
        if self._stop_error is None:
            self._stop_error = ManagerClosed(f"actor {self.name!r} is closed")
        self._send.close()

    def stop(self, error: BaseException) -> None:
        """Abort: fail the running and queued asks with ``error`` and exit now."""
        if self._stop_error is None or isinstance(self._stop_error, ManagerClosed):
            self._stop_error = error
        self._send.close()
        if self._current is not None:
            self._current.fail(error)
        if self._scope is not None:
            self._scope.cancel()

    # ------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Serve messages until closed or stopped. Run it in the manager's task group."""
        with anyio.CancelScope() as scope:
            self._scope = scope
            try:
                async for msg, reply in self._recv:
                    self._current = reply
                    try:
                        result = await self.handle(msg)
                    except AkvError as exc:
                        reply.fail(exc)
                    except Exception as exc:
                        err = ActorCrashed(self.name, exc)
                        err.__cause__ = exc
                        reply.fail(err)
                        self.log.error("actor.crashed", error=repr(exc), exc_info=exc)
                        self.stop(err)
                        if self.on_crash is not None:
                            self.on_crash(self, err)
                        return
                    else:
                        reply.set(result)
                    finally:
                        self._current = None
                    self.messages_handled += 1
            finally:
                self._fail_pending()

    def _fail_pending(self) -> None:
        error = self._stop_error or ManagerClosed(f"actor {self.name!r} stopped")
        if self._current is not None:
            self._current.fail(error)
            self._current = None
        while True:
            try:
                _msg, reply = self._recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                break
            reply.fail(error)
        self._recv.close()

    async def handle(self, msg: Any) -> Any:  # pragma: no cover - abstract
        """Serve one message; return the reply value."""
        raise NotImplementedError
