"""The carry's options (an `mtp_carry:` section), parsed strictly.

What it is for: a user turns the carry on and sizes it. Where the section lives
depends on the front end (docs/CONFIGURATION.md): for the worker-process
install (the default `LLM(...)`, `trtllm-serve`, Dynamo) it is a file of its
own (`carry.yaml`, named by `TRTLLM_MTP_CARRY_WORKER`), never TensorRT-LLM's
options file; for `attach(llm, options)` a dict; for the Triton model
(`triton-repo --engine trtllm --llm-options`) a section of the one YAML the
model splits before `LLM(**rest)`, as below:

```yaml
speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 3}   # 3 drafts a step; a separate draft pool
kv_cache_config:
  enable_block_reuse: true        # overrides Qwen3-Next's default (off); without it nothing is reused
  mamba_state_config:             # the hybrid target reuses a prefix only at its snapshot points:
    additional_snapshot_offsets_from_end: [0]   # one at each prompt's end (RECOMMENDED_KV_CACHE_CONFIG)
  use_kv_cache_manager_v2: true   # V2 only ('auto' resolves to V2 for Qwen3-Next)
  dtype: auto                     # BF16 KV (fp8, nvfp4: carried as the pool's own bytes: kv_formats.py)
  block_reuse_config: {policy: per_conversation, max_num_turns: 2}
mtp_carry: {enable: true, carry_memory: 2GiB, carry_host_memory: 8GiB, carry_row_dtype: fp8}
# and: tensor_parallel_size 1, enable_attention_dp false, no kv_connector_config (V2 refuses one),
# the worker-process install (TRTLLM_MTP_CARRY_WORKER, below) for the default LLM, trtllm-serve, Dynamo
```

Where the section is read: for the default `LLM(...)`, `trtllm-serve` and
Dynamo's `dynamo.trtllm` (each builds the PyExecutor in a worker process), the
worker-process install reads it: `TRTLLM_MTP_CARRY_WORKER=<this YAML file>` in
the environment of the process that starts TensorRT-LLM (`trtllm/worker.py`,
after `python -m trtllm_mtp_carry.trtllm.worker install` once per
environment). Only `attach(llm, options)`, the in-process path, needs
`TLLM_WORKER_USE_SINGLE_PROCESS=1` in the environment before the first LLM is
built (TP=1), so that `llm._executor.engine` is the executor.

`split_carry_options` takes the section out and parses it, so the rest can go
to `LLM(**rest)` unchanged (TensorRT-LLM would refuse an unknown keyword).

Invariants:
- Every bad key or value is one `TrtllmAdapterError` line naming the key
  (`mtp_carry.<key>`) and the value; nothing is silently defaulted.
- Pure Python: no torch, no tensorrt_llm (PyYAML, a base dependency, is imported only to read a file).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.row_format import ROW_DTYPES

SECTION = "mtp_carry"
"""The key of the carry's section in `extra_llm_api_options`."""

DEFAULT_CARRY_MEMORY = 1 << 30
"""Default budget for carried rows inside TensorRT-LLM: 1 GiB, where neither `mtp_carry.carry_memory`
nor the process setting (`--carry-memory`, env `TRTLLM_MTP_CARRY_MEMORY`) gives bytes. One
carried row of the MTP layer is `2 * kv_heads * head_dim * 2` bytes (2 KiB for Qwen3-Next: 2 KV
heads of 256), so 1 GiB holds about 512k rows, e.g. 16 sessions of 32k tokens."""

RESERVE_RULE = ("each: mtp_carry.carry_memory / carry_host_memory, else the setting above "
                "(flag, env), else 1GiB / no host tier")
"""How the carry inside TensorRT-LLM sizes its two arenas (`CarryOptions.device_bytes`,
`host_bytes`): one rule for both, as `info` states it on the reservation line."""

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


class TrtllmAdapterError(ValueError):
    """The TensorRT-LLM adapter refused an option or an executor; the message is one line saying why."""


@dataclass(frozen=True, slots=True)
class CarryOptions:
    """What the user configured for the carry inside TensorRT-LLM.

    `enable`: whether the carry is configured (it is armed only where the
    executor allows it, see `CarryAttachment.armed`); `carry_slots`: at most
    this many sessions' rows are kept (least recently deposited leaves first;
    None: the process setting `carry_slots()`, env `TRTLLM_MTP_CARRY_SLOTS`, else no cap);
    `carry_memory`: at most this many bytes of carried rows (oldest entries are
    evicted as `pool_pressure` to stay under it; None: the process setting
    `carry_memory()` (flag or env `TRTLLM_MTP_CARRY_MEMORY`) when it is bytes, otherwise
    `DEFAULT_CARRY_MEMORY`: `device_bytes()`); `carry_host_memory`: bytes of host
    memory (pinned on a discrete GPU; on GB10's unified memory, system memory outside
    TensorRT-LLM's KV pool) where entries leaving `carry_memory` wait for their
    session (0: none; None: the process setting `carry_host_memory()`, env
    `TRTLLM_MTP_CARRY_HOST_MEMORY`, else 0); `carry_row_dtype`: how carried rows are
    stored, `bf16`, `fp8` (e4m3, one float32 scale per row, K/V and head: about half
    the bytes, so `carry_memory` holds about twice the sessions) or `nvfp4` (e2m1 with
    e4m3 block scales: about 0.28 of the bytes), or None: the process setting
    `carry_row_dtype()` (env `TRTLLM_MTP_CARRY_ROW_DTYPE`, else bf16); `stats_every`: every this many freed
    requests, and at shutdown, the carry prints one line of its counters (0: never),
    the way to see what a carry installed in a worker process does; `metrics_port`: a
    worker-installed carry serves its counters as Prometheus metrics on
    `http://<host>:<metrics_port + rank>/metrics`, rank the worker's `Mapping.rank`
    (None: no metrics endpoint; see `trtllm/metrics.py`).
    """

    enable: bool = True
    carry_slots: int | None = None
    carry_memory: int | None = None
    carry_host_memory: int | None = None
    stats_every: int = 0
    carry_row_dtype: str | None = None
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        _check_bool("enable", self.enable)
        if self.carry_slots is not None:
            _check_int("carry_slots", self.carry_slots, minimum=1)
        if self.carry_memory is not None:
            _check_int("carry_memory", self.carry_memory, minimum=0)
        if self.carry_host_memory is not None:
            _check_int("carry_host_memory", self.carry_host_memory, minimum=0)
        _check_int("stats_every", self.stats_every, minimum=0)
        if self.carry_row_dtype is not None:
            if self.carry_row_dtype not in ROW_DTYPES:
                raise TrtllmAdapterError(f"{SECTION}.carry_row_dtype must be one of {', '.join(ROW_DTYPES)}, "
                                         f"got {self.carry_row_dtype!r}")
        if self.metrics_port is not None:
            _check_int("metrics_port", self.metrics_port, minimum=1)
            if self.metrics_port > 65535:
                raise TrtllmAdapterError(f"{SECTION}.metrics_port must be <= 65535, got {self.metrics_port}")

    def device_bytes(self) -> int:
        """The device arena's bytes (`RESERVE_RULE`): `carry_memory`, else the process setting
        `carry_memory()` (flag, env `TRTLLM_MTP_CARRY_MEMORY`) when it is bytes, else
        `DEFAULT_CARRY_MEMORY`. The process default, the whole drafter pool, is a fraction with no
        pool to apply it to (the arena is reserved before TensorRT-LLM sizes its pools); a
        fraction set by flag or env is one `TrtllmAdapterError` line. Reading pins the setting."""
        if self.carry_memory is not None:
            return self.carry_memory
        from ..core import settings

        memory = settings.carry_memory()
        if memory.nbytes is not None:
            return memory.nbytes
        if memory.fraction == 0:
            return 0  # 0 of any pool is 0 bytes (`--carry-memory 0`): no unit needed to say so
        if settings.CARRY_MEMORY.source != "default":
            raise TrtllmAdapterError(
                f"carry_memory={memory} ({settings.CARRY_MEMORY.source}): the carry inside TensorRT-LLM "
                "reserves bytes, before TensorRT-LLM sizes its pools; give bytes (e.g. 1GiB) there "
                f"or in {SECTION}.carry_memory")
        return DEFAULT_CARRY_MEMORY

    def host_bytes(self) -> int:
        """The host arena's bytes (`RESERVE_RULE`): `carry_host_memory`, else the process setting
        `carry_host_memory()` (flag, env `TRTLLM_MTP_CARRY_HOST_MEMORY`), else 0 (no host tier)."""
        if self.carry_host_memory is not None:
            return self.carry_host_memory
        from ..core import carry_host_memory

        return carry_host_memory()


MAMBA_STATE_FIELDS = ("periodic_snapshot_interval", "additional_snapshot_offsets_from_start",
                      "additional_snapshot_offsets_from_end", "enable_branch_snapshot")
"""`kv_cache_config.mamba_state_config`'s fields (TensorRT-LLM's `MambaStateConfig`: the snapshot
placement; docs/TRTLLM-CONFORMANCE.md), in the versions that have them."""

RECOMMENDED_SNAPSHOT_PLACEMENT: dict[str, Any] = {"additional_snapshot_offsets_from_end": [0]}
"""The `kv_cache_config.mamba_state_config` a multi-turn chat should use (DECISIONS.md
"Snapshot placement"): one recurrent-state snapshot at each prompt's end, so the next
turn of the conversation reuses exactly the previous turn's prompt (R = its length)."""

RECOMMENDED_KV_CACHE_CONFIG: dict[str, Any] = {
    "enable_block_reuse": True, "mamba_state_config": RECOMMENDED_SNAPSHOT_PLACEMENT}
"""The `kv_cache_config` keys the carry needs on a hybrid target: block reuse on (Qwen3-Next's
model default is off) and the recommended snapshot placement. Every example configuration
the package writes or shows carries them."""

BLOCK_REUSE_POLICIES = ("all_reusable", "per_request", "per_conversation")
"""`kv_cache_config.block_reuse_config.policy`'s values (TensorRT-LLM's `BlockReuseConfig`,
`llm_args.py` @ 0004396; default `all_reusable`)."""



def interval_after_validator(policy: str, interval: int) -> int:
    """`mamba_state_config.periodic_snapshot_interval` as TensorRT-LLM's `KvCacheConfig` validator
    `disable_periodic_mamba_snapshots_for_conversations` leaves it (`llm_args.py` @ 0004396): 0
    under policy `per_conversation`, else as set. The one place the package plays that validator
    (`kv_cache_config_of`, `reuse_stand_aside`, the stand-in's `KvCacheConfig`)."""
    return 0 if policy == "per_conversation" else interval


SNAPSHOT_FIX = ("set kv_cache_config.mamba_state_config.additional_snapshot_offsets_from_end: [0] "
                "(a snapshot at each prompt's end)")
REUSE_FIX = "set kv_cache_config.enable_block_reuse: true"


def reuse_stand_aside(enable_block_reuse: bool, hybrid: bool, state: Mapping[str, Any] | None,
                      offsets_supported: bool = True, policy: str = "all_reusable") -> str | None:
    """Why a target with this reuse configuration can never reuse a prefix (one line naming what to
    set), or None when it can.

    `state` is `kv_cache_config.mamba_state_config` (its four fields; missing ones take
    TensorRT-LLM's defaults: interval 0, no offsets, no branch snapshot); `hybrid`: the
    target is a hybrid (recurrent-state) manager, which reuses only at snapshot points;
    `offsets_supported`: the manager class honours the start/end offsets
    (`_supports_additional_snapshot_offsets`, True on the V2 hybrid manager); `policy`:
    `kv_cache_config.block_reuse_config.policy`. TensorRT-LLM's validator
    `disable_periodic_mamba_snapshots_for_conversations` (`llm_args.py` @ 0004396) sets the
    periodic interval to 0 under `per_conversation`, so the interval counts only under the
    other policies, and under `per_conversation` the line says the policy turns it off (whether
    or not one was set: the worker's executor sees the config after the validator).
    """
    if not enable_block_reuse:
        fix = REUSE_FIX + (f" and {SNAPSHOT_FIX[4:]}" if hybrid else "")
        return ("block reuse is off (kv_cache_config.enable_block_reuse): no prefix is ever reused, "
                f"so there is nothing to carry; {fix}")
    if not hybrid:
        return None
    state = state or {}
    set_interval = state.get("periodic_snapshot_interval") or 0
    interval = interval_after_validator(policy, set_interval)
    offsets = bool(state.get("additional_snapshot_offsets_from_start")) or bool(
        state.get("additional_snapshot_offsets_from_end"))
    if interval > 0 or (offsets and offsets_supported) or state.get("enable_branch_snapshot"):
        return None
    # the worker's executor holds the config after the validator: it cannot see an interval the
    # validator set to 0, so under per_conversation both say what the policy does
    why = ("kv_cache_config.mamba_state_config sets none" if policy != "per_conversation" else
           "kv_cache_config.block_reuse_config.policy per_conversation turns "
           "mamba_state_config.periodic_snapshot_interval off, and no other placement is set")
    return (f"the hybrid target keeps no snapshot point ({why}): "
            f"no prefix is ever reused, so there is nothing to carry; {SNAPSHOT_FIX}")


def kv_cache_config_of(options: Mapping[str, Any]) -> dict[str, Any]:
    """The `kv_cache_config` an `llm.yaml` gives a Qwen3-Next model, as the worker's executor will
    hold it: its keys over the model's defaults (`get_model_defaults`: `enable_block_reuse` False;
    values the user sets win), `block_reuse_config` with TensorRT-LLM's defaults (`policy`
    `all_reusable`, `max_num_turns` 1), and the validator `disable_periodic_mamba_snapshots_for_
    conversations` applied (`llm_args.py` @ 0004396: under `per_conversation` the periodic
    interval is 0). TrtllmAdapterError (one line naming the value) when a section is not a
    mapping or the policy is not one of `BLOCK_REUSE_POLICIES`. `ignored` holds the
    `mamba_state_config` fields the validator reset, with the values the user set."""
    kv = options.get("kv_cache_config") or {}
    if not isinstance(kv, Mapping):
        raise TrtllmAdapterError(f"kv_cache_config must be a mapping, got {kv!r}")
    state = kv.get("mamba_state_config") or {}
    if not isinstance(state, Mapping):
        raise TrtllmAdapterError(f"kv_cache_config.mamba_state_config must be a mapping, got {state!r}")
    reuse = kv.get("block_reuse_config") or {}
    if not isinstance(reuse, Mapping):
        raise TrtllmAdapterError(f"kv_cache_config.block_reuse_config must be a mapping, got {reuse!r}")
    policy = reuse.get("policy", "all_reusable")
    if policy not in BLOCK_REUSE_POLICIES:
        raise TrtllmAdapterError(f"kv_cache_config.block_reuse_config.policy must be one of "
                                 f"{', '.join(BLOCK_REUSE_POLICIES)}, got {policy!r}")
    state = dict(state)
    ignored: dict[str, Any] = {}  # what the validator reset, as the user set it
    interval = state.get("periodic_snapshot_interval")
    if interval and interval_after_validator(policy, interval) != interval:  # the validator reset it
        ignored["periodic_snapshot_interval"] = interval
        state["periodic_snapshot_interval"] = interval_after_validator(policy, interval)
    return {"enable_block_reuse": bool(kv.get("enable_block_reuse", False)), "mamba_state_config": state,
            "block_reuse_config": {"policy": policy, "max_num_turns": reuse.get("max_num_turns", 1)},
            "ignored": ignored}


def parse_carry_options(mapping: Mapping[str, Any] | None) -> CarryOptions:
    """`CarryOptions` from the `mtp_carry` section (None: the defaults).

    Keys: `enable` (bool), `carry_slots` (int >= 1, or null for `carry_slots()`), `carry_memory` (bytes as an
    int >= 0, or a string such as `"512MiB"`, `"2GiB"`; fractions are refused), `carry_host_memory`
    (bytes like `carry_memory`, or null for `carry_host_memory()`), `carry_row_dtype` (`bf16`, `fp8`,
    `nvfp4`, or null for `carry_row_dtype()`), `stats_every` (int >= 0),
    `metrics_port` (an int in [1, 65535], or null: no metrics endpoint).
    An unknown key, a wrong type or a bad value raises `TrtllmAdapterError`
    naming `mtp_carry.<key>`.
    """
    if mapping is None:
        return CarryOptions()
    if isinstance(mapping, CarryOptions):
        return mapping
    if not isinstance(mapping, Mapping):
        raise TrtllmAdapterError(
            f"{SECTION} must be a mapping of enable/carry_slots/carry_memory/carry_host_memory/carry_row_dtype/"
            "stats_every/metrics_port, "
            f"got {mapping!r}")
    fields = {"enable", "carry_slots", "carry_memory", "carry_host_memory", "carry_row_dtype", "stats_every",
              "metrics_port"}
    for key in mapping:
        if key not in fields:
            raise TrtllmAdapterError(
                f"{SECTION}.{key}: unknown key (known: {', '.join(sorted(fields))})")
    values: dict[str, Any] = dict(mapping)
    if "carry_memory" in values:
        values["carry_memory"] = parse_size("carry_memory", values["carry_memory"])
    if values.get("carry_host_memory") is not None:
        values["carry_host_memory"] = parse_size("carry_host_memory", values["carry_host_memory"])
    return CarryOptions(**values)


def parse_size(key: str, value: object) -> int:
    """Bytes from an int >= 0 or a string `<digits>[B|KB|KiB|MB|MiB|GB|GiB]`; errors name `key`."""
    if isinstance(value, str):
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise TrtllmAdapterError(
                f"{SECTION}.{key}: {value!r} is not a size (an int of bytes, or e.g. '512MiB', '2GiB')")
        return int(m.group(1)) * _UNITS[unit]
    return _check_int(key, value, minimum=0)


def split_carry_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], CarryOptions]:
    """`(the LLM(**kwargs) options without mtp_carry, the parsed CarryOptions)` of an
    `extra_llm_api_options` mapping (None: no options, the default CarryOptions)."""
    if options is None:
        return {}, CarryOptions()
    if not isinstance(options, Mapping):
        raise TrtllmAdapterError(f"extra_llm_api_options must be a mapping, got {options!r}")
    rest = {k: v for k, v in options.items() if k != SECTION}
    return rest, parse_carry_options(options.get(SECTION))


def load_llm_options(path: str | Path) -> tuple[dict[str, Any], CarryOptions]:
    """`split_carry_options` of an `extra_llm_api_options` YAML file (PyYAML ships with tensorrt_llm)."""
    try:
        import yaml
    except ImportError as exc:
        raise TrtllmAdapterError(
            f"reading {path} needs PyYAML, a dependency of trtllm-mtp-carry that is missing here: "
            "pip install pyyaml") from exc
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TrtllmAdapterError(f"cannot read extra_llm_api_options {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TrtllmAdapterError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    return split_carry_options({} if data is None else data)


def _check_bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TrtllmAdapterError(f"{SECTION}.{key} must be true or false, got {value!r}")
    return value


def _check_int(key: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TrtllmAdapterError(f"{SECTION}.{key} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise TrtllmAdapterError(f"{SECTION}.{key} must be >= {minimum}, got {value}")
    return int(value)
