"""The `mtp_carry` options section and the session identity (pure Python, no stand-in needed)."""

from __future__ import annotations

import sys

import pytest

from trtllm_mtp_carry.trtllm import (
    CarryOptions,
    TrtllmAdapterError,
    parse_carry_options,
    session_key_for,
    split_carry_options,
)


def test_defaults_and_valid_values_parse_exactly() -> None:
    assert parse_carry_options(None) == CarryOptions(True, None, None)  # None: carry_slots(), carry_memory()
    assert parse_carry_options({"carry_slots": None}).carry_slots is None
    opts = parse_carry_options({"enable": False, "carry_slots": 4, "carry_memory": "512MiB"})
    assert opts == CarryOptions(False, 4, 512 << 20)
    assert parse_carry_options({"carry_memory": 1000}).carry_memory == 1000
    assert parse_carry_options({"carry_memory": "2GB"}).carry_memory == 2_000_000_000
    assert parse_carry_options(None).stats_every == 0
    assert parse_carry_options({"stats_every": 500}).stats_every == 500


@pytest.mark.parametrize(("section", "named"), [
    ({"slots": 4}, "mtp_carry.slots: unknown key"),
    ({"enable": "yes"}, "mtp_carry.enable must be true or false, got 'yes'"),
    ({"carry_slots": 0}, "mtp_carry.carry_slots must be >= 1, got 0"),
    ({"carry_slots": True}, "mtp_carry.carry_slots must be an int >= 1, got True"),
    ({"carry_slots": 2.0}, "mtp_carry.carry_slots must be an int >= 1, got 2.0"),
    ({"carry_memory": -1}, "mtp_carry.carry_memory must be >= 0, got -1"),
    ({"carry_memory": "1.5GiB"}, "mtp_carry.carry_memory: '1.5GiB' is not a size"),
    ({"carry_memory": "12 parsecs"}, "mtp_carry.carry_memory: '12 parsecs' is not a size"),
    ({"stats_every": -1}, "mtp_carry.stats_every must be >= 0, got -1"),
    ({"stats_every": "often"}, "mtp_carry.stats_every must be an int >= 0, got 'often'"),
    ([1, 2], "mtp_carry must be a mapping"),
])
def test_every_bad_key_or_value_is_one_line_naming_it(section: object, named: str) -> None:
    with pytest.raises(TrtllmAdapterError) as exc:
        parse_carry_options(section)  # type: ignore[arg-type]
    assert named in str(exc.value) and "\n" not in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_split_carry_options_takes_the_section_out_of_the_llm_options_parsed() -> None:
    rest, opts = split_carry_options({"kv_cache_config": {"enable_block_reuse": True},
                                      "mtp_carry": {"carry_slots": 2}})
    assert rest == {"kv_cache_config": {"enable_block_reuse": True}}
    assert opts == CarryOptions(carry_slots=2)


def test_session_key_separates_conversations_salts_and_loras() -> None:
    base = session_key_for("conv-1")
    assert base == session_key_for("  conv-1 ") != 0  # stripped like ConversationParams
    keys = {base, session_key_for("conv-2"), session_key_for("conv-1", "salt-a"),
            session_key_for("conv-1", "salt-b"), session_key_for("conv-1", None, 7),
            session_key_for("conv-1", "salt-a", 7)}
    assert len(keys) == 6 and all(0 < k < 2**64 for k in keys)


@pytest.mark.parametrize(("args", "error"), [
    (("",), ValueError), (("   ",), ValueError), ((None,), TypeError),
    (("c", ""), ValueError), (("c", 5), TypeError), (("c", None, -1), TypeError),
    (("c", None, True), TypeError),
])
def test_session_key_refuses_blank_ids_and_bad_types(args: tuple, error: type) -> None:
    with pytest.raises(error):
        session_key_for(*args)


def test_importing_the_adapter_loads_neither_tensorrt_llm_nor_torch_until_attach() -> None:
    import subprocess

    code = ("import sys, trtllm_mtp_carry.trtllm as t; t.parse_carry_options(None); "
            "assert 'tensorrt_llm' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reading_an_options_file_without_pyyaml_names_the_extra(tmp_path, monkeypatch) -> None:
    from trtllm_mtp_carry.trtllm import load_llm_options

    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError, as without PyYAML
    path = tmp_path / "extra.yaml"
    path.write_text("mtp_carry: {carry_slots: 2}\n")
    with pytest.raises(TrtllmAdapterError, match=r"needs PyYAML, a dependency of trtllm-mtp-carry that is missing here: pip install pyyaml"):
        load_llm_options(path)


def test_reading_an_options_file_splits_the_carry_options_from_tensorrt_llms(tmp_path) -> None:
    from trtllm_mtp_carry.trtllm import load_llm_options

    path = tmp_path / "extra.yaml"
    path.write_text("kv_cache_config: {enable_block_reuse: true}\nmtp_carry: {carry_slots: 2}\n")
    assert load_llm_options(path) == ({"kv_cache_config": {"enable_block_reuse": True}},
                                      CarryOptions(carry_slots=2))


def _request(**fields: object) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(py_conversation_params=SimpleNamespace(conversation_id=" c "),
                           lora_task_id=None, **fields)


def test_a_requests_salt_string_keys_it_as_session_key_for_does_whatever_its_salt_id() -> None:
    from trtllm_mtp_carry.trtllm.identity import conversation_session, request_session

    assert request_session(_request(cache_salt="s")) == (session_key_for("c", "s"), conversation_session("c"))
    assert request_session(_request(cache_salt="s", cache_salt_id=7))[0] == session_key_for("c", "s")
    assert request_session(_request(cache_salt=None))[0] == session_key_for("c")


def test_an_older_request_without_the_salt_string_is_scoped_by_its_salt_id() -> None:
    from trtllm_mtp_carry.trtllm.identity import request_session

    assert request_session(_request(cache_salt_id=7))[0] == session_key_for("c", cache_salt_id=7)
    assert request_session(_request(cache_salt=None, cache_salt_id=7))[0] == session_key_for("c", cache_salt_id=7)
    assert request_session(_request())[0] == session_key_for("c")


def test_an_empty_salt_string_is_a_session_of_its_own() -> None:
    from trtllm_mtp_carry.trtllm.identity import request_session

    empty = request_session(_request(cache_salt=""))[0]
    assert empty not in {session_key_for("c"), session_key_for("c", "s")} and empty != 0
    assert empty == request_session(_request(cache_salt=""))[0]  # stable
