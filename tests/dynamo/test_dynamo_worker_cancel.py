"""The carry worker's `generate` with Dynamo's real request context, in process (no deployment).

Pins (issue 45): a request whose context the frontend already stopped when it arrives is
never queued (no engine turn, no carry decision) and counts once as
`mtp_carry_outcomes_total{kind="cancelled"}`; a live one runs and counts by its outcome kind.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.common") is None,
    reason='Dynamo is not installed (pip install -e ".[dynamo]" && pip install --no-deps ai-dynamo==1.6.1)')


def _outcomes(page: str) -> dict[str, float]:
    return {re.search(r'kind="([^"]+)"', ln).group(1): float(ln.rsplit(" ", 1)[1])  # type: ignore[union-attr]
            for ln in page.splitlines() if ln.startswith("mtp_carry_outcomes_total{")}


def test_a_request_stopped_before_it_arrives_is_never_queued_and_counts_once_as_cancelled(tmp_path) -> None:
    from dynamo._core import Context

    from trtllm_mtp_carry.serve.dynamo.worker import CarryWorker

    async def scenario() -> tuple[list, list, dict[str, float], dict[str, int]]:
        worker, _ = await CarryWorker.from_args(["--model-dir", str(tmp_path / "model"), "--max-tokens", "4"])
        await worker.start(7)
        try:
            prompt = worker.engine.tokenizer.render_chat([{"role": "user", "content": "hello there"}])
            request = {"token_ids": prompt, "stop_conditions": {"max_tokens": 4},
                       "agent_context": {"session_id": "s1"}}
            gone = Context()
            gone.stop_generating()  # the frontend gave up on it before it got here
            stopped = [chunk async for chunk in worker.generate(dict(request), gone)]
            live = [chunk async for chunk in worker.generate(dict(request), Context())]
            return stopped, live, _outcomes(worker._exposition()), dict(worker.engine.runtime.stats().outcomes)
        finally:
            await worker.cleanup()

    stopped, live, outcomes, runtime = asyncio.run(scenario())
    assert stopped == [{"token_ids": [], "index": 0, "finish_reason": "cancelled"}]
    assert live[-1]["finish_reason"] in ("stop", "length")
    kind = live[-1]["engine_data"]["mtp_carry"]["outcome_kind"]
    assert outcomes == {"cancelled": 1.0, kind: 1.0}  # each request once; the stopped one never ran
    assert {k: v for k, v in runtime.items() if v} == {kind: 1}  # the runtime decided for the live one only
