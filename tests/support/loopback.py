"""One HTTP client for the tests' requests to the servers they start on loopback.

``httpx.get`` and its siblings build a client per call, and with it an SSL context that
loads the CA bundle: 50-80 ms on the loaded 2-core machine, where the plain-HTTP request
itself takes about 5 ms, and the suite's waits, ledgers and scrapes make thousands of them.
This client is built once. It keeps no connection between requests, so a server a test
kills and restarts on the same port never meets a stale one, and it sets no limit on
connections, as a client per call did not; the timeout is httpx's 5 s unless a call says.
"""

from __future__ import annotations

import httpx

CLIENT = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
                      timeout=5)

get = CLIENT.get
post = CLIENT.post
stream = CLIENT.stream
request = CLIENT.request
