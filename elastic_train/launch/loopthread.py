"""An asyncio loop in a daemon thread, for blocking code that owns a small asyncio server.

The loopback links of ``elastic-train local`` (:mod:`elastic_train.launch.netlink`) and the tests' latency
proxy run their sockets on such a loop while the code that starts them stays synchronous: start, steer with
:meth:`LoopThread.call`, stop. One place owns the start-up hand-shake (a set-up error is raised to the caller
of :meth:`LoopThread.start`, not lost in the thread) and the shut-down (every task cancelled and awaited, so
none is destroyed pending).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any


class LoopThread:
    """Run ``setup`` on a fresh event loop in a daemon thread, then the loop until :meth:`stop`.

    Args:
        name: the thread's name (also in the start-up error).
        setup: coroutine function run first (e.g. binding a server); :meth:`start` returns once it is done.
        teardown: coroutine function run after :meth:`stop`, before the remaining tasks are cancelled.
    """

    def __init__(
        self,
        name: str,
        setup: Callable[[], Awaitable[None]],
        teardown: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self._setup, self._teardown = setup, teardown
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        """Start the thread and wait until ``setup`` finished.

        Raises:
            RuntimeError: ``setup`` failed (the cause is chained) or did not finish within ``timeout``.
        """
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"{self.name} did not start: {self._error!r}") from self._error

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon (thread-safe); nothing before :meth:`start` or once closed."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop, run ``teardown``, cancel what is left and wait up to ``timeout`` for the thread."""
        self.call(self._stop_loop)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def _stop_loop(self) -> None:
        assert self._loop is not None
        self._loop.stop()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._setup())
        except BaseException as exc:  # raised again by start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        try:
            if self._teardown is not None:
                loop.run_until_complete(self._teardown())
        finally:
            loop.run_until_complete(_cancel_all())
            loop.close()


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
