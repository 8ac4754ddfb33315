"""A TCP relay for tests of a server that fails mid-call: cut, or slow to answer."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttingRelay:
    """A TCP relay to a real server that can cut every connection, at once or after the
    client sent ``cut_after`` more bytes (a network failure in the middle of a batch), and
    hold the server's replies back while ``replies`` is clear (a server that is slow, not
    down)."""

    def __init__(self, upstream: tuple[str, int] = ("127.0.0.1", 5672)):
        self.upstream = upstream
        self.replies = threading.Event()  # set: the server's bytes flow to the client
        self.replies.set()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.cut_after: int | None = None
        self.sent = 0
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            with self._lock:
                self._socks += [client, up]
            threading.Thread(target=self._pump, args=(client, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(65536):
                while not upstream and not self.replies.wait(0.05):
                    pass
                dst.sendall(data)
                if upstream:
                    with self._lock:
                        self.sent += len(data)
                        cut = self.cut_after is not None and self.sent >= self.cut_after
                    if cut:
                        self.cut()
                        return
        except OSError:
            pass

    def cut_in(self, nbytes: int) -> None:
        with self._lock:
            self.cut_after = self.sent + nbytes

    def cut(self, *, listener: bool = False) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        if listener:
            socks.append(self.listener)  # shutdown wakes the thread blocked in accept()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
