"""A loopback TCP proxy that delays each direction by a fixed time: a slow network for tests and benchmarks.

Each chunk read from one side is written to the other ``delay`` seconds after it arrived, in order, so a
request/answer exchange takes two delays more than it would (a round trip of ``2 * delay``); bandwidth is not
limited. :meth:`LatencyProxy.set_delay` changes the delay of later chunks; :meth:`LatencyProxy.cut` closes
every connection and refuses new ones (a partition that resets), :meth:`LatencyProxy.silence` holds every
byte and every new connection without a word (a partition that drops packets: no RST, the peers' TCP just
waits), :meth:`LatencyProxy.heal` ends either (held bytes are then delivered, as TCP retransmits them).

In a test (the proxy runs on an asyncio loop in a daemon thread)::

    with LatencyProxy("127.0.0.1", etcd_port, delay=0.1) as proxy:
        connect(proxy.endpoint)

As a process (benchmarks; prints ``ready HOST:PORT`` once listening, stops on SIGTERM)::

    python tests/netproxy.py --target 127.0.0.1:2379 --delay-ms 50 [--listen-port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
import threading

from elastic_train.launch.loopthread import LoopThread


class LatencyProxy:
    """Forward ``listen_host:listen_port`` to ``target_host:target_port``, delaying each direction.

    Args:
        target_host: where connections go.
        target_port: where connections go.
        delay: seconds each chunk is held, per direction (one-way delay).
        listen_host: loopback address to listen on.
        listen_port: port to listen on (0: a free one; see :attr:`port`).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        delay: float = 0.0,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.target = (target_host, target_port)
        self.delay = delay
        self.listen_host = listen_host
        self.port = listen_port
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._thread = LoopThread("latency-proxy", self.listen, self._shutdown)
        self._writers: set[asyncio.StreamWriter] = set()
        self._cut = False
        self._open: asyncio.Event | None = None  # cleared while silent

    @property
    def endpoint(self) -> str:
        return f"{self.listen_host}:{self.port}"

    # -- life cycle (thread) ------------------------------------------------------------------------------

    def start(self) -> LatencyProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._thread.stop()

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_delay(self, delay: float) -> None:
        """Delay chunks that arrive from now on by ``delay`` seconds each way."""
        self.delay = delay

    def cut(self) -> None:
        """Close every open connection and refuse new ones until :meth:`heal`."""
        self._cut = True
        self._thread.call(self._close_all)

    def silence(self) -> None:
        """Hold every byte in both directions and every new connection until :meth:`heal` (no reset)."""
        assert self._open is not None, "silence() before start()"
        self._thread.call(self._open.clear)

    def heal(self) -> None:
        self._cut = False
        if self._open is not None:
            self._thread.call(self._open.set)

    # -- asyncio -------------------------------------------------------------------------------------------

    async def listen(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_all()

    def _close_all(self) -> None:
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A cancelled handler (shutdown) ends quietly: asyncio's stream callback would log the cancellation.
        with contextlib.suppress(asyncio.CancelledError):
            await self._forward(reader, writer)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        assert self._open is not None
        await self._open.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()  # the target is down: the client sees a reset, as with no proxy
            return
        self.connections += 1
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._writers.add(w)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                with contextlib.suppress(Exception):
                    w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        gate = self._open
        assert gate is not None

        async def send() -> None:
            loop = asyncio.get_running_loop()
            while True:
                due, data = await queue.get()
                if not data:
                    with contextlib.suppress(OSError, RuntimeError):
                        writer.write_eof()
                    return
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await gate.wait()
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await reader.read(65536)
                queue.put_nowait((loop.time() + self.delay, data))
                if not data:
                    break
            await sender
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if not sender.done():
                sender.cancel()
            # One side gone: end the other too (a proxy does not keep half-dead connections).
            with contextlib.suppress(Exception):
                writer.transport.abort()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    p.add_argument("--listen-host", default="127.0.0.1")
    p.add_argument("--listen-port", type=int, default=0)
    args = p.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    proxy = LatencyProxy(
        host,
        int(port),
        delay=args.delay_ms / 1000,
        listen_host=args.listen_host,
        listen_port=args.listen_port,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with proxy:
        print(f"ready {proxy.endpoint}", flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
