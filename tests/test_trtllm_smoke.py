"""scripts/trtllm_smoke.py here, without TensorRT-LLM: its arguments, its clean refusal, its pure parts.

The script itself needs TensorRT-LLM and a GPU and has not been run by this
project; what is pinned here is that it parses its arguments, exits 2 with one
line naming the `trtllm` extra, and that its verdicts and its recomputation of
the MTP rows (slicing K and V out of qkv, RoPE at the given positions) compute
what they say.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trtllm_smoke.py"


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("trtllm_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["trtllm_smoke"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("trtllm_smoke", None)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_without_tensorrt_llm_it_exits_2_with_one_line_naming_the_extra():
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed here")
    p = run("--model", "/ckpt/qwen3-next", "--conversations", "4")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == ('trtllm_smoke.py: error: TensorRT-LLM is not installed: pip install '
                        '"trtllm-mtp-carry[trtllm]" (on a machine with an NVIDIA GPU)\n')


def test_help_lists_the_checks_and_a_missing_model_is_a_usage_error():
    assert run("--help").returncode == 0
    p = run()
    assert p.returncode == 2 and "the following arguments are required: --model" in p.stderr


def test_arguments_default_to_the_claims_workload(smoke):
    args = smoke.parse_args(["--model", "/m"])
    assert (args.conversations, args.turns, args.max_draft_len) == (32, 3, 3)
    assert args.modes == ["off", "rebuild", "blind", "carry"]
    assert smoke.parse_args(["--model", "/m", "--modes", "carry, off"]).modes == ["off", "carry"]


@pytest.mark.parametrize("argv, message", [
    (["--conversations", "0"], "argument --conversations: must be >= 1, got 0"),
    (["--kv-fraction", "1.5"], "argument --kv-fraction: must be in (0, 1), got 1.5"),
    (["--modes", "carry,fast"], "--modes must name some of off, rebuild, blind, carry, got 'carry,fast'"),
    (["--llm-options", "/no/such.yaml"], "--llm-options /no/such.yaml: not a file"),
])
def test_bad_arguments_exit_2_naming_them(smoke, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        smoke.parse_args(["--model", "/m", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_workload_has_distinct_conversations_of_the_asked_turns(smoke):
    convs = smoke.conversations(45, 3, 100)
    assert len(convs) == 45 and {len(c) for c in convs} == {3}
    assert len({c[0] for c in convs}) == 45  # no two conversations share a first message


def test_rope_rotates_the_rotary_features_by_position_and_leaves_the_rest(smoke):
    x = torch.zeros(3, 1, 4)
    x[:, 0, 0] = 1.0  # first rotary feature; rotary_dim 2 -> one frequency, 1.0 rad per position
    x[:, 0, 3] = 5.0  # a non-rotary feature
    y = smoke.rope_neox(x, torch.tensor([0, 1, 2]), rotary_dim=2, theta=10000.0)
    p = torch.tensor([0.0, 1.0, 2.0])
    assert torch.allclose(y[:, 0, 0], torch.cos(p)) and torch.allclose(y[:, 0, 1], torch.sin(p))
    assert torch.equal(y[:, 0, 3], torch.full((3,), 5.0)) and torch.equal(y[:, 0, 2], torch.zeros(3))


def test_the_recomputed_mtp_rows_are_k_and_v_sliced_from_qkv_and_roped_at_the_positions(smoke):
    torch.manual_seed(0)
    hidden, heads, dim, kv_heads = 8, 2, 4, 1
    cfg = SimpleNamespace(num_hidden_layers=2, head_dim=dim, num_attention_heads=heads, hidden_size=hidden,
                          num_key_value_heads=kv_heads, partial_rotary_factor=0.5, rope_theta=100.0)
    q_size, kv_size = heads * dim * 2, kv_heads * dim  # gated attention: q and its gate come first
    mtp = SimpleNamespace(fc=torch.nn.Linear(2 * hidden, hidden, bias=False),
                          pre_fc_norm_embedding=torch.nn.Identity(), pre_fc_norm_hidden=torch.nn.Identity(),
                          input_layernorm=torch.nn.Identity(),
                          self_attn=SimpleNamespace(qkv_proj=torch.nn.Linear(hidden, q_size + 2 * kv_size,
                                                                             bias=False),
                                                    k_norm=torch.nn.Identity()))
    model = SimpleNamespace(config=cfg, draft_model=SimpleNamespace(mtp_layers=[mtp]),
                            model=SimpleNamespace(embed_tokens=torch.nn.Embedding(16, hidden)))
    h, ids = torch.randn(5, hidden), torch.tensor([3, 1, 4, 1, 5])
    k, k_roped, v = smoke.recompute_mtp_kv(model, h, ids, torch.arange(5))
    with torch.no_grad():
        qkv = mtp.self_attn.qkv_proj(mtp.fc(torch.cat([model.model.embed_tokens(ids), h], -1)))
    assert torch.allclose(k, qkv[:, q_size:q_size + kv_size].reshape(5, kv_heads, dim))
    assert torch.allclose(v, qkv[:, q_size + kv_size:].reshape(5, kv_heads, dim))
    assert torch.allclose(k_roped[0], k[0])  # position 0 is no rotation
    assert torch.allclose(k_roped, smoke.rope_neox(k, torch.arange(5), rotary_dim=2, theta=100.0))
    assert not torch.allclose(k_roped[1:], k[1:])


def _runs(smoke, acc: dict[str, float], topology: str = "unpaired", n: int = 32, turns: int = 3):
    runs = {}
    for mode, a in acc.items():
        records = [smoke.TurnRecord(c, t, 100, [c, t], 10.0, drafted=100, accepted=int(a * 100),
                                    perf_metrics=True) for c in range(n) for t in range(turns)]
        runs[mode] = smoke.Run(mode, records, topology if mode == "carry" else "", mode == "carry", "")
    return runs


def test_acceptance_is_proved_when_carry_matches_rebuild_and_beats_blind(smoke):
    v = smoke.acceptance_verdict(_runs(smoke, {"carry": 0.7, "rebuild": 0.71, "blind": 0.5}), 32, 3, 0.02, 0.02)
    assert v.status == "PROVED"
    assert v.detail.startswith("warm turns, carry - rebuild -0.010 (p25 -0.010 - p75 -0.010, n=64)")


@pytest.mark.parametrize("acc, status", [
    ({"carry": 0.5, "rebuild": 0.7, "blind": 0.5}, "FAILED"),  # the carry bought nothing
    ({"carry": 0.7, "rebuild": 0.7, "blind": 0.69}, "FAILED"),  # blind as good: nothing to show
])
def test_acceptance_fails_when_the_carry_falls_short(smoke, acc, status):
    assert smoke.acceptance_verdict(_runs(smoke, acc), 32, 3, 0.02, 0.02).status == status


def test_acceptance_is_not_checked_on_too_small_a_workload_or_a_paired_build(smoke):
    acc = {"carry": 0.7, "rebuild": 0.7, "blind": 0.5}
    small = smoke.acceptance_verdict(_runs(smoke, acc, n=8), 8, 3, 0.02, 0.02)
    assert (small.status, small.detail) == ("NOT CHECKED", "needs >= 32 conversations x 3 turns, ran 8 x 3")
    paired = smoke.acceptance_verdict(_runs(smoke, acc, topology="paired"), 32, 3, 0.02, 0.02)
    assert paired.status == "NOT CHECKED" and "topology paired" in paired.detail


def test_outputs_must_be_identical_turn_by_turn_across_modes(smoke):
    runs = _runs(smoke, {"off": 0.0, "carry": 0.7})
    assert smoke.outputs_verdict(runs).status == "PROVED"
    runs["carry"].records[4].output = [9]
    v = smoke.outputs_verdict(runs)
    assert (v.status, v.detail) == ("FAILED", "carry differs from off at conversation 1 turn 1")


def test_rows_agree_only_at_bf16_level(smoke):
    a = torch.randn(6, 2, 8)
    same = smoke.rows_verdict("scatter", smoke.row_cosines(a, a.bfloat16().float()), 0.0, "x")
    assert same.status == "PROVED"
    shifted = smoke.rows_verdict("scatter", smoke.row_cosines(a, torch.roll(a, 1, dims=0)), 1.0, "x")
    assert shifted.status == "FAILED"


class Pages:
    """A draft KV manager's two calls the script reads, over a CPU buffer (a stand-in, for tests)."""

    def __init__(self, buf, pages, hnd=True):
        self.buf, self.pages, self.hnd = buf, pages, hnd

    def get_batch_cache_indices(self, request_ids, layer_idx=None):
        return [self.pages]

    def get_buffers(self, layer_idx, **kwargs):
        if not self.hnd and kwargs:
            raise TypeError("get_buffers() got an unexpected keyword argument 'kv_layout'")
        return self.buf


def test_draft_rows_gather_keys_across_pages_in_the_hnd_and_nhd_layouts(smoke):
    pages, heads, tpb, dim = 3, 2, 4, 5
    hnd = torch.randn(pages, 2, heads, tpb, dim)
    order = [2, 0, 1]  # the request's pages, not in pool order
    k, v, layout = smoke.draft_rows(Pages(hnd, order), 7, request_id=1, n=10)
    expect_k = torch.stack([hnd[order[i // tpb], 0, :, i % tpb] for i in range(10)])
    expect_v = torch.stack([hnd[order[i // tpb], 1, :, i % tpb] for i in range(10)])
    assert layout == "HND" and torch.equal(k, expect_k) and torch.equal(v, expect_v)
    nhd = hnd.permute(0, 1, 3, 2, 4).contiguous()  # V1: [blocks, 2, tokens_per_block, heads, dim]
    k1, v1, layout1 = smoke.draft_rows(Pages(nhd, order, hnd=False), 7, request_id=1, n=10)
    assert layout1 == "NHD" and torch.equal(k1, expect_k) and torch.equal(v1, expect_v)


def test_draft_rows_refuse_a_page_index_outside_the_pool(smoke):
    with pytest.raises(smoke.SmokeError, match=r"draft page index out of range for keys \[0, 5\)"):
        smoke.draft_rows(Pages(torch.zeros(2, 2, 1, 4, 3), [0, 7]), 0, request_id=1, n=5)


def test_the_probe_reads_scattered_rows_at_admission_and_all_rows_at_free(smoke):
    pool = torch.randn(4, 2, 1, 4, 2)
    draft = Pages(pool, [3, 1])
    env = {"BaseResourceManager": object}
    probe = smoke.make_probe(env, draft, 48, {"triton-corrid-1"})

    def request(rid, conv, r, tokens):
        return SimpleNamespace(py_request_id=rid, is_dummy_request=False, context_current_position=r,
                               py_conversation_params=SimpleNamespace(conversation_id=conv),
                               get_tokens=lambda beam: list(range(tokens)))

    warm, other = request(5, "triton-corrid-1", 6, 8), request(6, "triton-corrid-2", 6, 8)
    probe.prepare_resources(SimpleNamespace(context_requests=[warm, other]))
    probe.prepare_resources(SimpleNamespace(context_requests=[warm]))  # a later chunk: not a first sight
    r, k, _ = probe.at_admission[("triton-corrid-1", 0)]
    assert r == 6 and torch.equal(k, smoke.draft_rows(draft, 48, 5, 6)[0])
    assert list(probe.at_admission) == [("triton-corrid-1", 0)]  # unwatched conversations are not read
    probe.free_resources(warm)
    assert probe.at_free[("triton-corrid-1", 0)][0].shape == (7, 1, 2)  # keys [0, L - 1)
