"""The actor runtime: a bounded inbox, ``ask``, one message at a time, on anyio's public API only.

An :class:`Actor` owns its state exclusively. Its handler is a plain ``def``
(``async def`` is refused when the class is defined): a message is served
from start to end with no other task running, so the state needs no lock.
What an actor guarantees:

- **One message at a time, FIFO.** An ask is *sent* when it enters the inbox
  or, on the direct path, when it is served; messages are served in the order
  they were sent (so one task's asks in the order it made them).
- **Direct hand-off.** While :attr:`~Actor.can_serve_now` (no earlier message
  waits), ``ask`` does one ``anyio.lowlevel.checkpoint`` (other tasks run),
  then runs the handler on the asking task, in its context (contextvars,
  spans), with no task switch. Otherwise the message is queued (also before
  :meth:`~Actor.run` starts) for the actor's task.
- **An ask never hangs.** It returns the result or raises the handler's
  :class:`~akv.errors.AkvError` (that ask alone fails: handlers validate
  first); :class:`~akv.errors.ActorCrashed` if the handler raised anything
  else (that ask, every queued and every later one; ``on_crash`` runs, and
  akv's manager stops the other actors with it); or the stop error:
  :class:`~akv.errors.ManagerClosed` after :meth:`~Actor.close` (which serves
  the queued messages first) or once ``run`` ended (e.g. cancelled), the
  given error after :meth:`~Actor.stop` (which fails the queued ones at once).
- **Cancellation.** Before the message is sent (the first checkpoint, a wait
  for room in a full inbox) nothing is sent. While an unshielded ask waits for
  a queued message: an unserved message is withdrawn from the inbox, never to
  be served; a served one's result goes to ``on_reply``; then the cancellation
  propagates. ``shield=True`` shields that wait: the message is served,
  ``on_reply`` gets its result, then the cancellation is re-raised. A direct
  serve has no await after it. So a cancelled ask was not applied, or was
  applied and ``on_reply`` saw its result.

Ask graphs must stay acyclic (two actors asking each other deadlock); akv's
is drawn in docs/architecture.md. Modelled on Pykka; runs on asyncio, uvloop
and trio.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import structlog

from akv.errors import ActorCrashed, AkvError, ManagerClosed


class _Reply:
    """One-shot reply slot of a queued ask: a value or an error, then the event is set."""

    __slots__ = ("error", "event", "value")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        """Deliver ``value`` or ``error`` and wake the asker."""
        self.value, self.error = value, error
        self.event.set()


class Actor:
    """Base class of akv's actors: subclasses implement :meth:`handle` (synchronous).

    The inbox is a ``collections.deque`` bounded by ``inbox_capacity``; events wake the
    actor's task, the senders waiting for room, and each queued ask.

    Args:
        name: Name used in logs, metrics and errors.
        inbox_capacity: Bound of the inbox (messages); senders wait when it is full.
        logger: structlog logger to bind ``actor=name`` on (default ``structlog.get_logger("akv")``).
        direct: Serve an ask on the asking task when the actor is idle (:attr:`can_serve_now`).

    Attributes:
        direct: As the argument; may be changed at any time.
        on_crash: ``callable(actor, error)``, run after a crash stopped this actor.
        max_inbox_depth: Highest number of messages seen waiting in the inbox.
        messages_handled: Messages whose handler ran, by either path.
        messages_direct: Of those, messages served on the asking task.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if inspect.iscoroutinefunction(cls.__dict__.get("handle")):
            raise TypeError(f"{cls.__name__}.handle must be a plain def: actor handlers never await")

    def __init__(self, name: str, inbox_capacity: int, logger: Any = None, *, direct: bool = True) -> None:
        self.name, self.inbox_capacity, self.direct = name, inbox_capacity, direct
        self.on_crash: Callable[[Actor, BaseException], object] | None = None
        self.log = (logger or structlog.get_logger("akv")).bind(actor=name)
        self.max_inbox_depth = self.messages_handled = self.messages_direct = 0
        self._inbox: deque[tuple[Any, _Reply]] = deque()
        self._wake: anyio.Event | None = None  # the actor's task sleeps on it while the inbox is empty
        self._room: anyio.Event | None = None  # senders sleep on it while the inbox is full
        self._running = self._closed = False
        self._stop_error: BaseException | None = None  # set whenever _closed is

    @property
    def inbox_depth(self) -> int:
        """Messages waiting in the inbox now."""
        return len(self._inbox)

    @property
    def can_serve_now(self) -> bool:
        """Whether a message given now would be served at once on the calling task (:meth:`serve`)."""
        return self.direct and self._running and not self._closed and not self._inbox

    def serve(self, msg: Any) -> Any:
        """Serve ``msg`` now on the calling task, without a checkpoint; the actor must :attr:`can_serve_now`.

        Synchronous: serving several idle actors in a row runs no other task in between.

        Returns:
            The handler's result.

        Raises:
            AkvError: The handler's typed error (the actor goes on).
            ActorCrashed: The handler raised anything else (the actor is stopped, ``on_crash`` has run).
            RuntimeError: Not :attr:`can_serve_now` (a caller's bug: use :meth:`ask`).
        """
        if not self.can_serve_now:
            raise RuntimeError(f"actor {self.name!r} cannot serve on the caller's task now; ask() instead")
        self.messages_direct += 1
        return self._serve(msg)

    async def ask(self, msg: Any, *, shield: bool = False, on_reply: Callable[[Any], object] | None = None) -> Any:
        """Send ``msg`` and return the handler's result (see the module docstring for the guarantees).

        Args:
            msg: The message.
            shield: Once the message is queued, wait for its reply even if the
                caller is cancelled, then re-raise the cancellation.
            on_reply: ``callable(result)``, called on the asking task once a
                served message's result is known, before a cancellation
                propagates; not called on an error. It must not raise.

        Returns:
            The handler's result.

        Raises:
            AkvError: The handler's typed error.
            ActorCrashed: This actor crashed (now or earlier).
            ManagerClosed: The actor is closed (or the stop error given to :meth:`stop`).
        """
        if self.can_serve_now:
            await anyio.lowlevel.checkpoint()  # lets other tasks run; a cancellation here sent nothing
            if self.can_serve_now:
                self.messages_direct += 1
                result = self._serve(msg)
                if on_reply is not None:
                    on_reply(result)
                return result  # no await between serving and returning
        else:
            await anyio.lowlevel.checkpoint_if_cancelled()  # the wait for the reply yields
        reply = await self._enqueue(msg)
        try:
            if shield:
                with anyio.CancelScope(shield=True):
                    await reply.event.wait()
            else:
                await reply.event.wait()
        finally:  # also when the wait is cancelled
            if not reply.event.is_set():
                self._withdraw(reply)  # not served: never will be
            elif reply.error is None and on_reply is not None:
                on_reply(reply.value)
        if reply.error is not None:
            raise reply.error
        if shield:
            await anyio.lowlevel.checkpoint_if_cancelled()
        return reply.value

    async def _enqueue(self, msg: Any) -> _Reply:
        """Append ``msg`` to the inbox (waiting for room) and wake the actor's task; raise the stop error if closed."""
        while not self._closed and len(self._inbox) >= self.inbox_capacity:
            if self._room is None:
                self._room = anyio.Event()
            await self._room.wait()
        if self._closed:
            raise self._stop_error.with_traceback(None)
        reply = _Reply()
        self._inbox.append((msg, reply))
        self.max_inbox_depth = max(self.max_inbox_depth, len(self._inbox))
        if self._wake is not None:
            self._wake.set()
        return reply

    def _withdraw(self, reply: _Reply) -> None:
        """Remove the unserved message of ``reply`` from the inbox (its asker was cancelled). O(inbox depth)."""
        for i, (_msg, queued) in enumerate(self._inbox):
            if queued is reply:
                del self._inbox[i]
                self._wake_senders()
                return

    def close(self) -> None:
        """Orderly stop: accept no new message, serve the queued ones, then let :meth:`run` return."""
        if self._stop_error is None:
            self._stop_error = ManagerClosed(f"actor {self.name!r} is closed")
        self._shut()

    def stop(self, error: BaseException) -> None:
        """Abort: fail every queued and later ask with ``error`` at once and end :meth:`run`.

        Args:
            error: The stop error; the first one given is kept (it replaces a :meth:`close`'s ``ManagerClosed``).
        """
        if self._stop_error is None or isinstance(self._stop_error, ManagerClosed):
            self._stop_error = error
        self._fail_queued()
        self._shut()

    def _shut(self) -> None:
        """Refuse new messages and wake the actor's task and every sender waiting for room."""
        self._closed = True
        self._wake_senders()
        if self._wake is not None:
            self._wake.set()

    def _wake_senders(self) -> None:
        if self._room is not None:
            self._room.set()
            self._room = None

    def _fail_queued(self) -> None:
        while self._inbox:
            _msg, reply = self._inbox.popleft()
            reply.settle(error=self._stop_error)

    async def run(self) -> None:
        """Serve queued messages until closed (after draining) or stopped; run it in the owner's task group."""
        self._running = True
        inbox = self._inbox
        try:
            while inbox or not self._closed:
                if not inbox:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    self._wake = None
                    continue
                msg, reply = inbox.popleft()
                self._wake_senders()
                try:
                    reply.settle(self._serve(msg))
                except AkvError as exc:  # the handler's typed error, or this actor's ActorCrashed
                    reply.settle(error=exc)
                except BaseException:  # an interrupt out of the handler: the actor is stopped
                    reply.settle(error=self._stop_error)
                    raise
        finally:
            if self._stop_error is None:  # ended without close or stop (e.g. cancelled)
                self._stop_error = ManagerClosed(f"actor {self.name!r} is stopped")
            self._running, self._closed = False, True
            self._fail_queued()
            self._wake_senders()

    def _serve(self, msg: Any) -> Any:
        """Run the handler on ``msg``, on whichever task calls it (the actor's or an asker's).

        Raises:
            AkvError: The handler's typed error (the actor goes on).
            ActorCrashed: The handler raised another ``Exception`` (the actor is stopped, ``on_crash`` has run).
            BaseException: Anything else (e.g. ``KeyboardInterrupt``), as is, after the same stop.
        """
        self.messages_handled += 1
        try:
            return self.handle(msg)
        except AkvError:
            raise
        except BaseException as exc:
            err = ActorCrashed(self.name, exc)
            err.__cause__ = exc
            self.log.error("actor.crashed", error=repr(exc), exc_info=exc)
            self.stop(err)
            if self.on_crash is not None:
                self.on_crash(self, err)
            if isinstance(exc, Exception):
                raise err from exc
            raise

    def handle(self, msg: Any) -> Any:  # pragma: no cover - abstract
        """Serve one message and return the reply value; synchronous (never awaits).

        Raises:
            AkvError: Bad input, with the actor's state unchanged.
        """
        raise NotImplementedError
