"""Every byte figure a command prints follows one unit rule (`core.settings.format_bytes`)."""

from __future__ import annotations

import pytest

from trtllm_mtp_carry.core.settings import format_bytes, parse_carry_memory


@pytest.mark.parametrize(("n", "text"), [
    (0, "0B"), (768, "768B"), (1023, "1023B"), (1024, "1KiB"), (1536, "1.5KiB"),
    (512 << 20, "512MiB"), (1536 << 20, "1.5GiB"), (8 << 30, "8GiB"), (5 << 40, "5TiB"),
    (1_000_000_000, "953.67MiB"),  # not exact at two decimals: rounded
    ((1 << 30) - (10 << 10), "1023.99MiB"),  # just under 1GiB, and says so
    ((1 << 30) - 1, "1GiB"),  # rounds to 1024MiB: said in the next unit, never "1024MiB"
    ((1 << 20) - 1, "1MiB"), (1 << 30, "1GiB"),
])
def test_a_byte_figure_is_in_the_largest_unit_it_reaches_with_at_most_two_decimals(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("n", [1 << 30, 1536 << 20, 512 << 20, 3 << 10, 768])
def test_an_exact_figure_reads_back_as_the_same_bytes(n):
    assert parse_carry_memory(format_bytes(n)).nbytes == n


def test_a_negative_figure_is_one_error_naming_it():
    with pytest.raises(ValueError, match="bytes"):
        format_bytes(-1)
