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
carry manager bound to that build's draft manager. The carry's memory
(`trtllm/reservation.py`: `carry_memory` device bytes, `carry_host_memory` host bytes) is
reserved before any KV cache exists: the hook also wraps `try_prepare_estimation` of the
`KvCacheCreator` class the creator module builds its KV managers with (imported there by
name from `_util`; `_util.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412), which
`create_py_executor` calls first, before the estimation build; on KV cache manager V2 it
measures `mem_get_info()` there and sizes the estimation cache from it. The first
`create_py_executor_instance` builds the arenas over those bytes (or, where that wrap did
not run, reserves them itself, still before `configure_kv_cache_capacity` measures), so
the KV cache is sized around them; the second build's manager takes the same arenas over.
A carry that stands aside gives the early bytes back at that first call, before the
measurement.

Turn it on: `TRTLLM_MTP_CARRY_WORKER=<file>` (a YAML file with an `mtp_carry:`
section; `1` for the defaults) in the environment of the process that starts
TensorRT-LLM (its workers inherit it), and once per environment
`python -m trtllm_mtp_carry.trtllm.worker install`, which writes a one-line
`.pth` file into site-packages: every interpreter start runs it, and it imports
this module only when `TRTLLM_MTP_CARRY_WORKER` is set (`... worker uninstall`
removes it). With `metrics_port` in the carry file the installed carry serves
Prometheus metrics, one port per worker rank (`trtllm/metrics.py`).

Invariants:
- Nothing happens unless `TRTLLM_MTP_CARRY_WORKER` is set; the hook is installed once per process.
- The carry file is read at interpreter start (`boot`): a missing or invalid file is
  one line there (stderr and the `trtllm_mtp_carry` logger) and no hook, and
  nothing more at executor creation.
- At executor creation it prints one line: what it installed and the bytes it
  reserved, or why the carry stands aside (no room for the arenas is one such line); no
  exception of any type leaves the hook into TensorRT-LLM's executor creation (either
  wrap) or the interpreter start (an unexpected one is that one stand-aside line naming
  it, and the executor is built without the carry).
- The carry is added only on the unpaired topology (see `probe.probe_managers`).
- Under tensor parallelism the hook runs on every rank (each its own executor and head
  shard) and the ranks agree once per build, through the executor's communicator
  (`create_py_executor_instance(dist=...)`), that every rank installed with the same carry
  memory: the carry is on every rank or on none (`trtllm/lockstep.py`). Every rank must
  have `TRTLLM_MTP_CARRY_WORKER` set: a rank without the hook never joins the agreement.
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

from . import CARRY_MANAGER_KEY, _base_resource_manager
from .options import CarryOptions, TrtllmAdapterError, load_llm_options

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
_checked: dict[str, Any] = {}  # TRTLLM_MTP_CARRY_WORKER value -> its CarryOptions, or the error line


def boot() -> None:
    """What the `.pth` line runs at interpreter start: check the carry file named by
    `TRTLLM_MTP_CARRY_WORKER` and install the hook. A missing or invalid file is one line
    here, at interpreter start, and no hook (TensorRT-LLM runs as is); never raises."""
    global _installed
    value = os.environ.get(ENV)
    if not value:
        return
    try:
        if not isinstance(checked_options(value), Exception) and not _installed:
            _installed = True
            for name in (CREATOR, STANDIN_CREATOR):
                module = sys.modules.get(name)
                if module is not None:
                    wrap_creator(module)
            sys.meta_path.insert(0, _CreatorFinder())
    except Exception as exc:  # an interpreter start must never fail because of the carry
        _say(f"mtp carry: stands aside: {type(exc).__name__} at interpreter start: {exc}")


def checked_options(value: str) -> Any:
    """The `CarryOptions` of carry file `value` (`TRTLLM_MTP_CARRY_WORKER`'s value), read once
    per value; for a missing or invalid file the `TrtllmAdapterError`, whose one line
    (`mtp carry: stands aside: <why>`) is printed the first time only."""
    found = _checked.get(value)
    if found is None:
        try:
            found = _checked[value] = carry_options_from_env(value)
        except TrtllmAdapterError as exc:
            found = _checked[value] = exc
            _say(f"mtp carry: stands aside: {exc}")
    return found


def messages() -> list[str]:
    """The lines this process printed at executor creation (oldest first)."""
    return list(_messages)


def carry_options_from_env(value: str | None = None) -> Any:
    """`CarryOptions` from `TRTLLM_MTP_CARRY_WORKER` (or `value`): `1`/`true` the defaults, else a
    YAML file's `mtp_carry`. `TrtllmAdapterError` (one line) for a missing or invalid file."""
    value = os.environ.get(ENV, "") if value is None else value
    if value.lower() in ("1", "true", "yes", "on"):
        return CarryOptions()
    rest, options = load_llm_options(value)
    if rest:
        raise TrtllmAdapterError(
            f"{ENV}={value}: the file holds {sorted(rest)} besides mtp_carry; keep TensorRT-LLM's "
            "own options in their own file (LLM(**options) refuses an unknown key)")
    return options


def wrap_creator(module: ModuleType) -> None:
    """Wrap `module.create_py_executor_instance` once (TensorRT-LLM's creator or the stand-in's),
    and `try_prepare_estimation` of the `KvCacheCreator` class the module builds its KV managers
    with (absent in a build: the first `create_py_executor_instance` reserves instead)."""
    standin = module.__name__ == STANDIN_CREATOR
    original = getattr(module, "create_py_executor_instance", None)
    if original is not None and not getattr(original, _WRAPPED, False):
        module.create_py_executor_instance = _wrapped(original, standin)  # type: ignore[attr-defined]
    creator_class = getattr(module, "KvCacheCreator", None)
    prepare = getattr(creator_class, "try_prepare_estimation", None)
    if creator_class is not None and callable(prepare) and not getattr(prepare, _WRAPPED, False):
        creator_class.try_prepare_estimation = _wrapped_prepare(prepare, standin)


def _wrapped(original: Callable[..., Any], standin: bool) -> Callable[..., Any]:
    def create_py_executor_instance(*args: Any, **kwargs: Any) -> Any:
        # py_executor_creator passes keywords only (`resources=`, `start_worker=False`, ...)
        if os.environ.get(ENV):  # unset since boot: TensorRT-LLM as is
            _install(kwargs.get("resources"), standin, kwargs.get("llm_args"), kwargs.get("dist"),
                     kwargs.get("mapping"))
        return original(*args, **kwargs)

    create_py_executor_instance.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(create_py_executor_instance, _WRAPPED, True)
    return create_py_executor_instance


def _wrapped_prepare(original: Callable[..., Any], standin: bool) -> Callable[..., Any]:
    def try_prepare_estimation(creator: Any, *args: Any, **kwargs: Any) -> Any:
        # before its mem_get_info: the estimation build's V2 quota is then sized around the carry
        if os.environ.get(ENV):  # unset since boot: TensorRT-LLM as is
            _reserve_early(creator, standin)
        return original(creator, *args, **kwargs)

    try_prepare_estimation.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(try_prepare_estimation, _WRAPPED, True)
    return try_prepare_estimation


_early: list[Any] = []  # the reservation (or its failure) try_prepare_estimation made, for the next install


def _reserve_early(creator: Any, standin: bool) -> None:
    """Reserve the carry's bytes before any KV cache of this executor exists (the wrap of
    `KvCacheCreator.try_prepare_estimation`); the first `create_py_executor_instance` turns
    them into the arenas, or gives them back when the carry stands aside. A failure is kept
    for that install to report in its one line. Never raises."""
    _give_back(_drop_early())  # an executor creation that never reached its install
    try:
        from .reservation import reserve_early, torch_allocate

        options = checked_options(os.environ.get(ENV, ""))
        if isinstance(options, Exception) or not options.enable:
            return  # the install says why (or said it at interpreter start)
        import torch

        device_bytes, host = options.device_bytes(), options.host_bytes()  # one rule (RESERVE_RULE)
        if standin:  # the stand-in models a device's memory: its allocator, as torch.cuda's here
            memory = getattr(creator._llm_args, "device_memory", None)
            if memory is not None:
                _early.append(reserve_early(device_bytes, host, torch.device("cpu"),
                                            memory.allocate, memory.free))
                return
            device = torch.device("cpu")
        elif torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            return  # the install reserves where the draft pool lives
        _early.append(reserve_early(device_bytes, host, device, torch_allocate))
    except Exception as exc:  # reported by the install's one line, never raised into TensorRT-LLM
        _early.append(exc)


def _drop_early() -> Any:
    """Take the early reservation (or its failure) out; None when there is none."""
    return _early.pop() if _early else None


def _install(resources: Any, standin: bool, llm_args: Any = None, dist: Any = None,
             mapping: Any = None) -> None:
    """Add the carry manager to `resources`, or say in one line why not. Never raises: an
    unexpected exception anywhere here (the probe reading a name this build lacks, ...) is
    that one line, and the executor is built without the carry.

    Under tensor parallelism (`mapping.tp_size` > 1) every rank runs this, and every rank
    reaches one agreement at its end, whatever its own install did (`Lockstep.agree_install`
    over the executor's communicator `dist`): the carry is installed on every rank or on none,
    so no rank carries its heads alone."""
    early = _drop_early()
    manager, over_early = None, False
    details: tuple[str, ...] = ()  # what the install read where, below its line
    try:
        lockstep = _lockstep(dist, mapping)
    except Exception as exc:
        lockstep = None
        line = f"mtp carry: stands aside: {exc}"
    else:
        try:
            reserved = None
            if isinstance(resources, dict):
                # KV cache estimation builds the executor twice over one `resources` dict, tearing
                # the KV managers down and building them again in between (`create_py_executor`): a
                # carry manager from the first build holds a torn-down draft manager, never reused;
                # its arenas are: reserved before the estimation measured, they are what it measured
                old = resources.pop(CARRY_MANAGER_KEY, None)
                reserved = getattr(old, "reserved", None)
                if old is not None:
                    old.service.detach()  # its entries go; its arenas serve the new build
            if reserved is not None:
                _give_back(early)  # the first build's arenas serve: nothing of this creation's is used
                early = None
            manager, line, details, over_early = _install_checked(resources, standin, reserved, llm_args,
                                                                  early, lockstep)
        except Exception as exc:
            manager = None
            line = (f"mtp carry: stands aside: {type(exc).__name__} while installing the carry ({exc}); "
                    "the executor is built without it")
    try:
        if lockstep is not None and lockstep.active:
            manager, line = _agree_install(lockstep, manager, line)
        if manager is not None:
            resources[CARRY_MANAGER_KEY] = manager  # where extra_resource_managers go
            _say(line, details)
            if manager.options.metrics_port is not None:
                from .metrics import export_worker_metrics

                export_worker_metrics(manager, manager.options.metrics_port, report=_say)
        elif line:  # (a bad carry file said its line at interpreter start)
            _say(line, details)
    except Exception as exc:
        if isinstance(resources, dict):
            resources.pop(CARRY_MANAGER_KEY, None)
        _say(f"mtp carry: stands aside: {type(exc).__name__} while installing the carry ({exc}); "
             "the executor is built without it")
    finally:
        installed = manager is not None and isinstance(resources, dict) and resources.get(CARRY_MANAGER_KEY) is manager
        if not (installed and over_early):  # else the arenas are over those bytes now
            _give_back(early)  # the carry stood aside: before configure_kv_cache_capacity measures


def _lockstep(dist: Any, mapping: Any) -> Any:
    """The carry's agreements for this executor (`trtllm/lockstep.py`): over the executor's own
    communicator `dist` (`create_py_executor_instance(dist=...)`, `Distributed.get(mapping)`) at
    `mapping.tp_size` > 1, else the single-rank lockstep (no collective). TrtllmAdapterError
    when a tensor-parallel executor gives no usable communicator."""
    from .lockstep import Lockstep

    tp = 1 if mapping is None else getattr(mapping, "tp_size", 1)
    if tp == 1:
        return Lockstep.single()
    if not callable(getattr(dist, "tp_allgather", None)):
        raise TrtllmAdapterError(f"tensor parallel size {tp}: the executor gives the carry no communicator "
                                 f"with tp_allgather ({type(dist).__name__}): no rank can agree with the others")
    return Lockstep(dist, int(tp), int(mapping.tp_rank))


def _agree_install(lockstep: Any, manager: Any, line: str) -> tuple[Any, str]:
    """Every tensor-parallel rank installs or none does, with the same carry memory: one
    agreement, reached by every rank whatever its own install did."""
    reserved = getattr(manager, "reserved", None)
    device = 0 if reserved is None else reserved.device.nbytes
    host = 0 if reserved is None or reserved.host is None else reserved.host.nbytes
    oks, same = lockstep.agree_install(manager is not None, device, host)
    if all(oks) and same:
        return manager, f"{line}; rank {lockstep.tp_rank} of {lockstep.tp_size}, decisions in lockstep"
    if manager is not None:
        manager.service.detach()
    if not all(oks):
        ranks = ", ".join(str(r) for r, ok in enumerate(oks) if not ok)
        why = f"tensor-parallel rank(s) {ranks} of {lockstep.tp_size} could not install it (their line says why)"
    else:
        why = (f"the {lockstep.tp_size} tensor-parallel ranks reserved different carry memory (give every "
               "rank the same carry file)")
    return None, (f"mtp carry: stands aside: {why}: every rank stands aside, so none carries its shard of "
                  f"the heads alone" if manager is not None else line)


def _give_back(early: Any) -> None:
    """Release an early reservation the carry will not use. Never raises (it runs inside
    TensorRT-LLM's executor creation): a failure is one line."""
    try:
        from .reservation import EarlyReservation

        if isinstance(early, EarlyReservation):
            early.release()
    except Exception as exc:
        _say(f"mtp carry: {type(exc).__name__} while giving back the carry's reserved bytes ({exc})")


def _install_checked(resources: Any, standin: bool, reserved: Any = None, llm_args: Any = None,
                     early: Any = None, lockstep: Any = None) -> tuple[Any, str, tuple[str, ...], bool]:
    """Build the carry manager (not yet in `resources`), the line that says so and its details
    (what was read where), or None and the line saying why the carry stands aside; the flag is
    True when the arenas were built over `early`."""
    from .manager import carry_manager_class
    from .probe import probe_managers
    from .reservation import EarlyReservation, arenas_over, reserve_for, torch_allocate
    from .verdict import carry_options_verdict

    try:
        if not isinstance(resources, dict):
            raise TrtllmAdapterError(
                "create_py_executor_instance was called without a resources= dict: this "
                "TensorRT-LLM build is not one the worker hook was written against")
        options = checked_options(os.environ.get(ENV, ""))
        if isinstance(options, Exception):  # its one line was printed when the file was first read
            return None, "", (), False
        version = "stand-in" if standin else _trtllm_version()
        # the carry's own options first, then the executor: the order `info --llm-config` judges in
        # (trtllm/verdict.py), so both give the same reason
        own = carry_options_verdict(options)
        if own is not None:
            return None, f"mtp carry: stands aside: {own.reason}", own.details, False
        # `llm_args` (TorchLlmArgs): speculative_config, cache_transceiver_config and
        # kv_cache_compression_config, read as the creator reads them (probe.llm_args_facts)
        probe = probe_managers(resources, version, llm_args=llm_args)
        if not probe.runnable:
            return None, f"mtp carry: stands aside: {probe.reason}", probe.details, False
        assert probe.draft is not None and probe.mtp_layer is not None
        base = _base_resource_manager(probe.draft)
        over_early = False
        if reserved is None:  # the first build: before configure_kv_cache_capacity measures
            if isinstance(early, BaseException):
                raise early  # try_prepare_estimation could not reserve: nor could this, later
            if isinstance(early, EarlyReservation):
                from ..core import carry_row_dtype
                from .draft_pages import pages_of

                pages = pages_of(probe.draft, probe.mtp_layer)  # a QSA pool's rows carry side rows
                row_dtype = options.carry_row_dtype or carry_row_dtype()
                reserved = arenas_over(early, pages.kv(), row_dtype, pages.codec(row_dtype))
                over_early = reserved is not None
                if not over_early:
                    early.release()  # on another device than the draft pool: before reserving there
            if reserved is None:  # no early reservation (or on another device): reserve now
                # (the stand-in models a device's memory: its allocator, as torch.cuda's here)
                standin_args = llm_args  # the stand-in's own args: its modelled device
                memory = getattr(standin_args, "device_memory", None) if standin else None
                reserved = reserve_for(probe.draft, probe.mtp_layer, options,
                                       torch_allocate if memory is None else memory.allocate)
        else:
            reserved.release_entries()
        manager = carry_manager_class(base)(probe.draft, probe.mtp_layer, options, report=_say,
                                            reserved=reserved, lockstep=lockstep)
        from ..dataplane.warm import warm_manager_kernels

        warm_manager_kernels(manager)  # no Triton compile inside a timed turn
        return manager, (f"mtp carry: installed in the worker's PyExecutor as {CARRY_MANAGER_KEY} "
                         f"(TensorRT-LLM {version}, MTP layer {probe.mtp_layer}, "
                         f"tokens_per_block {probe.tokens_per_block}): {probe.reason}; {reserved.line()}"), \
            probe.details, over_early
    except TrtllmAdapterError as exc:  # the early bytes (if any) go back with the carry that stands aside
        return None, f"mtp carry: stands aside: {exc}", (), False


def _trtllm_version() -> str:
    module = sys.modules.get("tensorrt_llm")
    return str(getattr(module, "__version__", "unknown"))


def _say(line: str, details: Sequence[str] = ()) -> None:
    """One line (the verdict first); `details` (what was read where) follow it in the log only,
    `mtp carry:   `-indented, so a reader of the first line alone has the whole verdict."""
    _messages.append(line)
    logger.info("%s", line)
    for detail in details:
        logger.info("mtp carry:   %s", detail)
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


def uninstall_pth(site_dir: str | Path | None = None) -> Path | None:
    """Remove the `.pth` line from `site_dir` (default: this interpreter's site-packages); the
    file goes when nothing else is left in it. Returns the file, or None if it held no line of ours."""
    pth = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME
    try:
        lines = pth.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return None
    rest = [line for line in lines if line.strip() != PTH_LINE.strip()]
    if len(rest) == len(lines):
        return None
    if any(line.strip() for line in rest):
        pth.write_text("".join(rest))
    else:
        pth.unlink()
    return pth


USAGE = "usage: python -m trtllm_mtp_carry.trtllm.worker {install,uninstall} [SITE_DIR]"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trtllm_mtp_carry.trtllm.worker install|uninstall [SITE_DIR]`: write or remove the `.pth` line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("install", "uninstall") or len(args) > 2:
        got = f"got {' '.join(args)!r}" if args else "no command given"
        print(f"trtllm-mtp-carry: error: {got}; {USAGE}", file=sys.stderr)
        return 2
    site_dir = args[1] if len(args) == 2 else None
    if site_dir is not None and not Path(site_dir).is_dir():
        print(f"trtllm-mtp-carry: error: SITE_DIR {site_dir!r} is not a directory", file=sys.stderr)
        return 2
    try:
        if args[0] == "install":
            path = install_pth(site_dir)
            print(f"wrote {path}: TensorRT-LLM workers started with {ENV} set install the carry")
            return 0
        removed = uninstall_pth(site_dir)
    except OSError as exc:
        print(f"trtllm-mtp-carry: error: cannot {args[0]} {PTH_NAME} ({exc.strerror}: {exc.filename})",
              file=sys.stderr)
        return 2
    where = site_dir or sysconfig.get_paths()["purelib"]
    print(f"removed the carry's line from {removed}: TensorRT-LLM workers start without the hook"
          if removed is not None else f"no {PTH_NAME} line in {where}: nothing to remove")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
