"""A CPU-side tracer of the calls that would make the host wait for the device on CUDA.

What it is for: counting a code path's host-device syncs without a GPU. A
`TorchFunctionMode` follows which tensors live "on the device" (seeded with
the caches, the store and the model's weights; factories given a `device`;
anything computed from a device tensor) and records, with the package's own
call site, each call that on CUDA copies device data to the host or blocks on
the stream:

- reading values: `item`, `tolist`, `numpy`, `bool()`, `int()`, `float()`,
  `index()` of a device tensor; data-dependent shapes (`nonzero`,
  `masked_select`, `unique`, ...) of one;
- `to("cpu")`/`cpu()` of a device tensor (unless `non_blocking=True`);
- host data to the device from pageable memory: `torch.tensor(data, device=d)`,
  `host.to(d)` / `copy_` without `non_blocking=True`.

Convention (the tracer cannot see devices on a CPU run): the host is named by
the string "cpu" (`.to("cpu")`, `.cpu()`, factories without a device); a
`torch.device` object names the device, as the package's code writes it.
The package's upload helpers (`dataplane.device_ints`: pinned staging and a
non-blocking copy on CUDA) are patched by `patch_uploads` where the prep path
imported them, to give a device tensor and count no sync.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import trtllm_mtp_carry

_PACKAGE = os.path.dirname(trtllm_mtp_carry.__file__)
_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                    "argwhere", "masked_select", "unique", "unique_consecutive", "nonzero_static",
                    "repeat_interleave", "equal", "allclose"})
_FACTORIES = frozenset({"tensor", "as_tensor", "arange", "empty", "zeros", "ones", "full", "rand", "randn",
                        "randint", "linspace", "empty_strided", "eye"})
_UPLOADING_FACTORIES = frozenset({"tensor", "as_tensor"})


def _names_host(target: Any) -> bool:
    return isinstance(target, str) and target.split(":")[0] == "cpu"


def _is_device(target: Any) -> bool:
    return isinstance(target, torch.device) or (isinstance(target, str) and not _names_host(target))


class SyncTrace(TorchFunctionMode):
    """Counts would-be syncs by (kind, package call site) while active; `syncs` is the Counter."""

    def __init__(self, device_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._on_device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in device_tensors:
            self.mark(t)
        self.syncs: Counter[tuple[str, str]] = Counter()

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        """Say that `t` lives on the device."""
        self._on_device[t] = True
        return t

    def on_device(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t in self._on_device

    @property
    def total(self) -> int:
        return sum(self.syncs.values())

    def _site(self) -> str:
        frame = sys._getframe(1)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(_PACKAGE) and not path.endswith("device_ints.py"):
                return f"{os.path.relpath(path, _PACKAGE)}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back  # type: ignore[assignment]
        return "?"

    def _count(self, kind: str) -> None:
        if not self.quiet:
            self.syncs[(kind, self._site())] += 1

    quiet = False
    """True inside an upload helper `patch_uploads` vouches for (its host staging is no sync)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        flat, _ = tree_flatten((args, kwargs))
        from_device = any(self.on_device(t) for t in flat)
        result = func(*args, **kwargs)
        to_device = from_device
        if name in _READS and args and self.on_device(args[0]):
            self._count(f"read {name}")
        elif name in ("to", "cpu", "cuda", "copy_") and args and isinstance(args[0], torch.Tensor):
            src = args[1] if name == "copy_" else args[0]
            blocking = not kwargs.get("non_blocking", False) and not any(
                a is True for a in args[2 if name == "copy_" else 1:])
            if name == "copy_":
                target_device = self.on_device(args[0])
                source_device = self.on_device(src)
            else:
                targets = [a for a in args[1:] if isinstance(a, (str, torch.device))]
                targets += [kwargs["device"]] if "device" in kwargs else []
                targets += [a for a in args[1:] if isinstance(a, torch.Tensor)]
                if name == "cpu":
                    target_device = False
                elif name == "cuda":
                    target_device = True
                elif not targets:  # a dtype change only: stays where it is
                    target_device = from_device
                else:
                    t = targets[0]
                    target_device = self.on_device(t) if isinstance(t, torch.Tensor) else _is_device(t)
                source_device = self.on_device(args[0])
            if source_device and not target_device and blocking:
                self._count(f"download {name}")
            elif target_device and not source_device and blocking:
                self._count(f"upload {name}")
            to_device = target_device
            if name != "copy_" and result is args[0] and target_device != source_device:
                result = result.clone()  # on CPU the move was a no-op: on CUDA it is a new tensor
        elif name in _FACTORIES and "device" in kwargs and _is_device(kwargs["device"]):
            to_device = True
            if name in _UPLOADING_FACTORIES:
                self._count(f"upload {name}")
        elif name == "pin_memory":
            to_device = False
        if to_device:
            for out in tree_flatten(result)[0]:
                if isinstance(out, torch.Tensor):
                    self.mark(out)
        return result


UPLOAD_HELPERS = ("device_tensor", "device_copy")
"""The package's host-to-device helpers that stage in pinned memory and copy non-blocking on
CUDA (`dataplane.device_ints`): no sync there."""


def patch_uploads(monkeypatch: Any, trace_of: Any) -> Counter[str]:
    """Make the `UPLOAD_HELPERS`, where the prep path imported them, give device tensors
    without counting a sync; `trace_of()` is the active `SyncTrace` or None. Returns the
    count of uploads by call site."""
    from trtllm_mtp_carry.dataplane import kv_pool
    from trtllm_mtp_carry.engine import engine
    from trtllm_mtp_carry.runtime import carry_runtime

    uploads: Counter[str] = Counter()

    def wrap(fn: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> torch.Tensor:
            trace = trace_of()
            if trace is None:
                return fn(*args, **kwargs)
            trace.quiet = True
            try:
                out = fn(*args, **kwargs)
            finally:
                trace.quiet = False
            uploads[trace._site()] += 1
            return trace.mark(out.view_as(out))  # a new tensor object: a host input stays host
        return traced

    for module in (kv_pool, carry_runtime, engine):
        for name in UPLOAD_HELPERS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, wrap(getattr(module, name)))
    return uploads
