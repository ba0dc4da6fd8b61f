"""A real MLflow tracking server (`mlflow server`, the full mlflow package's) on a free loopback port, with a SQLite
store and served artifacts in a directory of its own; and a relay in front of a server that can delay each request
or stop answering, as a slow or vanished tracking server does (tests/test_trainer.py, bench/tracking.py)."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tests.s3_server import free_port


class MlflowServer:
    def __init__(self, directory: Path):
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> MlflowServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._log = open(self.directory / "server.log", "w")
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--workers", "1", "--backend-store-uri", f"sqlite:///{self.directory / 'mlflow.db'}",
                   "--artifacts-destination", str(self.directory / "artifacts")]  # fmt: skip
        # No job runner (mlflow 3's server starts one with a pool of huey consumers, for its GenAI jobs): nothing
        # here uses it, and it would take the tests' CPUs and start-up time (mlflow/server/__init__.py, _run_server).
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.directory,
                                        env=env, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).close()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    log = (self.directory / "server.log").read_text()[-2000:]
                    raise RuntimeError(f"the MLflow test server did not start: {log}") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


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
