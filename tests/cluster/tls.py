"""Keys and certificates for the loopback servers the tests run, and the HTTPS server they share.

The API server calls webhooks and kubelets over HTTPS and checks their certificates: each gets one with an IP SAN of
127.0.0.1 (``../shared/k8s/README.md``, "Admission webhooks"), which is also its own CA. The service-account signing
key is an RSA key pair, as kube-apiserver's ``--service-account-signing-key-file`` takes it.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingCert:
    cert_file: Path
    key_file: Path

    @property
    def pem(self) -> bytes:
        return self.cert_file.read_bytes()


def rsa_key_pair(private_file: Path, public_file: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public_file.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def loopback_cert(directory: Path, name: str) -> ServingCert:
    """A self-signed serving certificate for 127.0.0.1, valid for a day."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    served = ServingCert(directory / f"{name}.crt", directory / f"{name}.key")
    served.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    served.key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return served


class HttpsServer(ThreadingHTTPServer):
    """A threaded HTTPS server on a free loopback port, serving ``handler`` in a daemon thread until :meth:`stop`."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, handler: type[BaseHTTPRequestHandler], cert: ServingCert):
        super().__init__(("127.0.0.1", 0), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert.cert_file, cert.key_file)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.port: int = self.server_address[1]
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True, name=f"https-{self.port}"
        )

    def start(self) -> HttpsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def admission_handler(review: Callable[[dict[str, Any]], dict[str, Any]]) -> type[BaseHTTPRequestHandler]:
    """An admission webhook's endpoint: an AdmissionReview (admission.k8s.io/v1) in, ``review(request)`` as its
    response out."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("webhook: " + format, *args)

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))["request"]
            body = json.dumps(
                {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": review(request)}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler
