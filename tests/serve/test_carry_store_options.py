"""The carry store's bounds as served-model parameters (`carry_memory`, `carry_eviction`,
`carry_idle_s`): typed, written back, one error naming a bad value."""

import pytest

from trtllm_mtp_carry.serve.options import ServeOptions


def test_carry_store_parameters_round_trip():
    options = ServeOptions.from_parameters({"carry_memory": {"string_value": "512MiB"},
                                            "carry_eviction": "slru", "carry_idle_s": "30"})
    assert (options.carry_memory, options.carry_eviction, options.carry_idle_s) == ("512MiB", "slru", 30)
    params = options.as_parameters()
    assert (params["carry_memory"], params["carry_eviction"], params["carry_idle_s"]) == ("512MiB", "slru", "30")
    assert ServeOptions.from_parameters({"carry_memory": ""}).carry_memory is None  # engine default


@pytest.mark.parametrize("key, value, message", [
    ("carry_memory", "lots", "parameter carry_memory='lots' is not a size"),
    ("carry_memory", "3", "parameter carry_memory='3': a bare number is a fraction of the drafter pool"),
    ("carry_eviction", "mru", "parameter carry_eviction='mru' is not an eviction policy"),
    ("carry_idle_s", "-3", "parameter carry_idle_s must be >= 0, got -3"),
])
def test_a_bad_carry_store_parameter_names_itself(key, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ServeOptions.from_parameters({key: value})
