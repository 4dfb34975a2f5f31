"""The NIXL transport of carried entries (`serve/dynamo/nixl_transport.py`), real NIXL 1.5.1 over UCX,
holder and reader in separate processes.

Pins: a range is read whole, bit for bit, in one read over shared memory with no socket opened; a
holder that dies after offering its range, or that is stuck (stopped), gives the reader a
`TransferError` before its deadline, never a hang; across two network namespaces on this machine the
same code reads over UCX TCP, confined to the interface of the transfer host.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from dynamo_helpers import netns_unavailable

from trtllm_mtp_carry.serve.dynamo.nixl_transport import (
    UCX_SHARED_MEMORY,
    interface_of,
    ucx_environment,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                reason='NIXL is not installed (pip install -e ".[nixl]")')

PEER = str(Path(__file__).with_name("nixl_peer.py"))


def _json_line(stream) -> dict:  # type: ignore[no-untyped-def]
    for line in stream:  # NIXL logs its INFO lines to stdout too
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("the peer printed no JSON line")


def _holder(count: int) -> tuple[subprocess.Popen[str], dict]:
    holder = subprocess.Popen([sys.executable, PEER, "hold", str(count), "127.0.0.1"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return holder, _json_line(holder.stdout)


@pytest.fixture(scope="module")
def reader():  # type: ignore[no-untyped-def]
    """This process's agent, on shared memory (UCX reads its variables when the agent is made)."""
    from trtllm_mtp_carry.serve.dynamo.nixl_transport import NixlTransport

    with mock.patch.dict(os.environ, ucx_environment("127.0.0.1", {})):  # the agent reads UCX's settings at creation
        transport = NixlTransport(f"test-reader-{os.getpid()}")
    yield transport
    transport.close()


def _read(reader, offer: dict, deadline_s: float) -> dict:  # type: ignore[no-untyped-def]
    import torch

    from trtllm_mtp_carry.serve.dynamo.nixl_transport import Offer, TransferError
    from trtllm_mtp_carry.service.moves import digest_bytes

    landing = torch.empty(offer["nbytes"], dtype=torch.uint8)
    t0 = time.monotonic()
    try:
        asyncio.run(reader.read(Offer.from_dict(offer), landing, t0 + deadline_s))
        result = "read"
    except TransferError as exc:
        result = exc.reason
    return {"result": result, "ms": (time.monotonic() - t0) * 1e3, "digest": digest_bytes(landing)}


def _stop(holder: subprocess.Popen[str]) -> None:
    if holder.poll() is None:
        holder.kill()
    holder.wait(10)


def test_loopback_keeps_ucx_on_shared_memory_and_a_wildcard_or_an_explicit_setting_leaves_it() -> None:
    assert ucx_environment("127.0.0.1", {}) == UCX_SHARED_MEMORY
    assert ucx_environment("localhost", {}) == UCX_SHARED_MEMORY
    assert ucx_environment("0.0.0.0", {}) == {}
    assert ucx_environment("127.0.0.1", {"UCX_TLS": "tcp"}) == {}
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(ValueError, match="no local interface holds transfer host '192.0.2.254'"):
        ucx_environment("192.0.2.254", {})


def test_a_range_is_read_bit_for_bit_and_a_holder_killed_after_offering_fails_the_read_at_once(reader) -> None:
    holder, offered = _holder(2)
    try:
        if shutil.which("ss") is None:  # never a silent pass: the pin needs the sockets listed
            pytest.fail("ss (iproute2) is not installed: the holder's listening sockets cannot be checked")
        with socket.create_server(("127.0.0.1", 0)):  # the control: ss names this process's listener
            listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        assert f"pid={os.getpid()}," in listening, listening
        assert f"pid={holder.pid}," not in listening  # shared memory: the agent opened no socket
        got = _read(reader, offered["offers"][0], 30.0)
        assert (got["result"], got["digest"]) == ("read", offered["digests"][0])
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        t0 = time.monotonic()
        gone = _read(reader, offered["offers"][1], 30.0)
        assert gone["result"] == "holder_gone" and gone["ms"] < 5000, gone
        assert time.monotonic() - t0 < 30.0
    finally:
        _stop(holder)


def test_a_stuck_holder_fails_the_read_at_its_deadline(reader) -> None:
    holder, offered = _holder(1)
    try:
        holder.send_signal(signal.SIGSTOP)  # alive, never progressing: the read waits for it
        stuck = _read(reader, offered["offers"][0], 1.0)
        assert stuck["result"] == "timeout", stuck
        assert stuck["ms"] < 1000 + 500, stuck  # by its deadline (one poll of slack), never a hang
    finally:
        holder.send_signal(signal.SIGCONT)
        _stop(holder)


_NS = r"""
import json, subprocess, sys, time
peer, python = sys.argv[1], sys.argv[2]
def sh(cmd):
    subprocess.run(cmd, shell=True, check=True)
# each namespace mounts its own sysfs: UCX finds network devices under /sys/class/net
sh("mount -t sysfs sysfs /sys && ip link set lo up && ip link add va type veth peer name vb && "
   "ip addr add 10.77.0.1/24 dev va && ip link set va up")
env = {"PATH": "/usr/sbin:/usr/bin:/bin", "PYTHONPATH": sys.argv[3], "UCX_TLS": "tcp", "HOME": "/tmp"}
inner = ("mount -t sysfs sysfs /sys; until ip link show vb >/dev/null 2>&1; do sleep 0.05; done; ip link set lo up; "
         "ip addr add 10.77.0.2/24 dev vb; ip link set vb up; exec " + python + " " + peer + " read 10.77.0.2")
reader = subprocess.Popen(["unshare", "-nm", "sh", "-c", inner], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=dict(env, UCX_NET_DEVICES="vb"))
time.sleep(0.2)
sh(f"ip link set vb netns {reader.pid}")
while "LOWER_UP" not in subprocess.run(["ip", "link", "show", "va"], capture_output=True, text=True).stdout:
    time.sleep(0.05)  # the reader's end is up: UCX TCP finds a usable device
holder = subprocess.Popen([python, peer, "hold", "1", "10.77.0.1"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=dict(env, UCX_NET_DEVICES="va"))
offered = next(json.loads(l) for l in holder.stdout if l.startswith("{"))
listeners = [ln.split()[3] for ln in subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout.splitlines()]
out, _ = reader.communicate(json.dumps({"offer": offered["offers"][0], "deadline_s": 60}) + "\n", timeout=120)
holder.stdin.close(); holder.wait(30)
got = next(json.loads(l) for l in out.splitlines() if l.startswith("{"))
print(json.dumps({"got": got, "digest": offered["digests"][0], "listeners": listeners}))
"""


def test_the_same_read_runs_over_ucx_tcp_between_two_network_namespaces() -> None:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(why)
    if shutil.which("ip") is None or shutil.which("ss") is None:
        pytest.skip("iproute2 (ip, ss) not found")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["unshare", "-rnm", sys.executable, "-c", _NS, PEER, sys.executable, str(root)],
                          capture_output=True, text=True, timeout=180)
    if done.returncode != 0 and "veth" in done.stderr:
        pytest.skip(f"no veth pair in a user namespace here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["got"]["result"] == "read" and result["got"]["digest"] == result["digest"], result
    # UCX TCP listens on the transfer host's interface only (va holds 10.77.0.1; lo is not used)
    assert result["listeners"] and {a.rsplit(":", 1)[0] for a in result["listeners"]} == {"10.77.0.1"}, result
