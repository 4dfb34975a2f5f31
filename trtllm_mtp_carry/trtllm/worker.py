"""Install the carry where TensorRT-LLM builds its PyExecutor: in the worker process, before it serves.

What it is for: the default `LLM(...)`, `trtllm-serve` and Dynamo's
`dynamo.trtllm` worker build the PyExecutor in a worker process, which
`attach(llm)` cannot reach. TensorRT-LLM's supported way to add a resource
manager is `TorchLlmArgs.extra_resource_managers` (`llmapi/llm_args.py`: "The
KV cache manager is guaranteed to be invoked after all of these extra
managers in all stages"), which `_util.create_py_executor_instance` adds to the
`resources` dict before building `ResourceManager(resources)` and moving the
KV cache manager last. A carry manager must hold the worker's own draft KV
manager, which exists only inside the worker, so no parent-side value can be
given there. This module wraps `create_py_executor_instance` in the worker
(module `tensorrt_llm._torch.pyexecutor.py_executor_creator`, which imports it
by name from `_util` and calls it with keyword `resources=` and
`start_worker=False`, then `py_executor.start_worker()`) and puts the carry
manager into that same dict, at the place `extra_resource_managers` would:
after `DRAFT_KV_CACHE_MANAGER` in prepare (its pages exist), before it in free
(its pages are still live), before the executor exists, so before any request.
With KV cache estimation the executor is built twice over one `resources` dict
(the KV managers torn down and rebuilt in between): each build gets a fresh
carry manager bound to that build's draft manager.

Turn it on: `TRTLLM_MTP_CARRY_WORKER=<file>` (a YAML file with an `mtp_carry:`
section; `1` for the defaults) in the environment of the process that starts
TensorRT-LLM (its workers inherit it), and once per environment
`python -m trtllm_mtp_carry.trtllm.worker install`, which writes a one-line
`.pth` file into site-packages: every interpreter start runs it, and it imports
this module only when `TRTLLM_MTP_CARRY_WORKER` is set.

Invariants:
- Nothing happens unless `TRTLLM_MTP_CARRY_WORKER` is set; the hook is installed once per process.
- At executor creation it prints one line (stderr and the `trtllm_mtp_carry` logger):
  what it installed, or why the carry stands aside; it never raises into
  TensorRT-LLM's executor creation (a refusal is that line, and the executor
  is built without the carry).
- The carry is added only on the unpaired topology (see `probe.probe_managers`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "TRTLLM_MTP_CARRY_WORKER"
"""The environment variable that turns the worker-side install on (a YAML file, or `1`)."""

CREATOR = "tensorrt_llm._torch.pyexecutor.py_executor_creator"
"""The module whose `create_py_executor_instance` the hook wraps (TensorRT-LLM's worker imports it)."""

STANDIN_CREATOR = "trtllm_mtp_carry.trtllm.standin.py_executor_creator"
"""The stand-in's creator module (same call, same keywords; only its version label differs)."""
PTH_NAME = "trtllm_mtp_carry_worker.pth"
PTH_LINE = (f'import os; os.environ.get("{ENV}") and '
            '__import__("trtllm_mtp_carry.trtllm.worker", fromlist=["boot"]).boot()\n')

logger = logging.getLogger("trtllm_mtp_carry")
_WRAPPED = "_mtp_carry_wrapped"
_installed = False
_messages: list[str] = []


def boot() -> None:
    """What the `.pth` line runs at interpreter start: install the hook if `TRTLLM_MTP_CARRY_WORKER` is set."""
    global _installed
    if not os.environ.get(ENV) or _installed:
        return
    _installed = True
    for name in (CREATOR, STANDIN_CREATOR):
        module = sys.modules.get(name)
        if module is not None:
            wrap_creator(module)
    sys.meta_path.insert(0, _CreatorFinder())


def messages() -> list[str]:
    """The lines this process printed at executor creation (oldest first)."""
    return list(_messages)


def carry_options_from_env() -> Any:
    """`CarryOptions` from `TRTLLM_MTP_CARRY_WORKER`: `1`/`true` the defaults, else a YAML file's `mtp_carry`."""
    from .options import CarryOptions, TrtllmAdapterError, load_llm_options

    value = os.environ.get(ENV, "")
    if value.lower() in ("1", "true", "yes", "on"):
        return CarryOptions()
    rest, options = load_llm_options(value)
    if rest:
        raise TrtllmAdapterError(
            f"{ENV}={value}: the file holds {sorted(rest)} besides mtp_carry; keep TensorRT-LLM's "
            "own options in their own file (LLM(**options) refuses an unknown key)")
    return options


def wrap_creator(module: ModuleType) -> None:
    """Wrap `module.create_py_executor_instance` once (TensorRT-LLM's creator or the stand-in's)."""
    original = getattr(module, "create_py_executor_instance", None)
    if original is None or getattr(original, _WRAPPED, False):
        return
    wrapped = _wrapped(original, module.__name__ == STANDIN_CREATOR)
    module.create_py_executor_instance = wrapped  # type: ignore[attr-defined]


def _wrapped(original: Callable[..., Any], standin: bool) -> Callable[..., Any]:
    def create_py_executor_instance(*args: Any, **kwargs: Any) -> Any:
        # py_executor_creator passes keywords only (`resources=`, `start_worker=False`, ...)
        if os.environ.get(ENV):  # unset since boot: TensorRT-LLM as is
            _install(kwargs.get("resources"), standin)
        return original(*args, **kwargs)

    create_py_executor_instance.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(create_py_executor_instance, _WRAPPED, True)
    return create_py_executor_instance


def _install(resources: Any, standin: bool) -> None:
    from . import CARRY_MANAGER_KEY
    from .manager import carry_manager_class
    from .options import TrtllmAdapterError
    from .probe import probe_managers

    if isinstance(resources, dict):
        # KV cache estimation builds the executor twice over one `resources` dict, tearing the
        # KV managers down and building them again in between (`create_py_executor`): a carry
        # manager from the first build holds a torn-down draft manager, never reused
        resources.pop(CARRY_MANAGER_KEY, None)
    try:
        if not isinstance(resources, dict):
            raise TrtllmAdapterError(
                "create_py_executor_instance was called without a resources= dict: this "
                "TensorRT-LLM build is not one the worker hook was written against")
        options = carry_options_from_env()
        version = "stand-in" if standin else _trtllm_version()
        probe = probe_managers(resources, version)
        if not options.enable:
            _say("mtp carry: stands aside: not configured (mtp_carry.enable is false)")
            return
        if not probe.runnable:
            _say(f"mtp carry: stands aside: {probe.reason}")
            return
        assert probe.draft is not None and probe.mtp_layer is not None
        base = _base_resource_manager(probe.draft)
        manager = carry_manager_class(base)(probe.draft, probe.mtp_layer, options, report=_say)
        resources[CARRY_MANAGER_KEY] = manager  # where extra_resource_managers go
        _say(f"mtp carry: installed in the worker's PyExecutor as {CARRY_MANAGER_KEY} "
             f"(TensorRT-LLM {version}, MTP layer {probe.mtp_layer}, "
             f"tokens_per_block {probe.tokens_per_block}): {probe.reason}")
    except TrtllmAdapterError as exc:
        _say(f"mtp carry: stands aside: {exc}")


def _base_resource_manager(draft: Any) -> type:
    from . import _base_resource_manager as base

    return base(draft)


def _trtllm_version() -> str:
    module = sys.modules.get("tensorrt_llm")
    return str(getattr(module, "__version__", "unknown"))


def _say(line: str) -> None:
    _messages.append(line)
    logger.info("%s", line)
    print(line, file=sys.stderr, flush=True)


class _CreatorFinder(importlib.abc.MetaPathFinder):
    """Wraps `create_py_executor_instance` as soon as TensorRT-LLM's creator module is loaded."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != CREATOR:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _WrappingLoader(spec.loader)
                return spec
        return None


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        result: ModuleType | None = self.inner.create_module(spec)
        return result

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        wrap_creator(module)


def install_pth(site_dir: str | Path | None = None) -> Path:
    """Write the `.pth` line into `site_dir` (default: this interpreter's site-packages)."""
    pth = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME
    pth.write_text(PTH_LINE)
    return pth


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trtllm_mtp_carry.trtllm.worker install [SITE_DIR]`: write the `.pth` line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "install" or len(args) > 2:
        got = f"got {' '.join(args)!r}" if args else "no command given"
        print(f"trtllm-mtp-carry: error: {got}; usage: python -m trtllm_mtp_carry.trtllm.worker install "
              "[SITE_DIR]", file=sys.stderr)
        return 2
    site_dir = args[1] if len(args) == 2 else None
    if site_dir is not None and not Path(site_dir).is_dir():
        print(f"trtllm-mtp-carry: error: SITE_DIR {site_dir!r} is not a directory", file=sys.stderr)
        return 2
    try:
        path = install_pth(site_dir)
    except OSError as exc:
        print(f"trtllm-mtp-carry: error: cannot write {PTH_NAME} ({exc.strerror}: {exc.filename})",
              file=sys.stderr)
        return 2
    print(f"wrote {path}: TensorRT-LLM workers started with {ENV} set install the carry")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
