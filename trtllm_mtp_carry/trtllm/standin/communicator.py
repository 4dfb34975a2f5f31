"""Stand-in for `tensorrt_llm/_torch/distributed/communicator.py`: `Distributed` and `TorchDist`.

Read (nothing ran): `communicator.py` @ a1cf28f9581381fbf95c6bf2f96cb9dcdefac21c (`Distributed`:
`rank`, `world_size`, `tp_size`, `tp_rank`, `has_pp` read off the mapping; `TorchDist(mapping)`
asserts `torch.distributed.is_initialized()`; `TorchDist.broadcast(obj, root=0)` without MPI:
a tensor through `dist.broadcast`, any other object through `dist.broadcast_object_list`;
`TorchDist.tp_allgather(obj)`: a tensor through `dist.all_gather` (a list of tensors, one per
rank of the tensor-parallel group, in rank order), any other object through
`dist.all_gather_object`, both over the mapping's tensor-parallel group) and the version the
index stores without a commit (id 68312757152: `Distributed.get(mapping)`, a `@staticmethod`
`@lru_cache`, `TorchDist` when `mpi_disabled()` else `MPIDist`; `MPIDist.tp_allgather` is
mpi4py's `allgather` on the TP communicator). `Distributed.get(mapping)` is what
`kv_cache_manager_v2.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412 calls for its `allreduce(...,
op=ReduceOp.MIN)`, and `py_executor_creator.py` @ 000429d57d42ecc8d481e5cdf653fff238be5974 for the
executor's `dist` (passed to `create_py_executor_instance(dist=...)`). Collectives pair by call
order: every rank of the group must make the same calls in the same order.

The stand-in plays the MPI-less path (`TorchDist`) over a gloo process group of real rank
processes on the CPU; it has no pipeline or context parallelism (`tp_size == world_size`).
Only a multi-rank world builds one (TorchDist needs an initialized process group); the
stand-in's single-rank executor has no communicator.

Invariant: package code reads only `TRTLLM_NAMES["Distributed"]` (`Conformant`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.distributed as dist

from .conformant import Conformant
from .mapping import Mapping


class Distributed(Conformant):
    """Stand-in for `Distributed`: the executor's communicator over one mapping."""

    TRTLLM_CLASS = "Distributed"

    def __init__(self, mapping: Mapping) -> None:
        self.mapping = mapping

    @staticmethod
    @cache  # the source: `@lru_cache(maxsize=None)`
    def get(mapping: Mapping) -> Distributed:
        """One communicator per mapping (the stand-in has no MPI: always `TorchDist`)."""
        return TorchDist(mapping)

    @property
    def rank(self) -> int:
        return self.mapping.rank

    @property
    def world_size(self) -> int:
        return self.mapping.world_size

    @property
    def tp_size(self) -> int:
        return self.mapping.tp_size

    @property
    def tp_rank(self) -> int:
        return self.mapping.tp_rank

    @property
    def has_pp(self) -> bool:
        return self.mapping.has_pp()


class TorchDist(Distributed):
    """Stand-in for `TorchDist` on the CPU (gloo): `broadcast` and `tp_allgather` as the source has them."""

    def __init__(self, mapping: Mapping) -> None:
        super().__init__(mapping)
        assert dist.is_initialized(), "torch.distributed should be initialized before TorchDist"
        if mapping.tp_size != dist.get_world_size() or mapping.pp_size != 1 or mapping.cp_size != 1:
            raise NotImplementedError("the stand-in's TorchDist models one tensor-parallel group "
                                      "spanning the world (no pipeline or context parallelism)")

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        if isinstance(obj, torch.Tensor):
            dist.broadcast(obj, src=root)
            return obj
        obj_list = [obj]
        dist.broadcast_object_list(obj_list, src=root)
        return obj_list[0]

    def tp_allgather(self, obj: Any) -> list[Any]:
        if isinstance(obj, torch.Tensor):
            output = [torch.empty_like(obj) for _ in range(self.mapping.tp_size)]
            dist.all_gather(output, obj)
            return output
        gathered: list[Any] = [None] * self.mapping.tp_size
        dist.all_gather_object(gathered, obj)
        return gathered
