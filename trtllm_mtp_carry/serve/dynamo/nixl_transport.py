"""A carried entry's bytes from one worker's host memory to another's, in one NVIDIA NIXL read.

What it is for: the holder of an entry `expose`s its byte range (registers it with
its NIXL agent) and hands the `Offer` (its agent's metadata, the range's address
and length) to the worker that wants it over Dynamo's request plane; that worker
`read`s the range into its own landing range with ONE descriptor (one per row
costs 20-40x, measured with NIXL 1.5.1), then the holder `withdraw`s it. NIXL's UCX backend
moves the bytes: shared memory between workers of one host, TCP between hosts.

Sockets (`ucx_environment`, applied before the agent exists): on a loopback
`--host` UCX runs on shared memory alone (`UCX_TLS=sm,self`, with the POSIX/SysV
error handling UCX needs to report a dead peer), so the agent opens no socket at
all; another address confines UCX to that address's interface
(`UCX_NET_DEVICES`); a wildcard host leaves UCX its defaults (every interface).
UCX settings already in the environment win.

Invariants:
- The agent is created once per worker (about 0.5 s), with no progress thread and
  no listener thread: an idle agent costs no CPU (a progress thread spins a core).
  Its peers' reads of an exposed range need its UCX worker progressed, so while
  any range is exposed `pump()` must be called every few milliseconds (the owner's
  event loop does it); a reader progresses its own side while it polls.
- A read either completes whole, or raises `TransferError` with a reason before its
  deadline: `holder_gone` (the holder's agent disconnected or the transfer failed) or
  `timeout` (the transfer is released, which aborts it); it never hangs.
- All calls on one agent come from one thread (the worker's event loop): the agent is
  made without NIXL's thread-safe mode.
- Importing this module loads neither NIXL nor torch (`nixl` is the package's `nixl` extra).
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import ipaddress
import os
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NIXL_HINT = 'pip install -e ".[nixl]" (nixl==1.5.1)'

UCX_SHARED_MEMORY = {"UCX_TLS": "sm,self", "UCX_POSIX_ERROR_HANDLING": "on",
                     "UCX_SYSV_ERROR_HANDLING": "on"}
"""UCX on shared memory alone (no socket); UCX refuses to create such an agent without the error
handling that reports a dead peer (checked with NIXL 1.5.1, UCX 1.23)."""

REMOTE_AGENTS = 32
"""Peers' agents kept loaded at once (least recently read from forgotten first)."""

_POLL_FIRST_S, _POLL_MAX_S = 0.0002, 0.005


class NixlMissing(RuntimeError):
    """NIXL is not installed; the message names the extra."""


class TransferError(RuntimeError):
    """A read that did not complete; `reason` is `holder_gone` or `timeout`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 `address` (None: no interface holds it)."""
    want = socket.inet_aton(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:
                continue
            if got == want:
                return name
    return None


def ucx_environment(host: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The UCX variables a worker whose sockets bind `host` sets before its agent exists (see the
    module header); empty when the environment already sets any `UCX_TLS`/`UCX_NET_DEVICES`, or
    for a wildcard host. ValueError names a host no local interface holds."""
    env = os.environ if environ is None else environ
    if "UCX_TLS" in env or "UCX_NET_DEVICES" in env or host in ("", "0.0.0.0"):
        return {}
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"transfer host {host!r} does not resolve: {exc}") from None
    if ipaddress.ip_address(address).is_loopback:
        return dict(UCX_SHARED_MEMORY)
    device = interface_of(address)
    if device is None:
        raise ValueError(f"no local interface holds transfer host {host!r} ({address})")
    return {"UCX_NET_DEVICES": device}


@dataclass(frozen=True)
class Offer:
    """An exposed range as a peer reads it: the holder's agent `agent`, its metadata (base64, the
    range's registration included), and the range `[addr, addr + nbytes)` in its host memory."""

    agent: str
    metadata: str
    addr: int
    nbytes: int

    def as_dict(self) -> dict[str, Any]:
        return {"agent": self.agent, "metadata": self.metadata, "addr": self.addr, "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Offer:
        """The offer a peer sent; ValueError naming what is missing or malformed."""
        try:
            offer = cls(str(d["agent"]), str(d["metadata"]), int(d["addr"]), int(d["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed offer {dict(d)!r}: {exc}") from None
        if offer.addr <= 0 or offer.nbytes <= 0:
            raise ValueError(f"malformed offer range {offer.addr:#x} + {offer.nbytes}")
        return offer


class NixlTransport:
    """One worker's NIXL agent: expose ranges to peers, read theirs (see the module header)."""

    def __init__(self, name: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise NixlMissing(f"NVIDIA NIXL is not installed ({exc}): {NIXL_HINT}") from None
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self.agent = nixl_agent(name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL agent {name!r} has no UCX backend (plugins: {self.agent.get_plugin_list()})")
        self.name = name
        self._exposed: dict[int, tuple[Any, Any]] = {}  # addr -> (tensor, its registration)
        self._remotes: OrderedDict[str, None] = OrderedDict()  # peers' agents loaded, LRU

    @property
    def exposed(self) -> int:
        """Ranges exposed now (while non-zero, `pump()` must run)."""
        return len(self._exposed)

    def expose(self, raw: Any) -> Offer:
        """Register `raw` (1-D uint8 CPU tensor, contiguous) for peers to read; its offer."""
        if raw.dtype.itemsize != 1 or raw.dim() != 1 or not raw.is_contiguous() or raw.device.type != "cpu":
            raise ValueError(f"an exposed range is a contiguous 1-D uint8 CPU tensor, got {raw.dtype} "
                             f"{tuple(raw.shape)} on {raw.device}")
        descs = self.agent.register_memory(raw)
        metadata = self.agent.get_partial_agent_metadata(descs, inc_conn_info=True)
        self._exposed[raw.data_ptr()] = (raw, descs)
        return Offer(self.name, base64.b64encode(metadata).decode(), raw.data_ptr(), raw.numel())

    def withdraw(self, offer: Offer) -> None:
        """Deregister an exposed range (a no-op for one already withdrawn)."""
        held = self._exposed.pop(offer.addr, None)
        if held is not None:
            self.agent.deregister_memory(held[1])

    def pump(self) -> None:
        """Progress this agent's UCX worker once (peers' reads of exposed ranges need it)."""
        self.agent.get_new_notifs()

    async def read(self, offer: Offer, dst: Any, deadline: float) -> float:
        """Read `offer`'s range into `dst` (1-D uint8 CPU tensor of `offer.nbytes`) with one
        descriptor, by `deadline` (`time.monotonic()`); returns the wall seconds the transfer took.
        TransferError(`holder_gone` | `timeout`) otherwise (see the invariants)."""
        if dst.numel() != offer.nbytes or not dst.is_contiguous():
            raise ValueError(f"landing range of {dst.numel()} bytes for an offer of {offer.nbytes}")
        agent = self.agent
        try:
            remote = agent.add_remote_agent(base64.b64decode(offer.metadata))
        except Exception as exc:  # a malformed or foreign metadata blob
            raise TransferError("holder_gone", f"the holder's agent cannot be loaded: {exc}") from None
        remote = remote.decode() if isinstance(remote, bytes) else str(remote)
        self._remember(remote)
        descs = agent.register_memory(dst)
        handle = None
        t0 = time.perf_counter()
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(dst),
                                           agent.get_xfer_descs([(offer.addr, offer.nbytes, 0)], "DRAM"),
                                           remote)
            state = agent.transfer(handle)
            wait = _POLL_FIRST_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError("timeout", f"{offer.nbytes} bytes from {remote} not read in time")
                await asyncio.sleep(wait)
                wait = min(wait * 2, _POLL_MAX_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError("holder_gone", f"the read from {remote} failed ({state})")
            return time.perf_counter() - t0
        except TransferError:
            self._forget(remote)
            raise
        except Exception as exc:  # NIXL's own errors: a disconnected or unknown remote agent
            self._forget(remote)
            raise TransferError("holder_gone", f"{type(exc).__name__}: {exc}") from None
        finally:
            if handle is not None:
                try:
                    handle.release()  # aborts a transfer still in progress
                except Exception:  # an errored transfer refuses release: NIXL frees it with the agent
                    pass
            agent.deregister_memory(descs)

    def close(self) -> None:
        """Withdraw every range and forget every peer's agent."""
        for _raw, descs in list(self._exposed.values()):
            self.agent.deregister_memory(descs)
        self._exposed.clear()
        for name in list(self._remotes):
            self._forget(name)

    def _remember(self, remote: str) -> None:
        self._remotes[remote] = None
        self._remotes.move_to_end(remote)
        while len(self._remotes) > REMOTE_AGENTS:
            self._forget(next(iter(self._remotes)))

    def _forget(self, remote: str) -> None:
        if self._remotes.pop(remote, 0) is None:
            try:
                self.agent.remove_remote_agent(remote)
            except Exception:  # already gone
                pass
