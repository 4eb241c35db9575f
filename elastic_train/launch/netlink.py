"""A node's own loopback link to etcd that can go silent: the etcd-only partition of ``elastic-train local``.

Each node of a job with a ``partition-etcd`` fault in its plan reaches every etcd member through a
:class:`SilentLink` of its own. :meth:`SilentLink.silence` holds every byte in both directions and every new
connection without a reset — what a dropped route or a firewall that discards packets looks like to TCP: the
node's etcd calls time out, its peers' do not, and its workers' gloo traffic (not through the link) goes on.
:meth:`SilentLink.heal` delivers what was held, in order, as TCP would after retransmitting.
"""

from __future__ import annotations

import asyncio
import contextlib

from elastic_train.launch.loopthread import LoopThread


class SilentLink:
    """Forward ``127.0.0.1:<port>`` to ``target``; see the module docstring.

    Args:
        target: ``HOST:PORT`` to forward to (a loopback etcd member).
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.port = 0
        self._open: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._thread = LoopThread(f"etcd link to {target}", self._listen, self._close)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> SilentLink:
        """Listen on a free loopback port (:attr:`endpoint`).

        Raises:
            RuntimeError: the link could not listen.
        """
        self._thread.start()
        return self

    def silence(self) -> None:
        """Hold all traffic from now on (no reset) until :meth:`heal`."""
        if self._open is not None:
            self._thread.call(self._open.clear)

    def heal(self) -> None:
        if self._open is not None:
            self._thread.call(self._open.set)

    def stop(self) -> None:
        self._thread.stop()

    # -- asyncio -------------------------------------------------------------------------------------------

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _listen(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await self._open.wait()
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                writer.transport.abort()  # the member is down: a reset, as without the link
                return
            try:
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
            finally:
                for w in (writer, up_writer):
                    w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        while True:
            data = await reader.read(65536)
            if not data:
                return
            await self._open.wait()
            writer.write(data)
            await writer.drain()
