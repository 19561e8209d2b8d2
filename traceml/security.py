"""Who may talk to the collector: ZeroMQ CURVE keys derived from a session
secret (shared by the agent, the launcher and the collector).

When the collector listens beyond 127.0.0.1 (several nodes), every socket
speaks CURVE.  The server and client key pairs are derived from the session
secret, so only a process that knows the secret can complete the handshake,
and the collector's authenticator admits only the derived client key.  The
secret is the user's (an environment variable or a 0600 file: see
`traceml.environment`); without one, it is derived from the session id, so
knowing the session id is what admits a sender.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def needs_auth(bind_host: str) -> bool:
    """Listening anywhere but 127.0.0.1 means strangers could reach the port."""
    return bind_host not in LOOPBACK_HOSTS


def derive_keys(secret: str, session_id: str) -> CurveKeys:
    def secret_key(role: str) -> bytes:
        digest = hashlib.sha256(f"traceml/{role}/{session_id}/{secret}".encode()).digest()
        return bytes(z85.encode(digest))

    server_secret, client_secret = secret_key("server"), secret_key("client")
    return CurveKeys(zmq.curve_public(server_secret), server_secret,
                     zmq.curve_public(client_secret), client_secret)


def session_keys(secure: bool, secret: str | None, session_id: str) -> CurveKeys | None:
    """The session's keys when it is secured, else None."""
    if not secure:
        return None
    return derive_keys(secret if secret else session_id, session_id)


def secure_client(sock: Any, keys: CurveKeys) -> None:
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def secure_server(context: Any, sock: Any, keys: CurveKeys) -> Any:
    """Make ``sock`` a CURVE server that admits only this session's client key.

    Returns the running authenticator; stop it when the socket closes.
    """
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowKey(keys.client_public))
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret
    return auth


class _AllowKey:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return bool(z85.encode(key) == self.key or key == self.key)
