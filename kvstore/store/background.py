"""``BackgroundTasks``: moves the store starts and does not wait for (promotions, write-through)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

__all__ = ["BackgroundTasks"]

logger = logging.getLogger(__name__)


class BackgroundTasks:
    """Tasks running on the store's loop; failures are logged, :meth:`drain` waits for all."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[None]:
        """Run ``coroutine`` in the background (on the running loop)."""
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background move failed", exc_info=task.exception())

    async def drain(self) -> None:
        """Wait until every task, including ones started meanwhile, has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
