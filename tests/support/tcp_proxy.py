"""A loopback TCP proxy whose connections can be made to go silent (a blackhole).

``TcpProxy(target_host, target_port)`` listens on 127.0.0.1 (``.port``) and forwards each
accepted connection to the target, one thread per direction. ``blackhole(client_port)``
makes the proxy stop forwarding the *server's answers* on the connection whose client
end is ``client_port``: what the client sends still reaches the server (so a statement in
flight runs and commits), but the answer is read and dropped, and the connection stays
open. To the client that is a dead network path behind a live TCP peer: the kernel sees
nothing wrong (the proxy acknowledges every byte), only a client-side bound can end the
wait. ``swallowed`` is set once answer bytes were dropped (the server has answered).

``close()`` closes the listener and every connection (which also frees a client stuck
on a blackholed one).
"""

from __future__ import annotations

import socket
import threading


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.client_port = client.getpeername()[1]
        self.blackholed = False
        self.swallowed = threading.Event()


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target_host``:``target_port`` (tests only)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._start(self._accept_loop, "tcp-proxy-accept")

    def _start(self, target: object, name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            pair = _Pair(client, server)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._pairs.append(pair)
            self._start(self._pump, "tcp-proxy-up", pair, client, server, False)
            self._start(self._pump, "tcp-proxy-down", pair, server, client, True)

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if answers and pair.blackholed:
                    pair.swallowed.set()
                    continue  # read and dropped: the client never hears back
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def blackhole(self, client_port: int) -> threading.Event:
        """Drops, from now on, the server's answers on the connection whose client end is
        ``client_port``; returns the event set once answer bytes were dropped."""
        with self._lock:
            for pair in self._pairs:
                if pair.client_port == client_port:
                    pair.blackholed = True
                    return pair.swallowed
        raise LookupError(f"no proxied connection from client port {client_port}")

    def connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs, self._pairs = self._pairs, []
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (Linux)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        for pair in pairs:
            for s in (pair.client, pair.server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
