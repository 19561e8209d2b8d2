"""Who may talk to the collector: ZeroMQ CURVE keys derived from a session
secret (shared by the agent, the launcher and the collector).

Every socket of the collector speaks CURVE, on one node as on many.  The
server and client key pairs are derived from the session secret, so only a
process that knows the secret can complete the handshake, and the collector's
authenticator admits only the derived client key, plus the launcher's own key
(derived from a second secret that only the launcher and its collector know:
control messages are accepted from that key alone), plus the key of the
nodes' relays (derived from the session secret under another name: a relay's
batches are accepted from that key alone).

The secret: the user's (an environment variable or a 0600 file: see
`traceml.environment`); else, on one node, a random one per run, handed to the
local workers in their environment (never on a command line); else (several
nodes and no user secret) it is derived from the session id, so knowing the
session id admits a sender, and the launcher says so when it starts.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, replace
from typing import Any

import zmq
from zmq.utils import z85


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def derive_keys(secret: str, session_id: str) -> CurveKeys:
    def secret_key(role: str) -> bytes:
        digest = hashlib.sha256(f"traceml/{role}/{session_id}/{secret}".encode()).digest()
        return bytes(z85.encode(digest))

    server_secret, client_secret = secret_key("server"), secret_key("client")
    return CurveKeys(zmq.curve_public(server_secret), server_secret,
                     zmq.curve_public(client_secret), client_secret)


def new_secret() -> str:
    """A random secret for one run (256 bits)."""
    return secrets.token_urlsafe(32)


def launcher_keys(keys: CurveKeys, launcher_secret: str) -> CurveKeys:
    """The launcher's client key pair for the same server: only the launcher and
    its collector know ``launcher_secret``."""
    client_secret = bytes(z85.encode(hashlib.sha256(
        f"traceml/launcher/{launcher_secret}".encode()).digest()))
    return replace(keys, client_public=zmq.curve_public(client_secret),
                   client_secret=client_secret)


def relay_keys(keys: CurveKeys, secret: str | None, session_id: str) -> CurveKeys:
    """A node's relay's client key pair for node 0's collector, from the session secret
    (what a relay forwards, node 0 accepts from this key alone)."""
    client_secret = bytes(z85.encode(hashlib.sha256(
        f"traceml/relay/{session_id}/{secret or session_id}".encode()).digest()))
    return replace(keys, client_public=zmq.curve_public(client_secret),
                   client_secret=client_secret)


def session_keys(secret: str | None, session_id: str) -> CurveKeys:
    """The session's keys: every collector socket speaks CURVE."""
    return derive_keys(secret if secret else session_id, session_id)


def secure_client(sock: Any, keys: CurveKeys) -> None:
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def start_authenticator(context: Any, *client_publics: bytes) -> Any:
    """An authenticator for ``context`` that admits only these client keys (z85).

    A message's ``User-Id`` property is then the z85 public key of its sender.
    Stop it when the sockets close.
    """
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowKeys(client_publics))
    return auth


def secure_server(sock: Any, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE server (its context needs `start_authenticator`)."""
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret


class _AllowKeys:
    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys
