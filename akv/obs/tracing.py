"""OpenTelemetry tracing helpers (opentelemetry-api only; the application picks the SDK).

akv starts spans for the manager's public operations (``akv.add_sequence``,
``akv.append``, ``akv.commit``, ``akv.fork``, ``akv.free``, all wrapping
``akv.step``), for the work the pool shards do for a step (``akv.shard_step``,
with ``akv.copy_blocks`` when copy-on-write copies are submitted) and for each
eviction-loop batch (``akv.evict_batch``).

Actors run in their own tasks, where the caller's context variables are not
visible, so the caller's context travels in the message
(:meth:`AkvTracer.context`) and the actor starts its span in it: one request's
spans form one tree.

Without a configured provider a span costs about half a microsecond;
attributes are only computed when the span is recording.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

#: Instrumentation scope name of every akv span.
TRACER_NAME = "akv"

_NO_SPAN = nullcontext(trace.INVALID_SPAN)  # reusable: yields a span that records nothing


class AkvTracer:
    """akv's tracer, with a fast path while no tracer provider is configured.

    The API's no-op ``start_as_current_span`` still attaches and detaches a
    context (about 13 us here); when no provider is given and the global one
    is still the API's default proxy (no SDK set up), :meth:`span` returns a
    shared null context instead (about half a microsecond).

    Args:
        tracer_provider: Provider of akv's spans; None: the global one, as set
            when this tracer is created (the manager creates its tracer when
            it is entered, so set the global provider before that).
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        #: Whether spans go to a configured provider.
        self.enabled = tracer_provider is not None or not isinstance(
            trace.get_tracer_provider(), trace.ProxyTracerProvider
        )
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)

    def span(self, name: str, *, context: Any = None, attributes: dict | None = None) -> AbstractContextManager:
        """Start span ``name`` as the current span (child of ``context`` if given, else of the current one).

        Returns:
            A context manager yielding the span; check ``span.is_recording()``
            before computing attributes.
        """
        if not self.enabled:
            return _NO_SPAN
        return self._tracer.start_as_current_span(name, context=context, attributes=attributes)

    def context(self) -> Any:
        """The caller's context to carry in an actor message (None while tracing is off)."""
        return otel_context.get_current() if self.enabled else None
