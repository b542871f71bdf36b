"""Ending an execution before its time limit, when the controller says so.

The controller stops an execution that would be trained too many versions behind
(``scheduler.max_staleness``). A harness awaits its agent through ``within``: the time limit and
a stop end it alike (the agent is cancelled, its workspace stays as it was), and the run is then
scored on what it left, as a timed-out one is. Nothing else ends an execution early.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


REASON = "stopped by the controller: it would be trained more than max_staleness versions behind"
"""What a stopped execution's ``error`` says."""


class Stopped(Exception):
    """The controller stopped the execution."""


async def within(aw: Awaitable[T], seconds: float, stop: asyncio.Event | None = None) -> T:
    """``aw``'s result if it ends within ``seconds`` and before ``stop`` is set; ``TimeoutError``
    at the limit, ``Stopped`` once stopped (``aw`` cancelled either way)."""
    if stop is None:
        return await asyncio.wait_for(aw, timeout=seconds)
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we are cancelled: so is the agent
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise Stopped() if stop.is_set() else TimeoutError()
