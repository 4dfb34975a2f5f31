"""How carried drafter rows are stored, and what they cost: the row format of a store tier.

What it is for: the carry store charges each entry the bytes its rows really
take in the tier that holds them. A row is `vectors_per_row` head vectors of
`head_dim` elements (K and V, per KV head, per MTP layer). `bf16` keeps them
as the pool holds them (`elem_bytes` each); `fp8` packs each vector as
`head_dim` float8_e4m3fn bytes plus one float32 scale (one scale per row, K/V
and head: the data plane's `dataplane.row_format.PackedRows`)::

    bf16: | v0: D x 2 B          | v1: D x 2 B          | ...
    fp8:  | v0: D x 1 B | s0 4 B | v1: D x 1 B | s1 4 B | ...   (scales stored apart)

Invariants:
- `rows_nbytes("fp8", n, d)` equals `dataplane.row_format.packed_nbytes(n, d)`
  (payload plus scales) for every `n`, `d` (tests/dataplane pins it); pure Python,
  no torch.
- A bad dtype name is one ValueError naming the value and the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_non_negative

ROW_DTYPES: tuple[str, ...] = ("bf16", "fp8")
"""Row formats of carried entries; the first is the default (DECISIONS.md "FP8 carried rows")."""

DEFAULT_CARRY_ROW_DTYPE = ROW_DTYPES[0]

FP8_SCALE_BYTES = 4
"""Bytes of one fp8 vector's scale (float32)."""


def check_row_dtype(value: object, what: str = "carry_row_dtype") -> str:
    """`value` if it names a row format, else a ValueError naming `what`, the value and the choices."""
    if value not in ROW_DTYPES:
        raise ValueError(f"{what}={value!r} is not a row format; expected one of {', '.join(ROW_DTYPES)}")
    assert isinstance(value, str)
    return value


def vector_nbytes(row_dtype: str, head_dim: int, elem_bytes: int = 2) -> int:
    """Bytes one head vector of `head_dim` elements takes in `row_dtype` (`elem_bytes`: bf16's element)."""
    check_row_dtype(row_dtype)
    if row_dtype == "fp8":
        return head_dim + FP8_SCALE_BYTES
    return head_dim * elem_bytes


def rows_nbytes(row_dtype: str, num_vectors: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Bytes `num_vectors` head vectors take in `row_dtype` (fp8: payload plus one scale each)."""
    check_non_negative("num_vectors", num_vectors)
    return num_vectors * vector_nbytes(row_dtype, head_dim, elem_bytes)


@dataclass(frozen=True, slots=True)
class RowFormat:
    """One tier's row format: `dtype` over rows of `vectors_per_row` vectors of `head_dim`
    elements, `elem_bytes` each unpacked (the pool's dtype). `nbytes(rows)` is what `rows`
    rows cost in it."""

    dtype: str
    vectors_per_row: int
    head_dim: int
    elem_bytes: int = 2

    def __post_init__(self) -> None:
        check_row_dtype(self.dtype, "RowFormat.dtype")
        for name in ("vectors_per_row", "head_dim", "elem_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"RowFormat.{name} must be an int >= 1, got {value!r}")

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row."""
        return rows_nbytes(self.dtype, self.vectors_per_row, self.head_dim, self.elem_bytes)

    def nbytes(self, rows: int) -> int:
        """Bytes of `rows` rows."""
        return check_non_negative("rows", rows) * self.row_nbytes


__all__ = ["DEFAULT_CARRY_ROW_DTYPE", "FP8_SCALE_BYTES", "ROW_DTYPES", "RowFormat", "check_row_dtype",
           "rows_nbytes", "vector_nbytes"]
