"""The deployment's ZMQ event broker: Dynamo's event plane on loopback.

What it is for: in its default ("direct") mode every Dynamo event publisher
(each worker's KV events and load metrics, the frontend's router sync) binds a
ZMQ PUB socket on `tcp://0.0.0.0:<random>`, hard-coded in Dynamo 1.6.1
(`lib/runtime/src/transports/event_plane/mod.rs`, `EventPublisher::new_internal`).
With `DYN_ZMQ_BROKER_URL="xsub=<A> , xpub=<B>"` Dynamo's broker mode makes every
publisher *connect* to `A` and every subscriber to `B` instead, so no process of
the deployment binds an event socket itself. This module is that broker: a ZMQ
XSUB socket bound on `A`, an XPUB socket bound on `B`, and `zmq.proxy` between
them (Dynamo's events pass through unchanged: the broker never decodes them).

`python -m trtllm_mtp_carry.serve.dynamo.event_broker --xsub tcp://127.0.0.1:A --xpub tcp://127.0.0.1:B`
runs until SIGTERM or SIGINT, then closes both sockets and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def broker_url(connect_host: str, xsub_port: int, xpub_port: int) -> str:
    """`DYN_ZMQ_BROKER_URL` for a broker reachable at `connect_host` (Dynamo's format:
    `xsub=<urls> , xpub=<urls>`)."""
    return f"xsub=tcp://{connect_host}:{xsub_port} , xpub=tcp://{connect_host}:{xpub_port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trtllm_mtp_carry.serve.dynamo.event_broker",
                                description="XSUB/XPUB relay for Dynamo's ZMQ event plane (broker mode)")
    p.add_argument("--xsub", required=True, help="where publishers connect, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--xpub", required=True, help="where subscribers connect, e.g. tcp://127.0.0.1:5556")
    args = p.parse_args(argv)

    import zmq

    ctx = zmq.Context()
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    for sock in (xsub, xpub):
        sock.setsockopt(zmq.LINGER, 0)
    xsub.bind(args.xsub)
    xpub.bind(args.xpub)
    stopping = threading.Event()

    def stop(*_: object) -> None:
        stopping.set()
        ctx.term()  # unblocks zmq.proxy with ETERM

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=stop, daemon=True).start())
    print(f"event broker: publishers -> {args.xsub}, subscribers -> {args.xpub}", flush=True)
    try:
        zmq.proxy(xsub, xpub)
    except zmq.ContextTerminated:
        pass
    except zmq.ZMQError as exc:
        if not stopping.is_set():
            print(f"event broker failed: {exc}", file=sys.stderr, flush=True)
            return 1
    finally:
        xsub.close(0)
        xpub.close(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
