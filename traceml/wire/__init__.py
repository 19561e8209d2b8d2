"""The wire between senders (agents, system samplers, the launcher, relays) and the
collector: versioned envelopes encoded with orjson, each carrying one typed message
(shared: the agent, the launcher and the collector import it; so it imports only the
standard library, orjson and the small shared tables).

One module per message kind builds, encodes, decodes and checks its record, shape and
values together, so that what a decode returns is what the collector may store:

- ``identity``: who sends (`Sender`) and the bounds of a job's numbers;
- ``checks``: the value checks every kind shares (finite numbers, times, printable text);
- ``events``: a rank's step events (`EventBatch`) and their codes;
- ``rows``: process and system samples, columnar (`ProcessRows`, `SystemRows`);
- ``records``: the launcher's control records (`RunStart`, `RunEnd`, `StopCollector`)
  and a sender's `Hello` and `Bye`;
- ``incidents``: a rank's stall or crash (`IncidentReport`);
- ``relay``: a node's relay batch to node 0 (`RelayBatch`);
- ``envelope``: the `Envelope`, the closed union of messages (`Message`), `encode` and
  `decode`.
"""
