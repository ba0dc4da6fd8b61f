"""A real MLflow tracking server (`mlflow server`, the full mlflow package's) on a free loopback port, with a SQLite
store and served artifacts in a directory of its own; and a relay in front of a server that can delay each request
or stop answering, as a slow or vanished tracking server does (tests/test_trainer.py, bench/tracking.py)."""

from __future__ import annotations

import selectors
import socket
import sys
import threading
import time
from pathlib import Path

from tests.servers import ServerProcess


class MlflowServer(ServerProcess):
    name = "MLflow test server"
    ready_path = "/health"

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        # No job runner (mlflow 3's server starts one with a pool of huey consumers, for its GenAI jobs): nothing
        # here uses it, and it would take the tests' CPUs and start-up time (mlflow/server/__init__.py, _run_server).
        super().__init__(directory / "server.log", {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, cwd=directory)
        self.directory = directory

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.directory / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.directory / "artifacts"),
        ]


class Relay:
    """A TCP relay on a free loopback port to `target_port`: the server's answer to each request reaches the client
    `delay_s` after the request's first bytes (a server that takes that long to answer, however the client splits
    its request), and `stop` closes the port and every connection (connections refused from then on: the server is
    gone). A side that closes its end closes the other's, as a direct connection would."""

    def __init__(self, target_port: int, delay_s: float = 0.0):
        self.target_port, self.delay_s = target_port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server), name="relay", daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        asked_at: float | None = None  # when the request now waiting for its answer began
        with selectors.DefaultSelector() as selector:
            selector.register(client, selectors.EVENT_READ, server)
            selector.register(server, selectors.EVENT_READ, client)
            try:
                while not self._stopped.is_set():
                    for key, _ in selector.select(timeout=0.2):
                        data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                        if not data:
                            return
                        if key.fileobj is client and asked_at is None:
                            asked_at = time.monotonic()
                        elif key.fileobj is server and asked_at is not None:
                            time.sleep(max(asked_at + self.delay_s - time.monotonic(), 0.0))
                            asked_at = None
                        key.data.sendall(data)
            except OSError:
                return
            finally:
                for end in (client, server):
                    end.close()

    def stop(self) -> None:
        self._stopped.set()
        self.listener.close()
        for s in self._sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
