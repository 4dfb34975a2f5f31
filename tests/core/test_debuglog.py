"""The debug log: one line per store and per adopt decision, only with TRTLLM_MTP_CARRY_DEBUG=1."""

import logging

from trtllm_mtp_carry import CarriedDrafter, CarryOutcome, log_adopt, log_store


def test_adopt_line_carries_outcome_text(monkeypatch, caplog):
    monkeypatch.setenv("TRTLLM_MTP_CARRY_DEBUG", "1")
    with caplog.at_level(logging.INFO, logger="trtllm_mtp_carry"):
        log_adopt(CarryOutcome.Adopted(4, 2, 9), session_hash=0xAB, ticket=3, prompt_len=12)
    assert [r.getMessage() for r in caplog.records] == [
        "mtp carry adopt: session=0x00000000000000ab ticket=3 prompt_len=12: "
        "adopted rows=4 appended=2 first_key=9"
    ]


def test_store_line(monkeypatch, caplog):
    monkeypatch.setenv("TRTLLM_MTP_CARRY_DEBUG", "1")
    entry = CarriedDrafter([3, 4], 20, 19, list(range(22)), 0xAB)
    with caplog.at_level(logging.INFO, logger="trtllm_mtp_carry"):
        log_store(entry, ticket=3)
    assert [r.getMessage() for r in caplog.records] == [
        "mtp carry store: session=0x00000000000000ab ticket=3 rows=20 last_pair_key=19 "
        "blocks=2 tokens=22"
    ]


def test_silent_without_the_switch(monkeypatch, caplog):
    monkeypatch.delenv("TRTLLM_MTP_CARRY_DEBUG", raising=False)
    with caplog.at_level(logging.DEBUG, logger="trtllm_mtp_carry"):
        log_adopt(CarryOutcome.NoCarry(), 1, 1, 1)
        log_store(CarriedDrafter([], 0, None, [], 1), 1)
    assert caplog.records == []
