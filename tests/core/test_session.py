"""session_hash and TicketCounter: pinned values, domains, rejected input, threads."""

import subprocess
import sys
import threading

import pytest

from trtllm_mtp_carry.core import session as session_mod
from trtllm_mtp_carry.core.session import TicketCounter, session_hash


def test_session_hash_values_are_pinned():
    # stable across processes and machines: these values must never change
    assert session_hash("chat-1") == 0x00D7FC509B0F75CC
    assert session_hash(42) == 0x23BFBDB68BE1811F
    assert session_hash(0) == 0xCB8FC870107958F3


def test_session_hash_is_stable_in_another_process():
    code = "from trtllm_mtp_carry.core.session import session_hash; print(session_hash('chat-1'))"
    env = {"PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == session_hash("chat-1")


def test_session_hash_is_u64_nonzero_and_separates_domains():
    values = [session_hash(x) for x in ("a", "b", "7", 7, 2**64 - 1, "é", "\ud800")]
    assert len(set(values)) == len(values)
    assert all(0 < v < 2**64 for v in values)


def test_a_zero_digest_maps_to_the_fixed_standin(monkeypatch):
    class Zero:
        def __init__(self, *args, **kwargs):
            pass

        def digest(self):
            return bytes(8)

    monkeypatch.setattr(session_mod.hashlib, "blake2b", Zero)
    assert session_hash("x") == 0x9E3779B97F4A7C15


@pytest.mark.parametrize("bad", [True, False, 1.0, None, b"abc", ["a"]])
def test_session_hash_rejects_other_types(bad):
    with pytest.raises(TypeError, match=repr(bad).replace("[", r"\[").replace("]", r"\]")):
        session_hash(bad)


@pytest.mark.parametrize(
    "bad, text", [("", "''"), (-1, "-1"), (2**64, str(2**64))]
)  # fmt: skip
def test_session_hash_rejects_bad_values(bad, text):
    with pytest.raises(ValueError, match=text):
        session_hash(bad)


def test_tickets_start_at_one_and_increase():
    c = TicketCounter()
    assert c.last == 0
    assert [c.draw() for _ in range(3)] == [1, 2, 3]
    assert c.last == 3
    assert TicketCounter().draw() == 1  # each counter is its own


def test_tickets_are_unique_across_threads():
    c = TicketCounter()
    got: list[int] = []
    lock = threading.Lock()

    def worker():
        mine = [c.draw() for _ in range(2000)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 16001))


def test_ticket_counter_refuses_to_wrap():
    c = TicketCounter()
    c._last = 2**64 - 2
    assert c.draw() == 2**64 - 1
    with pytest.raises(RuntimeError, match="exhausted"):
        c.draw()
