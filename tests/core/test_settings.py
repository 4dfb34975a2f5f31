"""Pinned settings, the drafter policy and the armed state.

Process-wide pins are tested on fresh `PinnedSetting` instances, and the
module-level functions in subprocesses, so no test leaks a pin to another.
"""

import subprocess
import sys
import threading

import pytest

from trtllm_mtp_carry import (
    DEFAULT_MARCONI_MIN_TOKENS,
    DrafterContext,
    carry_armed_with,
    mtp_carry_debug,
)
from trtllm_mtp_carry.core.settings import PinnedSetting

ENV = "TRTLLM_MTP_CARRY_TEST_SETTING"


def fresh(monkeypatch, raw=None, minimum=0):
    if raw is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, raw)
    return PinnedSetting("test_setting", ENV, 256, minimum=minimum)


def test_default_is_256():
    assert DEFAULT_MARCONI_MIN_TOKENS == 256


def test_first_read_takes_default(monkeypatch):
    s = fresh(monkeypatch)
    assert (s.get(), s.source) == (256, "default")


def test_first_read_takes_env(monkeypatch):
    s = fresh(monkeypatch, " 99 ")
    assert (s.get(), s.source) == (99, f"env {ENV}")


def test_zero_from_env_removes_the_floor(monkeypatch):
    assert fresh(monkeypatch, "0").get() == 0


def test_set_before_read_pins(monkeypatch):
    s = fresh(monkeypatch, "99")
    assert s.set(128) is True
    assert s.get() == 128


def test_set_after_read_is_refused_without_raising(monkeypatch):
    s = fresh(monkeypatch)
    assert s.get() == 256
    assert s.set(64) is False
    assert s.get() == 256


def test_second_set_is_refused(monkeypatch):
    s = fresh(monkeypatch)
    assert s.set(64) is True
    assert s.set(32) is False
    assert s.get() == 64


@pytest.mark.parametrize("raw", ["-1", "abc", "1.5", "", "  ", "0x10", "１２"])
def test_malformed_env_names_variable_and_value(monkeypatch, raw):
    s = fresh(monkeypatch, raw)
    with pytest.raises(ValueError) as err:
        s.get()
    assert ENV in str(err.value) and repr(raw) in str(err.value)
    assert not s.pinned  # nothing fixed by a failed read


def test_env_below_minimum(monkeypatch):
    with pytest.raises(ValueError, match=f"{ENV}='0' must be at least 1"):
        fresh(monkeypatch, "0", minimum=1).get()


def test_bad_set_values(monkeypatch):
    s = fresh(monkeypatch)
    with pytest.raises(ValueError, match="test_setting"):
        s.set(-5)
    with pytest.raises(TypeError, match="test_setting"):
        s.set("12")
    assert not s.pinned


def test_concurrent_first_sets_pin_exactly_one(monkeypatch):
    s = fresh(monkeypatch)
    barrier = threading.Barrier(8)
    results = []

    def worker(v):
        barrier.wait()
        results.append((v, s.set(v)))

    threads = [threading.Thread(target=worker, args=(v,)) for v in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [v for v, ok in results if ok]
    assert len(winners) == 1 and s.get() == winners[0]


def test_drafter_context_rejects_carry_without_prefill():
    with pytest.raises(ValueError, match="carry=True, prefill=False"):
        DrafterContext(prefill=False, carry=True)
    assert DrafterContext(prefill=False, carry=False).carry is False
    with pytest.raises(TypeError, match="carry"):
        DrafterContext(prefill=True, carry=1)


def test_carry_armed_with():
    on, off = DrafterContext(True, True), DrafterContext(True, False)
    assert carry_armed_with(on, multi_seq=False) is True
    assert carry_armed_with(on, multi_seq=True) is True  # per-chunk rows: armed at any cap
    assert carry_armed_with(off, multi_seq=False) is False
    assert carry_armed_with(off, multi_seq=True) is False


@pytest.mark.parametrize(
    "raw, expected", [("1", True), ("0", False), ("true", False), (" 1", False)]
)
def test_debug_switch_is_exactly_one(monkeypatch, raw, expected):
    monkeypatch.setenv("TRTLLM_MTP_CARRY_DEBUG", raw)
    assert mtp_carry_debug() is expected


def run_py(code, **env):
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TRTLLM_MTP_CARRY_")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, check=False
    )


def test_module_threshold_pins_at_first_read_in_a_process():
    code = (
        "import trtllm_mtp_carry as t\n"
        "print(t.marconi_min_tokens(), t.set_marconi_min_tokens(64), t.marconi_min_tokens())"
    )
    out = run_py(code, TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS="128")
    assert out.stdout.split() == ["128", "False", "128"]


def test_module_set_before_read_wins_over_env():
    code = (
        "import trtllm_mtp_carry as t\nprint(t.set_marconi_min_tokens(64), t.marconi_min_tokens())"
    )
    assert run_py(code, TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS="128").stdout.split() == ["True", "64"]


def test_module_dispatch_cap_and_armed_state():
    code = (
        "import trtllm_mtp_carry as t\n"
        "cfg = t.DrafterContext(prefill=True, carry=True)\n"
        "class Levers: drafter = cfg\n"
        "print(t.mtp_max_seqs(), t.mtp_multi_seq_mode(), t.carry_armed(cfg), "
        "t.mtp_carry_drafter_enabled(Levers()))"
    )
    assert run_py(code).stdout.split() == ["32", "True", "True", "True"]
    assert run_py(code, TRTLLM_MTP_CARRY_MAX_SEQS="1").stdout.split() == [
        "1",
        "False",
        "True",
        "True",
    ]


def test_module_malformed_env_raises_at_first_read():
    out = run_py("import trtllm_mtp_carry as t; t.mtp_max_seqs()", TRTLLM_MTP_CARRY_MAX_SEQS="many")
    assert out.returncode != 0
    assert "TRTLLM_MTP_CARRY_MAX_SEQS='many' is not a non-negative integer" in out.stderr


def test_import_does_not_load_torch():
    out = run_py(
        "import sys, trtllm_mtp_carry\n"
        "bad = [m for m in ('torch', 'triton', 'numpy', 'tensorrt', 'tensorrt_llm') if m in sys.modules]\n"
        "print(bad)"
    )
    assert out.stdout.strip() == "[]"
