"""One side of a NIXL transfer in its own process, for tests/dynamo/test_nixl_transport.py.

    python nixl_peer.py hold N [HOST]   exposes N ranges of 1 MiB (a pattern per range), prints one
                                        JSON line {"offers": [...], "digests": [...]}, then pumps its
                                        agent until stdin closes
    python nixl_peer.py read HOST       reads one JSON line {"offer": ..., "deadline_s": ...} on stdin,
                                        prints {"result": "read" | reason, "ms": ..., "digest": ...}

HOST is the worker's transfer host (`ucx_environment`: loopback keeps UCX on shared memory).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import torch

from trtllm_mtp_carry.serve.dynamo.nixl_transport import (
    NixlTransport,
    Offer,
    TransferError,
    ucx_environment,
)
from trtllm_mtp_carry.service.moves import digest_bytes

NBYTES = 1 << 20


def hold(count: int, host: str) -> None:
    os.environ.update(ucx_environment(host))
    transport = NixlTransport(f"holder-{os.getpid()}")
    ranges = [(torch.arange(NBYTES, dtype=torch.int64) * (i + 3) % 251).to(torch.uint8) for i in range(count)]
    offers = [transport.expose(r).as_dict() for r in ranges]
    print(json.dumps({"offers": offers, "digests": [digest_bytes(r) for r in ranges]}), flush=True)
    os.set_blocking(sys.stdin.fileno(), False)
    while True:
        transport.pump()
        try:
            if sys.stdin.read() == "":
                break
        except TypeError:  # nothing to read yet
            pass
        time.sleep(0.002)


def read(host: str) -> None:
    os.environ.update(ucx_environment(host))
    transport = NixlTransport(f"reader-{os.getpid()}")
    job = json.loads(sys.stdin.readline())
    landing = torch.empty(job["offer"]["nbytes"], dtype=torch.uint8)
    t0 = time.monotonic()
    try:
        asyncio.run(transport.read(Offer.from_dict(job["offer"]), landing, t0 + job["deadline_s"]))
        result = "read"
    except TransferError as exc:
        result = exc.reason
    print(json.dumps({"result": result, "ms": (time.monotonic() - t0) * 1e3, "digest": digest_bytes(landing)}),
          flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1")
    else:
        read(sys.argv[2])
