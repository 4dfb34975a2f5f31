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


def test_the_host_tier_parameter_round_trips_and_a_bad_one_names_itself():
    options = ServeOptions.from_parameters({"carry_host_memory": {"string_value": "8GiB"}})
    assert options.carry_host_memory == "8GiB" and options.as_parameters()["carry_host_memory"] == "8GiB"
    assert ServeOptions.from_parameters({"carry_host_memory": ""}).carry_host_memory is None
    with pytest.raises(ValueError, match="parameter carry_host_memory='0.25': host memory is bytes with a unit"):
        ServeOptions.from_parameters({"carry_host_memory": "0.25"})


def test_runtime_gauges_include_the_host_tiers_counts_and_copy_times():
    from trtllm_standin import metric, pb_utils_module

    from trtllm_mtp_carry.metrics import CarryMetrics
    from trtllm_mtp_carry.runtime.carry_runtime import CarryStats

    metrics = CarryMetrics(pb_utils_module(), "m", "0")
    stats = CarryStats(armed=True, policy="carry", outcomes={}, rows_adopted=0, rows_appended=0,
                       keys_skipped=0, rows_prefilled=0, rows_rebuilt=0, turns_blind=0, deposits=0,
                       rows_held=0, carry_host_memory_bytes=1 << 30, hits_host=3, bytes_restored=4096,
                       restore_ms=1.5)
    metrics.refresh(stats)
    assert metric("mtp_carry_runtime", field="carry_host_memory_bytes") == 1 << 30
    assert metric("mtp_carry_runtime", field="hits_host") == 3
    assert metric("mtp_carry_runtime", field="bytes_restored") == 4096
    assert metric("mtp_carry_runtime", field="restore_ms") == 1.5
