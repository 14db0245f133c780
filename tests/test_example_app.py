"""examples/serving_app.py driven through httpx's ASGI transport: 200 concurrent requests, no leak.

httpx's ``ASGITransport`` does not run the ASGI lifespan, so each test enters
the app's lifespan itself (``app.router.lifespan_context``), in the test's
task, as a server would around its requests. Requests refused with 503 (no
room now) are sent again in the next round, all concurrently, until every
request has its 200: each round completes at least one (the first admitted
holds its reservation), so the loop ends.
"""

from __future__ import annotations

from collections import Counter

import anyio
import httpx
import pytest

from akv import KVCacheConfig
from examples import serving_app
from examples.serving_app import create_app, next_token

pytestmark = pytest.mark.anyio

NUM_REQUESTS = 200
MAX_NEW = 12


def body(i: int) -> dict:
    """Request ``i``: a prefix shared by every request (prefix-cache hits) and a tail of its own."""
    return {"prompt": [7, 8, 9, 10, 11, 12, 13, 14, *range(100 + i, 100 + i + 1 + i % 8)], "max_new_tokens": MAX_NEW}


def expected(prompt: list[int]) -> list[int]:
    history = list(prompt)
    for _ in range(MAX_NEW):
        history.append(next_token(history))
    return history[len(prompt) :]


async def serve_all(client: httpx.AsyncClient, url: str) -> Counter:
    """Send every request, the refused ones again each round; return the status codes seen."""
    pending, seen = set(range(NUM_REQUESTS)), Counter()
    for _ in range(NUM_REQUESTS):  # a bound, never reached: each round completes at least one request
        responses: dict[int, httpx.Response] = {}

        async def send(i: int, responses: dict[int, httpx.Response] = responses) -> None:
            responses[i] = await client.post(url, json=body(i))

        async with anyio.create_task_group() as tg:
            for i in sorted(pending):
                tg.start_soon(send, i)
        for i, response in responses.items():
            seen[response.status_code] += 1
            if response.status_code == 200:
                assert response.json()["tokens"] == expected(body(i)["prompt"]), f"request {i}"
                pending.discard(i)
        if not pending:
            return seen
    raise AssertionError(f"{len(pending)} requests never served")


def small_pool() -> KVCacheConfig:
    # 320 blocks of 4 tokens: about 50 requests (5-7 blocks each) fit at once.
    return KVCacheConfig(num_blocks=320, block_size=4, vocab_size=serving_app.VOCAB_SIZE, debug_invariants=True)


@pytest.mark.parametrize("url", ["/generate", "/generate?reserve=0"])
async def test_200_concurrent_requests_leave_no_block_behind(url, monkeypatch) -> None:
    monkeypatch.setattr(serving_app, "WAIT_S", 0.2)  # the timeout-then-preempt path, kept short
    app = create_app(small_pool(), log_level=None)
    with anyio.fail_after(300):  # hang guard only
        async with app.router.lifespan_context(app):
            kv = app.state.kv
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://akv.test") as client:
                seen = await serve_all(client, url)
            assert set(seen) <= {200, 503}, seen  # never a 500: decode did not fail half-way
            assert seen[200] == NUM_REQUESTS
            stats = await kv.stats()
            assert (stats.active, stats.reserved_blocks, stats.num_sequences) == (0, 0, 0)
            assert stats.cached_tokens > 0  # the shared prefix was served from the cache
            await kv.check()


async def test_bad_requests_get_400_and_change_nothing() -> None:
    app = create_app(small_pool(), log_level=None)
    with anyio.fail_after(60):  # hang guard only
        async with app.router.lifespan_context(app):
            kv = app.state.kv
            before = await kv.stats()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://akv.test") as client:
                for payload in (
                    b"not json",
                    b'{"prompt": "abc"}',
                    b'{"prompt": [1, -5]}',
                    b'{"prompt": [], "max_new_tokens": 4}',
                    b'{"prompt": [1, 2], "max_new_tokens": true}',
                    b'{"prompt": [1, 2], "max_new_tokens": 4096}',  # more blocks than the pool: RequestTooLarge
                ):
                    response = await client.post("/generate", content=payload)
                    assert response.status_code == 400, (payload, response.text)
                    assert response.json()["error"]
            after = await kv.stats()
            assert (after.free, after.active, after.num_sequences) == (before.free, before.active, 0)
            await kv.check()
