"""moto's standalone S3 server, started on a free loopback port in a process of its own; with ``record``, every
request it answers is written to that file as a JSON line (method, path, query, the signing access key id, the
status, and for DeleteObjects the keys it names), for tests/test_iam.py to replay against a policy.

Run as ``python -m tests.s3_server PORT RECORD`` for the recording server: moto's own WSGI application (what
``python -m moto.server`` serves) behind a middleware of ours."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

from tests.servers import ServerProcess


class S3Server(ServerProcess):
    name = "S3 test server"
    ready_path = "/moto-api/"

    def __init__(self, log_file: Path, env: dict[str, str] | None = None, record: Path | None = None):
        super().__init__(log_file, env)
        self.record = record
        self.endpoint = self.url

    def command(self) -> list[str]:
        if self.record is not None:
            self.record.write_text("")
            return [sys.executable, "-m", "tests.s3_server", str(self.port), str(self.record)]
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def recorded(self) -> list[dict[str, Any]]:
        assert self.record is not None, "started without record"
        return [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]


_CREDENTIAL = re.compile(r"Credential=([^/]+)/")


def _recording(app: Any, record: Path) -> Any:
    """The WSGI application ``app``, each request appended to ``record`` once answered."""
    lock = threading.Lock()

    def serve(environ: dict[str, Any], start_response: Any) -> Any:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        query = environ.get("QUERY_STRING", "")
        keys: list[str] = []
        if environ["REQUEST_METHOD"] == "POST" and "delete" in query.split("&") and length:
            body = environ["wsgi.input"].read(length)  # DeleteObjects: the keys it names, for s3:DeleteObject each
            keys = [k.decode() for k in re.findall(rb"<Key>(.*?)</Key>", body)]
            environ["wsgi.input"] = io.BytesIO(body)
        found = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
        status: list[str] = []

        def recording_start(code: str, headers: Any, *rest: Any) -> Any:
            status.append(code)
            return start_response(code, headers, *rest)

        response = app(environ, recording_start)
        line = {
            "method": environ["REQUEST_METHOD"],
            "path": environ.get("PATH_INFO", ""),
            "query": query,
            "key_id": found.group(1) if found else "",
            "status": int(status[0].split()[0]) if status else 0,
            "delete_keys": keys,
        }
        with lock, open(record, "a") as f:
            f.write(json.dumps(line) + "\n")
        return response

    return serve


def main(port: int, record: Path) -> None:
    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple("127.0.0.1", port, _recording(app, record), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
