"""The reference engine's per-chunk prompt upload makes no host-device sync (issue 42, item 4).

`torch.tensor(prompt[start:end], device=cuda)` copies from pageable memory and waits for the
stream, so every prefill chunk after the first waited for the previous chunk's drafter rows
(billing their GPU time to this chunk's forward); the upload goes pinned and non-blocking
(`device_tensor`). Counted on CPU by `sync_trace.SyncTrace`, over every prefill chunk but its
last (whose first-token read is the turn's one wanted sync).
"""

from __future__ import annotations

import torch
from engine_factories import engine, first_turn_then, tiny_model
from sync_trace import SyncTrace, patch_uploads


def test_no_prefill_chunk_uploads_its_prompt_tokens_with_a_sync(monkeypatch):
    model = tiny_model()
    eng = engine(model, policy="carry", prefill_chunk=32)
    gen = torch.Generator().manual_seed(3)
    _, _, prompt = first_turn_then(eng, gen, "s", history=150, max_new_tokens=6, span=70)
    trace = SyncTrace([eng.drafter_pool.k_cache, eng.drafter_pool.v_cache, eng.hidden_store.buffer,
                       *eng.target_kv.k.values(), *eng.target_kv.v.values(), *model.parameters(),
                       *model.buffers()])
    active: list[SyncTrace | None] = [None]
    uploads = patch_uploads(monkeypatch, lambda: active[0])
    real = eng._prefill_chunk
    chunks: list[dict] = []

    def traced(seq):
        if seq.kv.num_tokens // 32 + 1 >= -(-len(seq.prompt) // 32):  # the last chunk: not traced
            return real(seq)
        active[0] = trace
        try:
            with trace:
                real(seq)
        finally:
            active[0] = None
        chunks.append(dict(trace.syncs))

    monkeypatch.setattr(eng, "_prefill_chunk", traced)
    result = eng.generate("s", prompt, max_new_tokens=4)
    assert result.stats.reused_tokens > 0 and len(chunks) >= 2
    engine_syncs = {k: n for k, n in trace.syncs.items() if k[1].startswith("engine/engine.py")}
    assert engine_syncs == {}
    assert [site.split(":")[0] for site in uploads if "_prefill_chunk" in site] == ["engine/engine.py"]


def test_on_cuda_the_drafter_prep_is_the_gpu_time_between_events_around_each_prep_call(monkeypatch):
    from trtllm_mtp_carry.engine import engine as engine_module

    log: list[str] = []

    class Event:
        made = 0

        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            Event.made += 1
            self.n = Event.made

        def record(self) -> None:
            log.append(f"record {self.n}")

        def synchronize(self) -> None:
            log.append(f"synchronize {self.n}")

        def elapsed_time(self, end) -> float:
            return {(1, 2): 1.25, (3, 4): 2.5}[(self.n, end.n)]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = engine_module._PrepClock(torch.device("cuda", 0))
    for _ in range(2):
        with clock.span():
            log.append("prep")
    assert clock.ms(cpu_ms=99.0) == 3.75  # the GPU's, not the CPU's
    assert log == ["record 1", "prep", "record 2", "record 3", "prep", "record 4", "synchronize 4"]
    assert engine_module._PrepClock(torch.device("cpu")).ms(cpu_ms=99.0) == 99.0
