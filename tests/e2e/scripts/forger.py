"""The child of a rank that tries to speak as rank 0: ``forger.py RANK0_PID TOKEN``.

It has what any child of a rank has: the worker's environment (the collector's address,
the session's client keys, the key service's socket) and, here, the token its parent
holds.  It asks the key service for a token of its own, then sends rank 0's identity
(its host and pid, sequence numbers past the real rank's) with forged steps: with its
parent's token, and without one.  It writes what it got and sent."""

import json
import os
import socket
import sys
import time

import zmq

from traceml.agent.runtime import ask_token
from traceml.security import client_keys_from, secure_client
from traceml.wire import events as ev
from traceml.wire.envelope import Envelope, encode
from traceml.wire.identity import Sender

rank0_pid, parent_token = int(sys.argv[1]), sys.argv[2] or None
asked = ask_token(os.environ["TRACEML_KEY_SOCKET"])
context = zmq.Context()
sock = context.socket(zmq.PUSH)
secure_client(sock, client_keys_from(os.environ["TRACEML_CLIENT_KEYS"]))
sock.connect(os.environ["TRACEML_ENDPOINT"])
rank0 = Sender("rank", socket.gethostname(), rank0_pid, 0, rank=0, local_rank=0, world_size=2)
times: list[list[float]] = [[] for _ in range(ev.NUM_EVENT_CODES)]
now = time.perf_counter()
for i in range(50):  # 50 whole steps, 1 ms each, long after the real rank's
    t = now + 1000.0 + i * 0.001
    for code, dt in ((ev.FORWARD, 0.0), (ev.END, 0.0003), (ev.OPTIMIZER, 0.0005),
                     (ev.OPTIMIZER_END, 0.0009)):
        times[code].append(t + dt)
sent = 0
for seq, token in ((10**6, parent_token), (10**6 + 1, None), (10**6 + 2, "x" * 43)):
    batch = ev.EventBatch(10**6 + seq, time.time() - time.perf_counter(), times)
    sock.send(encode(Envelope(os.environ["TRACEML_SESSION_ID"], rank0, seq, time.time(), batch,
                              token=token)))
    sent += 1
sock.close(linger=5000)  # every message out before it exits
context.term()
with open(os.path.join(os.environ["EVIDENCE_DIR"], "forger.json"), "w") as f:
    json.dump({"asked": asked, "sent": sent, "had_parent_token": parent_token is not None}, f)
