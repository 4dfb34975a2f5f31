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


# ---- parallel runs (pytest-xdist: scripts/test.sh runs `-n auto --dist loadgroup`) ----------

SHARED_SERVER_FIXTURES = {"served": "triton-server"}
"""Session-scoped fixtures that start a real server, by the xdist group of every test using
them: those tests share one worker, so the server starts once (tests/serve/conftest.py's
Triton server). A file's own `served` (function or module scope) does not count."""

FIRST = ("tests/trtllm/test_trtllm_worker_install.py", "tests/test_readme_blocks.py", "dynamo",
         "triton-server", "tests/serve/test_serve_cli.py", "tests/test_progress.py",
         "tests/trtllm/test_trtllm_memory.py", "tests/trtllm/test_trtllm_fp8.py")
"""The longest groups (scripts/test.sh's `--durations`), handed out first so none is the tail."""


def _xdist_group(item: pytest.Item) -> str:
    """The worker group of `item`: its file, so module-scoped engines and servers start once;
    the Dynamo tests one group (one deployment at a time: their failover checks time
    hand-overs); the users of a shared server's session fixture that server's group."""
    path = item.nodeid.split("::", 1)[0]
    if path.startswith("tests/dynamo/"):
        return "dynamo"
    defs = getattr(item, "_fixtureinfo", None)
    for name, group in SHARED_SERVER_FIXTURES.items():
        chain = defs.name2fixturedefs.get(name, ()) if defs is not None else ()
        if chain and chain[-1].scope == "session":
            return group
    return path


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, group every test (`_xdist_group`) and put the longest groups first; a run
    without workers keeps its order and ignores the marks."""
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))

    def rank(item: pytest.Item) -> int:
        group = _xdist_group(item)
        return FIRST.index(group) if group in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: each group keeps its own order
