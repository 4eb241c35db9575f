"""One job at a time on a background thread: the durable writers' (replicated and sharded) way to write.

The thread is made at the first job and lives until :meth:`OneJob.stop`. A caller hands a job over only
after the previous one ended (:meth:`OneJob.wait`), so a job is never queued behind another and never
dropped. A runner records its own errors; one it lets escape is logged, and the thread goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from elastic_train.log import get_logger

log = get_logger(__name__)

J = TypeVar("J")

#: Seconds between ``beat`` calls while :meth:`OneJob.wait` waits for the job in flight.
BEAT_WHILE_WAITING = 0.25


class OneJob(Generic[J]):
    """Run each submitted job with ``run`` on the thread ``name``, at most one in flight."""

    def __init__(self, run: Callable[[J], None], name: str) -> None:
        self._run = run
        self._name = name
        self._cond = threading.Condition()
        #: The job in flight, boxed (a job may be any value, None included); None once it ended.
        self._job: tuple[J] | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A job is in flight."""
        return self._job is not None

    def submit(self, job: J) -> None:
        """Start ``job`` in the background (the previous one has ended: the caller waited for it)."""
        with self._cond:
            assert self._job is None, "a job is in flight: wait() first"
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._job = (job,)
            self._cond.notify_all()

    def wait(self, beat: Callable[[], None]) -> None:
        """Block until no job is in flight, calling ``beat`` every :data:`BEAT_WHILE_WAITING` seconds (the
        waiter still makes progress: it waits for its own job, not for a peer)."""
        with self._cond:
            while self._job is not None:
                if not self._cond.wait(timeout=BEAT_WHILE_WAITING):
                    beat()

    def stop(self, timeout: float | None) -> bool:
        """End the thread once the job in flight (if any) has ended, waiting up to ``timeout`` seconds;
        whether it ended."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stop:
                    self._cond.wait()
                if self._job is None:
                    return
                (job,) = self._job
            try:
                self._run(job)
            except Exception as exc:
                log.error("background_job_failed", thread=self._name, error=repr(exc))
            finally:
                with self._cond:
                    self._job = None
                    self._cond.notify_all()
