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

Who a sender says it is is proven too: every envelope carries a token (`TokenBook`)
derived from the secret and the identity it claims, a rank's from its rank, the
launcher processes' (system sampler, relay, launcher) from their role.  The secret
stays with the launcher, its collector and relays: a worker gets the session's
client key pair (to connect; the secret cannot be computed from it) and, from its
launcher's key service (`traceml.launcher.rank_keys`), the token of its own rank
alone, so a rank (or its children) can speak only as itself.

The secret: the user's (an environment variable or a 0600 file: see
`traceml.environment`); else, on one node, a random one per run.  Several nodes
without one refuse to start: no key is derived from the session id alone.

The processes that hold it (the launcher, the collector, a relay) make themselves
unreadable to their own user (`forbid_inspection`): the ranks run as that user, and
would otherwise read the secret in the launcher's ``/proc/<pid>/environ`` (the
environment it started with, whatever it removed since) or its memory.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import hmac
import secrets
import sys
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


def capture_keys(keys: CurveKeys, capture_secret: str) -> CurveKeys:
    """The client key pair of ``traceml capture`` for a run's collector: from a secret
    the launcher writes to the session folder (owner only); what arrives with it the
    collector takes as a capture request and nothing else."""
    client_secret = bytes(z85.encode(hashlib.sha256(
        f"traceml/capture/{capture_secret}".encode()).digest()))
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


def client_keys_text(keys: CurveKeys) -> str:
    """The server's public key and a client key pair, as one printable value (z85,
    ``,``-separated: z85 has no comma): what a worker needs to connect, with no secret of the session."""
    return ",".join(k.decode("ascii") for k in (keys.server_public, keys.client_public,
                                                 keys.client_secret))


def client_keys_from(text: str) -> CurveKeys:
    """What `client_keys_text` wrote; ValueError when it is not three z85 keys."""
    parts = text.split(",")
    if len(parts) != 3 or not all(len(p) == 40 for p in parts):
        raise ValueError("not a server key and a client key pair")
    server, public, secret = (p.encode("ascii") for p in parts)
    return CurveKeys(server, b"", public, secret)


TOKEN_CHARS = 43  # 256 bits, URL-safe base64 without padding
NODE_ROLES = frozenset({"system", "launcher", "watch", "relay"})


class TokenBook:
    """The token each identity carries (launcher, collector and relays: they hold the
    session secret).  A rank's token proves its rank; the node roles share one, which
    only a launcher process can compute."""

    def __init__(self, secret: str, session_id: str) -> None:
        self._key = f"traceml/token/{session_id}/{secret}".encode()
        self.node = self._token("node")

    def rank(self, rank: int, restart: int = 0) -> str:
        """The token of a rank in one attempt (torch elastic's restart count); made
        anew each time (about a microsecond), so what senders claim costs no memory."""
        return self._token(f"rank/{rank}/{restart}")

    def of(self, role: str, rank: int | None, restart: int = 0) -> str | None:
        """The token of a sender (None: no identity of a job has this role)."""
        if role == "rank" and rank is not None:
            return self.rank(rank, restart)
        return self.node if role in NODE_ROLES else None

    def _token(self, name: str) -> str:
        digest = hmac.new(self._key, name.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")


PR_SET_DUMPABLE = 4  # linux/prctl.h


def forbid_inspection() -> bool:
    """Make this process unreadable to other processes of its user (Linux: not
    dumpable, so ``/proc/<pid>/environ``, ``mem`` and ptrace need root); the programs
    it starts are readable again once they exec.  Whether it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # no prctl to call: nothing is changed
        return False


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
