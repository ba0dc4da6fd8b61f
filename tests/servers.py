"""A real server of the tests' (moto's S3, MLflow's tracking server, TensorBoard) in a process of its own on a free
loopback port: started, waited for until it answers, stopped; its output in a log file."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Subclasses give `name`, `command()` and the `ready_path` that answers once the server serves; `cwd`, where
    it runs (the repository, for `python -m tests...`)."""

    name = "server"
    ready_path = "/"

    def __init__(self, log_file: Path, env: dict[str, str] | None = None, cwd: Path = REPO):
        self.log_file, self.env, self.cwd = log_file, env or {}, cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def __enter__(self) -> ServerProcess:
        self._log = open(self.log_file, "w")
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            env={**os.environ, "PYTHONPATH": path, **self.env},
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.url}{self.ready_path}", timeout=2).close()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"the {self.name} did not start: {self.log_file.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
