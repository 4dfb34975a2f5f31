"""How carried drafter rows are stored, and what they cost: the row format of a store tier.

What it is for: the carry store charges each entry the bytes its rows really
take in the tier that holds them. A row is `vectors_per_row` head vectors of
`head_dim` elements (K and V, per KV head, per MTP layer). `bf16` keeps them
as the pool holds them (`elem_bytes` each); `fp8` packs each vector as
`head_dim` float8_e4m3fn bytes plus one float32 scale (one scale per row, K/V
and head: the data plane's `dataplane.row_format.PackedRows`); `nvfp4` packs each
vector as `head_dim / 2` bytes of e2m1 pairs, one e4m3 scale byte per 16 elements and
one e8m0 byte (the vector's power-of-two global scale: `dataplane.nvfp4.Nvfp4Rows`)::

    bf16:   | v0: D x 2 B          | v1: D x 2 B          | ...
    fp8:    | v0: D x 1 B | s0 4 B | v1: D x 1 B | s1 4 B | ...   (scales stored apart)
    nvfp4:  | v0: D/2 B | D/16 B | 1 B | v1: ...                  (Qwen3-Next's MTP row: 4 x 145 = 580 B)
    fp8_kv: | v0: D x 1 B | v1: D x 1 B | ...   (an FP8 KV pool's own bytes: static scale, none stored)
    nvfp4_kv: | v0: D/2 B | D/16 B | v1: ...         (an NVFP4 KV pool's own bytes: e2m1 pairs and e4m3
                                                       block scales; the per-layer global scale is not stored;
                                                       Qwen3-Next's MTP row: 4 x 144 = 576 B)
    fp8_ds_mla: | 448 x e4m3 | 64 x bf16 | 7 x ue8m0 + 1 pad |   (DeepSeek-V4's footer-scale MLA latent,
                                                       Hopper's fp8_ds_mla pages: one 584 B vector a key)

`fp8_kv`, `nvfp4_kv` and `fp8_ds_mla` are not `carry_row_dtype` choices: they are the
formats of a pool whose rows already are float8_e4m3fn bytes, NVFP4 payload and block
scale bytes, or DeepSeek-V4's footer-scale MLA latent bytes (`dataplane.row_codec`
picks them for such a pool, whatever `carry_row_dtype` says); trace replay takes them
to charge such a pool's rows (`ROW_FORMATS`). An MLA latent pool's row is one vector a
key (`vectors_per_row` 1), not K and V. An NVFP4 pool's second-level (global) K and V scales are one
float32 each per layer, constant across requests (`kv_scale_orig_quant`), so a
carried row holds none.

Invariants:
- `rows_nbytes(fmt, n, d, e)` equals the data plane codec's bytes held for every
  format in `ROW_FORMATS` (`dataplane.row_codec`, pinned by its contract suite);
- `rows_nbytes("fp8", n, d)` equals `dataplane.row_format.packed_nbytes(n, d)`
  (payload plus scales) and `rows_nbytes("nvfp4", n, d)` equals
  `dataplane.nvfp4.nvfp4_nbytes(n, d)` for every `n`, `d` (tests/dataplane pins both);
  pure Python, no torch.
- A format enters `ROW_DTYPES` (`carry_row_dtype`) only with a codec both executors
  use (`dataplane.row_codec.CODECS`), so a runtime never charges one format while
  holding another.
- A bad dtype name is one ValueError naming the value and the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_choice, check_non_negative

ROW_DTYPES: tuple[str, ...] = ("bf16", "fp8", "nvfp4")
"""Row formats the runtimes carry (`carry_row_dtype`); the first is the default (DECISIONS.md
"FP8 carried rows", "NVFP4 carried rows")."""

DEFAULT_CARRY_ROW_DTYPE = ROW_DTYPES[0]

ROW_FORMATS: tuple[str, ...] = (*ROW_DTYPES, "fp8_kv", "nvfp4_kv", "fp8_ds_mla")
"""Every format a carried row may be held in: the `carry_row_dtype` choices, then `fp8_kv`
(an FP8 KV pool's own 1-byte rows), `nvfp4_kv` (an NVFP4 KV pool's own payload and block
scale bytes) and `fp8_ds_mla` (DeepSeek-V4's footer-scale MLA latent bytes). Each has a codec
in `dataplane.row_codec.CODECS`."""

FP8_DS_MLA_DIM = 512
"""The one latent width `fp8_ds_mla` holds: `DIM_NOPE + DIM_ROPE` (`footer_scale_kv.py` @
d77955c52716fe6ff51d047f0eb93a443a342ef9; `get_token_bytes` refuses any other head_dim)."""

FP8_DS_MLA_VECTOR_BYTES = 584
"""`footer_scale_kv.TOKEN_BYTES`: 448 e4m3 latent values and 64 bf16 RoPE values (the data row,
576 B), then 7 UE8M0 tile scales and one pad byte (the footer row, 8 B)."""

FP8_KV_ELEM_BYTES = 1
"""Bytes of one element of an FP8 KV pool's row (float8_e4m3fn)."""

FP8_SCALE_BYTES = 4
"""Bytes of one fp8 vector's scale (float32)."""

NVFP4_BLOCK = 16
"""Elements sharing one nvfp4 block scale (an e4m3 byte); `head_dim` must be a multiple."""

NVFP4_GLOBAL_BYTES = 1
"""Bytes of one nvfp4 vector's global scale (an e8m0 exponent byte)."""


def check_row_dtype(value: object, what: str = "carry_row_dtype") -> str:
    """`value` if it names a row format, else a ValueError naming `what`, the value and the choices."""
    return check_choice(value, ROW_DTYPES, what, "a row format")


def check_row_format(value: object, what: str = "row format") -> str:
    """`value` if it names a format in `ROW_FORMATS`, else a ValueError naming `what`, the value
    and the choices."""
    return check_choice(value, ROW_FORMATS, what, "a row format")


KV_DTYPES: tuple[str, ...] = ("auto", "fp8", "nvfp4")
"""The draft pool's KV format as `kv_cache_config.dtype` names it: `auto` (the model's dtype,
BF16 rows), `fp8` (float8_e4m3fn pages written with the layer's static KV scale) or `nvfp4`
(e2m1 payload pages and e4m3 block-scale pages under the layer's static global scales)."""

_POOL_FORMATS = {"fp8": "fp8_kv", "nvfp4": "nvfp4_kv"}


def carried_row_format(row_dtype: str, kv_dtype: str = "auto") -> str:
    """The format carried rows are held in, for `carry_row_dtype` `row_dtype` over a pool of KV
    format `kv_dtype`: an FP8 or NVFP4 pool's rows are its own bytes (`fp8_kv`, `nvfp4_kv`)
    whatever `row_dtype` says (never a second quantization); otherwise `row_dtype`. The torch-free twin of
    `dataplane.row_codec.codec_for` (tests pin that both agree). ValueError names a bad value."""
    check_row_dtype(row_dtype)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not a KV format the carry holds; expected one of "
                         f"{', '.join(KV_DTYPES)}")
    return _POOL_FORMATS.get(kv_dtype, row_dtype)


def vector_nbytes(row_dtype: str, head_dim: int, elem_bytes: int = 2) -> int:
    """Bytes one head vector of `head_dim` elements takes in format `row_dtype` (`ROW_FORMATS`;
    `elem_bytes`: bf16's element, the pool's own). nvfp4 and nvfp4_kv need `head_dim` a multiple of
    `NVFP4_BLOCK` (a ValueError names it otherwise)."""
    check_row_format(row_dtype)
    if row_dtype == "fp8":
        return head_dim + FP8_SCALE_BYTES
    if row_dtype == "fp8_kv":
        return head_dim * FP8_KV_ELEM_BYTES
    if row_dtype in ("nvfp4", "nvfp4_kv"):
        if head_dim % NVFP4_BLOCK:
            raise ValueError(f"head_dim={head_dim!r} is not a multiple of {NVFP4_BLOCK}: nvfp4 "
                             f"holds one scale per {NVFP4_BLOCK} elements")
        # nvfp4_kv: the pool's own bytes, no per-vector global scale (the layer's is static)
        return head_dim // 2 + head_dim // NVFP4_BLOCK + (NVFP4_GLOBAL_BYTES if row_dtype == "nvfp4" else 0)
    if row_dtype == "fp8_ds_mla":
        if head_dim != FP8_DS_MLA_DIM:
            raise ValueError(f"head_dim={head_dim!r}: fp8_ds_mla holds {FP8_DS_MLA_DIM}-wide MLA latent "
                             "vectors only (footer_scale_kv.py's DIM_NOPE + DIM_ROPE)")
        return FP8_DS_MLA_VECTOR_BYTES
    return head_dim * elem_bytes


def rows_nbytes(row_dtype: str, num_vectors: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Bytes `num_vectors` head vectors take in `row_dtype` (fp8, nvfp4: payload plus scales)."""
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
        check_row_format(self.dtype, "RowFormat.dtype")
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


__all__ = ["DEFAULT_CARRY_ROW_DTYPE", "FP8_DS_MLA_DIM", "FP8_DS_MLA_VECTOR_BYTES", "FP8_KV_ELEM_BYTES", "FP8_SCALE_BYTES", "KV_DTYPES", "NVFP4_BLOCK",
           "NVFP4_GLOBAL_BYTES", "ROW_DTYPES", "ROW_FORMATS", "RowFormat", "carried_row_format", "check_row_dtype",
           "check_row_format", "rows_nbytes",
           "vector_nbytes"]
