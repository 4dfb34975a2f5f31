"""Process-wide settings every in-process engine test relies on.

`marconi_min_tokens` and `mtp_max_seqs` are pinned for the whole process at
first use (SPEC.md), so the suite pins them once here, before any engine reads
them; tests of the pinning itself run in subprocesses or on fresh instances.
`carry_slots` is pinned to 1, the seed's single slot, so every engine test
that does not ask for more slots (`CarryRuntime(..., slots=N)`) also pins that
one slot behaves exactly as the seed did.
"""

from trtllm_mtp_carry import (
    carry_slots,
    marconi_min_tokens,
    mtp_max_seqs,
    set_carry_slots,
    set_marconi_min_tokens,
    set_mtp_max_seqs,
)

TEST_MARCONI_MIN_TOKENS = 48  # a multiple of the test engines' 16-token blocks and chunks

set_marconi_min_tokens(TEST_MARCONI_MIN_TOKENS)
set_mtp_max_seqs(1)
set_carry_slots(1)
assert marconi_min_tokens() == TEST_MARCONI_MIN_TOKENS and mtp_max_seqs() == 1 and carry_slots() == 1, (
    "run the tests without TRTLLM_MTP_CARRY_* settings pinned elsewhere"
)

# The suite's tensors are tiny: one intra-op thread avoids thread hand-off costs that
# dominate such ops (and oversubscription on a 2-core CI machine).
import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

EXECUTOR_PLACEMENT_ENV = ("TLLM_WORKER_USE_SINGLE_PROCESS", "TRTLLM_MTP_CARRY_WORKER")
"""Where a (stand-in) LLM builds its executor and whether the worker hook installs the carry.
The Triton model sets the first in `os.environ` itself, as it must before it builds its LLM."""


@pytest.fixture(autouse=True)
def _executor_placement_env_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with neither variable set and leaves them as it found them, so a
    test that builds the Triton model does not turn a later test's LLM single-process."""
    for name in EXECUTOR_PLACEMENT_ENV:
        monkeypatch.setenv(name, "")  # records the value before the test, restored at teardown
        monkeypatch.delenv(name)


# ---- parallel runs (pytest-xdist: scripts/test.sh runs `-n auto --dist loadfile`) -----------
# Each test file runs whole on one worker, so its module-scoped engines and servers start once
# (`--dist loadgroup` would also group files, but pytest-xdist 3.8 cannot mark a node id under
# pytest 9.2, whose `nodeid` no longer reads `_nodeid`: its groups are silently ignored).

FIRST = ("tests/trtllm/test_trtllm_worker_install.py", "tests/test_readme_blocks.py",
         "tests/dynamo/test_dynamo_failover.py", "tests/dynamo/test_dynamo_serving.py",
         "tests/dynamo/test_dynamo_moves.py",
         "tests/serve/test_serve_cli.py", "tests/serve/test_triton_server.py",
         "tests/serve/test_bench_client.py", "tests/serve/test_triton_faults.py",
         "tests/test_progress.py", "tests/trtllm/test_trtllm_standin_carry.py",
         "tests/engine/test_batched.py", "tests/core/test_cli.py", "tests/trtllm/test_trtllm_memory.py")
"""The longest files (`--durations`), handed out first so that none of them is the tail."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist workers, the longest files first (`FIRST`); a run without workers keeps its order."""
    if not hasattr(config, "workerinput"):
        return

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return FIRST.index(path) if path in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order
