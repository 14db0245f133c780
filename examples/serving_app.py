"""A serving stack's glue around akv: a Starlette app whose lifespan owns the KV cache manager.

Run it (``pip install -e '.[examples]'``)::

    uvicorn examples.serving_app:app --port 8000
    curl -s localhost:8000/generate -d '{"prompt": [1, 2, 3], "max_new_tokens": 8}'

Two ways a request's decode never fails half-way with ``PoolExhausted``:

- ``POST /generate`` reserves room for the whole output at admission
  (``add_sequence(..., max_new_tokens=N)``): decode cannot run out; when the
  room is not there the admission is refused and the client gets 503.
- ``POST /generate?reserve=0`` admits the prompt only; when an append finds
  no room it waits for some (``wait_for_room``) for at most ``WAIT_S``
  seconds, then gives its blocks back and answers 503 (timeout, then
  preempt: waiting while holding blocks forever could starve the pool).

Either way the sequence is freed in ``finally``, so a cancelled or failed
request leaks no block. The "model" is a stand-in that picks each next token
from the history; a real one would compute the prompt and each new token
through ``step.slot_mapping`` / ``step.block_tables`` into ``kv.storage``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import akv.obs
from akv import KVCacheConfig, KVCacheManager
from akv.errors import InvalidInput, PoolExhausted

#: Longest wait for room before a request without a reservation gives up (seconds).
WAIT_S = 1.0
VOCAB_SIZE = 1000


def next_token(history: list[int]) -> int:
    """The stand-in model: a token id in ``[0, VOCAB_SIZE)`` determined by the history."""
    return (history[-1] * 31 + len(history)) % VOCAB_SIZE


async def generate(request: Request) -> JSONResponse:
    """Admit, decode ``max_new_tokens`` tokens and free: the whole per-request glue."""
    kv: KVCacheManager = request.app.state.kv
    prompt, max_new, reserve = await _parse(request)
    seq_id = next(request.app.state.seq_ids)
    cached = await kv.add_sequence(seq_id, prompt, max_new_tokens=max_new if reserve else None)
    try:
        await kv.commit(seq_id, len(prompt) - cached)  # the model computed the prompt
        history = list(prompt)
        for _ in range(max_new):
            token = next_token(history)
            try:
                step = await kv.append(seq_id, token)  # within a reservation: never PoolExhausted
            except PoolExhausted:
                await kv.wait_for_room(seq_id, 1, timeout_s=WAIT_S)  # PoolExhausted on timeout: 503
                step = await kv.append(seq_id, token)
            await step.copies.wait()  # copy-on-write copies before the model writes
            await kv.commit(seq_id, 1)
            history.append(token)
        return JSONResponse({"tokens": history[len(prompt) :], "cached_tokens": cached})
    finally:
        await kv.free(seq_id)


async def _parse(request: Request) -> tuple[list[int], int, bool]:
    """``(prompt, max_new_tokens, reserve)`` from a JSON body and the ``reserve`` query flag.

    Raises:
        InvalidInput: Not a JSON object with a ``prompt`` list and an int ``max_new_tokens``.
    """
    try:
        body = await request.json()
    except ValueError:
        raise InvalidInput("the body must be JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), list):
        raise InvalidInput('the body must be an object with a "prompt" list of token ids')
    max_new = body.get("max_new_tokens", 16)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or not 0 <= max_new <= 4096:
        raise InvalidInput('"max_new_tokens" must be an int in [0, 4096]')
    return body["prompt"], max_new, request.query_params.get("reserve", "1") != "0"


async def _busy(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=503, headers={"Retry-After": "1"})


async def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=400)


def create_app(config: KVCacheConfig | None = None, *, log_level: str | None = "warning") -> Starlette:
    """The app; its lifespan enters the manager (``app.state.kv``) and exits it at shutdown.

    Args:
        config: The pool (default: 4096 blocks of 16 tokens, tiny model, CPU tensors).
        log_level: Console log level set at startup (``akv.obs.configure_logging``),
            or ``None`` to leave logging as the host configured it.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if log_level is not None:
            akv.obs.configure_logging(level=log_level)
        async with KVCacheManager(config or KVCacheConfig(num_blocks=4096, vocab_size=VOCAB_SIZE)) as kv:
            app.state.kv, app.state.seq_ids = kv, itertools.count()
            yield

    return Starlette(
        routes=[Route("/generate", generate, methods=["POST"])],
        lifespan=lifespan,
        exception_handlers={PoolExhausted: _busy, InvalidInput: _bad_request},
    )


app = create_app()
