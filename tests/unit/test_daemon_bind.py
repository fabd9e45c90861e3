"""The daemons' listening sockets: every accepted connection sends without Nagle's delay.

uvicorn answers in two writes (the head, then the body). Without TCP_NODELAY
the body waits for the client's ACK of the head, which Linux delays by up to
40 ms: every answer of a daemon took 40 ms more than its work. asyncio sets
TCP_NODELAY on the connections of a listening socket made with proto
IPPROTO_TCP only; ``socket.socket(family, SOCK_STREAM)`` has proto 0.
"""

from __future__ import annotations

import asyncio
import socket

from kvx.daemon.run import _bind


def test_connections_accepted_on_a_daemon_socket_have_tcp_nodelay() -> None:
    async def run() -> int:
        sock = _bind("127.0.0.1", 0, "api_port")
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            port = sock.getsockname()[1]
            _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(run()) != 0
