"""A local HTTP server on 127.0.0.1 serving media the way real hosts misbehave, for the remote
media tests: a good image, oversize bodies (declared and not), slow and trickling answers,
redirects inside and outside the allow-list, a redirect loop, HTML, a 404, and a route that
counts how many requests are in flight at once, and media whose Content-Type does not match
their bytes."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BIG = 300_000
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"


class MediaServer:
    """``with MediaServer(png, clip) as s:`` serves on ``s.port``; `hosts` lists the Host header
    of every request, `max_active` the most ``/count`` requests seen in flight at once."""

    def __init__(self, image: bytes, video: bytes = b"") -> None:
        self.image, self.video = image, video
        self.hosts: list[str] = []
        self.active = self.max_active = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", ctype: str | None = None,
                      headers: dict | None = None, length: bool = True) -> None:
                self.send_response(status)
                if ctype:
                    self.send_header("Content-Type", ctype)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with owner.lock:
                    owner.hosts.append(self.headers.get("Host", ""))
                path, port = self.path, owner.port
                if path == "/img.png":
                    self._send(200, owner.image, "image/png")
                elif path == "/clip.mp4":
                    self._send(200, owner.video, "video/mp4")
                elif path == "/eps.png":  # PostScript labelled as a PNG
                    self._send(200, EPS, "image/png")
                elif path == "/clip.webm":  # an mp4 labelled as webm
                    self._send(200, owner.video, "video/webm")
                elif path == "/img.mp4":  # an image labelled as a video
                    self._send(200, owner.image, "video/mp4")
                elif path == "/octet":
                    self._send(200, owner.image, "application/octet-stream")
                elif path == "/big.png":  # declared too large
                    self._send(200, b"\0" * BIG, "image/png")
                elif path == "/stream-big.png":  # no length: read until the connection closes
                    self._send(200, b"", "image/png", length=False)
                    for _ in range(BIG // 10_000):
                        self.wfile.write(b"\0" * 10_000)
                elif path == "/slow.png":  # nothing for a long while
                    owner.stop.wait(5)
                    self._send(200, owner.image, "image/png")
                elif path == "/trickle.png":  # a byte at a time, never silent for long
                    self._send(200, b"", "image/png", length=False)
                    for _ in range(60):
                        if owner.stop.wait(0.1):
                            break
                        self.wfile.write(b"\0")
                        self.wfile.flush()
                elif path == "/redirect-in":
                    self._send(302, headers={"Location": "/img.png"})
                elif path == "/redirect-out":
                    self._send(302, headers={"Location": f"http://127.0.0.1:{port}/img.png"})
                elif path == "/loop":
                    self._send(302, headers={"Location": "/loop"})
                elif path == "/page.html":
                    self._send(200, b"<html></html>", "text/html; charset=utf-8")
                elif path.startswith("/count"):
                    with owner.lock:
                        owner.active += 1
                        owner.max_active = max(owner.max_active, owner.active)
                    time.sleep(0.3)
                    with owner.lock:
                        owner.active -= 1
                    self._send(200, owner.image, "image/png")
                else:
                    self._send(404, b"no", "text/plain")

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # a client that gave up (timeouts, size limits) is the point of the tests

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> MediaServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def tls_files(tmp_path, name: str = "localhost") -> tuple[str, str, str]:
    """(CA cert, server cert, server key) PEM paths: a throwaway CA and a leaf for `name`
    only (no IP in its names), made with `cryptography`."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "media test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(1)
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = [str(tmp_path / f) for f in ("ca.pem", "cert.pem", "key.pem")]
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(pem))
    (tmp_path / "cert.pem").write_bytes(leaf.public_bytes(pem))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths[0], paths[1], paths[2]


def serve_tls(server: MediaServer, cert: str, key: str) -> MediaServer:
    """Wrap `server`'s socket in TLS with `cert` (before it starts)."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.httpd.socket = ctx.wrap_socket(server.httpd.socket, server_side=True)
    return server
