"""Stand-in for `tensorrt_llm/mapping.py`: `Mapping`, the fields the adapter and the stand-in read.

Read (nothing ran): `mapping.py` @ 05ebebb2c1d34320db9019f2b7ace6009a67e997:
`Mapping(world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, ..., tp_size=1, pp_size=1, ...,
enable_attention_dp=False)`; `world_size` must equal `tp_size * pp_size * cp_size` (ValueError
otherwise); `tp_rank = rank % tp_size`, `pp_rank = rank // (tp_size * cp_size)`; `tp_group`, the
ranks of this rank's tensor-parallel group; `has_tp()`, `has_pp()`; `__eq__`/`__hash__` over the
sizes and the rank (so `Distributed.get`, an `lru_cache` on the mapping, returns one
communicator per mapping).

Invariant: package code reads only the names in `TRTLLM_NAMES["Mapping"]` (`Conformant`).
"""

from __future__ import annotations

from .conformant import Conformant


class Mapping(Conformant):
    """Stand-in for `tensorrt_llm.mapping.Mapping` (no MoE, context or attention-TP splits)."""

    TRTLLM_CLASS = "Mapping"

    def __init__(self, world_size: int = 1, rank: int = 0, gpus_per_node: int = 8, *, cp_size: int = 1,
                 tp_size: int = 1, pp_size: int = 1, enable_attention_dp: bool = False) -> None:
        if tp_size * pp_size * cp_size != world_size:
            raise ValueError(f"world_size must equal to tp_size * pp_size * cp_size, but got {world_size} "
                             f"!= {tp_size} * {pp_size} * {cp_size}.")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"Rank should be an integer between 0 and {world_size - 1}, but got {rank}.")
        self.world_size = world_size
        self.rank = rank
        self.gpus_per_node = gpus_per_node
        self.cp_size = cp_size
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.enable_attention_dp = enable_attention_dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size)

    @property
    def tp_group(self) -> list[int]:
        start = self.pp_rank * self.tp_size * self.cp_size
        return list(range(start, start + self.tp_size))

    def has_tp(self) -> bool:
        return self.tp_size > 1

    def has_pp(self) -> bool:
        return self.pp_size > 1

    def _key(self) -> tuple[int, ...]:
        return (self.world_size, self.rank, self.gpus_per_node, self.cp_size, self.tp_size, self.pp_size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Mapping(world_size={self.world_size}, rank={self.rank}, tp_size={self.tp_size}, "
                f"pp_size={self.pp_size}, enable_attention_dp={self.enable_attention_dp})")
