"""The Dynamo front end's pure parts, without a deployment: the model directory, the block
manager's cache events (what the worker publishes as KV events), the CLI without Dynamo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trtllm_mtp_carry.engine.block_manager import TargetBlockManager
from trtllm_mtp_carry.engine.prefix_hash import ROOT_HASH, chain_hash, encode_tokens
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.serve.dynamo.model_dir import write_model_dir


def test_model_dir_tokenizer_encodes_and_decodes_like_the_package_tokenizer(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    path = write_model_dir(tmp_path / "model", 2048)
    tok = ChatTokenizer()
    hf = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "déjà vu: ```py\nprint('€')\n```"
    rendered = ("<|im_start|><|system|>be brief<|im_end|>\n<|im_start|><|user|>" + text
                + "<|im_end|>\n<|im_start|><|assistant|>")
    ids = tok.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": text}])
    assert hf.encode(rendered, add_special_tokens=False).ids == ids
    assert hf.decode(ids[12:]) == text + "\n"  # specials skipped, bytes back to text
    config = json.loads((path / "config.json").read_text())
    assert (config["max_position_embeddings"], config["eos_token_id"]) == (2048, tok.eos_id)
    assert "raise_exception" in json.loads((path / "tokenizer_config.json").read_text())["chat_template"]


class Events:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def stored(self, root, parent, hashes, tokens) -> None:
        self.log.append(("stored", root, parent, list(hashes), list(tokens)))

    def removed(self, hashes) -> None:
        self.log.append(("removed", list(hashes)))


def _chain(tokens: list[int], bs: int) -> list[int]:
    out, h = [], ROOT_HASH
    for i in range(len(tokens) // bs):
        h = chain_hash(h, encode_tokens(tokens[i * bs:(i + 1) * bs]))
        out.append(h)
    return out


def test_block_manager_announces_new_chained_blocks_once_and_their_eviction() -> None:
    bm, events = TargetBlockManager(4, 4), Events()
    bm.listener = events
    first = list(range(100, 110))  # 2 full blocks + 2 tokens
    h = _chain(first, 4)
    bm.allocate(1, first)
    bm.commit_full_blocks(1, first)
    assert events.log == [("stored", ROOT_HASH, ROOT_HASH, h, first[:8])]
    bm.free(1, first)  # the partial tail is cached too, but only full blocks are announced
    assert len(events.log) == 1

    longer = first[:8] + list(range(200, 208))  # shares 2 blocks, adds 2 new ones
    m = bm.match_prefix(longer)
    bm.allocate(2, longer, m)
    bm.commit_full_blocks(2, longer)
    h2 = _chain(longer, 4)
    assert h2[:2] == h
    # only the new blocks, chained to the last shared one; drawing them evicted block 2 (partial)
    assert events.log[1:] == [("stored", ROOT_HASH, h[1], h2[2:], longer[8:16])]
    bm.free(2, longer)

    other = list(range(300, 316))  # 4 new blocks: every cached block is evicted, children first
    bm.allocate(3, other)
    removed = [e for e in events.log if e[0] == "removed"]
    assert [e[1] for e in removed] == [[h2[3]], [h2[2]], [h[1]], [h[0]]]


def test_serve_dynamo_without_dynamo_names_the_extra_and_the_no_deps_install(tmp_path) -> None:
    shadow = tmp_path / "shadow" / "dynamo"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")  # a `dynamo` without its runtime: as if not installed
    done = subprocess.run(
        [sys.executable, "-c", "from trtllm_mtp_carry.cli import main; raise SystemExit(main())",
         "serve", "--dynamo", "--workers", "2", "--http-port", "8000"],
        capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path / "shadow"), "PATH": ""})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "trtllm-mtp-carry: error: NVIDIA Dynamo is not installed (no module dynamo._core): "
        'pip install -e ".[dynamo]" && pip install --no-deps ai-dynamo==1.6.1 '
        "(ai-dynamo's aisimulate dependency is an unreachable placeholder)"]


_CHUNK = ('data: {"id":"c","choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":%s}],'
          '"object":"chat.completion.chunk"}\n\n')
_SSE = {  # the streams an HTTP-200 reply may carry; the first is Dynamo 1.6.1's own (a worker
    # SIGKILLed mid-stream with --migration-limit 0, captured on loopback)
    "dynamo_error_object": (_CHUNK % ("ab", "null") + 'data: {"error":{"message":"Service temporarily '
                            'unavailable","type":"service_unavailable","code":503}}\n\ndata: [DONE]\n\n'),
    "sse_error_event": _CHUNK % ("ab", "null") + "event: error\ndata: worker went away\n\n",
    "cut": _CHUNK % ("ab", "null"),
    "whole": _CHUNK % ("ab", "null") + _CHUNK % ("c", '"stop"') + "data: [DONE]\n\n",
}


@pytest.fixture(scope="module")
def sse_server():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            body = _SSE[self.headers["x-dynamo-session-id"]].encode()
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("stream, error", [
    ("dynamo_error_object", "stream error after HTTP 200: Service temporarily unavailable"),
    ("sse_error_event", "stream error after HTTP 200: worker went away"),
    ("cut", "stream after HTTP 200 ended without a finish_reason (cut after 2 characters)"),
    ("whole", None),
])
def test_openai_client_counts_an_error_after_http_200_as_a_failed_turn_never_a_short_success(
        sse_server, stream, error) -> None:
    from trtllm_mtp_carry.serve.dynamo.openai_client import chat

    reply = chat(sse_server, "m", [{"role": "user", "content": "x"}], 4, session_id=stream)
    assert (reply.status, reply.error) == (200, error)
    assert reply.text == ("abc" if error is None else "ab")


@pytest.mark.parametrize("kwargs, message", [
    ({"migration_limit": -1}, "migration limit must be an int in [0, 100], got -1"),
    ({"migration_limit": True}, "migration limit must be an int in [0, 100], got True"),
    ({"on_worker_death": "ignore"}, "on worker death must be one of restart, exit, got 'ignore'"),
    ({"worker_restarts": -2}, "worker restarts must be an int >= 0, got -2"),
])
def test_dynamo_spec_names_a_bad_supervision_or_migration_value(kwargs, message) -> None:
    from trtllm_mtp_carry.serve.dynamo.launcher import DynamoSpec

    with pytest.raises(ValueError) as info:
        DynamoSpec(**kwargs)
    assert str(info.value) == message


def test_dynamo_spec_names_an_ipv6_host_it_cannot_bind() -> None:
    from trtllm_mtp_carry.serve.dynamo.launcher import DynamoSpec

    for host in ("::", "::1"):  # free_port's IPv4 socket, the URLs and the broker's address would break
        with pytest.raises(ValueError) as info:
            DynamoSpec(http_host=host)
        assert str(info.value) == f"host must be an IPv4 address or a host name, got {host!r}"


def test_dynamo_spec_defaults_migrate_soft_affine_sessions_and_bind_loopback() -> None:
    from trtllm_mtp_carry.serve.dynamo.launcher import DEFAULT_MIGRATION_LIMIT, DynamoSpec

    spec = DynamoSpec(http_port=8123)
    args = spec.frontend_args()
    assert args[args.index("--http-host") + 1] == "127.0.0.1"
    assert args[args.index("--migration-limit") + 1] == str(DEFAULT_MIGRATION_LIMIT) == "3"
    assert args[args.index("--router-session-affinity-mode") + 1] == "soft"
    assert (spec.on_worker_death, spec.worker_restarts) == ("restart", 3)
    opened = DynamoSpec(http_host="0.0.0.0", http_port=8123)
    assert (opened.base_url, opened.connect_host) == ("http://127.0.0.1:8123/v1", "127.0.0.1")


def test_status_metrics_say_how_many_workers_are_alive_and_how_often_they_restarted() -> None:
    from trtllm_mtp_carry.serve.dynamo.launcher import exit_text, status_metrics

    page = status_metrics({"workers_configured": 2, "workers_alive": 1, "workers_registered": 1,
                           "worker_restarts": 3, "worker_deaths": 4})
    samples = [ln for ln in page.splitlines() if not ln.startswith("#")]
    assert samples == ['mtp_carry_dynamo_workers{state="configured"} 2',
                       'mtp_carry_dynamo_workers{state="alive"} 1',
                       'mtp_carry_dynamo_workers{state="registered"} 1',
                       "mtp_carry_dynamo_worker_restarts_total 3",
                       "mtp_carry_dynamo_worker_deaths_total 4"]
    assert (exit_text(-9), exit_text(1), exit_text(-15)) == (
        "killed by SIGKILL", "exit status 1", "killed by SIGTERM")


def test_tally_sums_one_workers_page_as_the_count_invariants_compare_it() -> None:
    from trtllm_mtp_carry.serve.dynamo.metrics import TALLY_KEYS, tally

    page = "\n".join([
        "# HELP mtp_carry_outcomes_total turns by outcome",
        'mtp_carry_outcomes_total{instance="a1",kind="adopted"} 5',
        'mtp_carry_outcomes_total{instance="a1",kind="cancelled"} 2',
        'mtp_carry_outcomes_total{instance="a1",kind="rejected"} 1',
        'mtp_carry_runtime{field="outcomes.adopted"} 5',
        'mtp_carry_runtime{field="outcomes.no_carry"} 1',
        'mtp_carry_runtime{field="rows_adopted"} 640',
        'mtp_carry_drafter_rows_total{source="adopted"} 600',
        'mtp_carry_drafter_rows_total{source="computed"} 90',
        'mtp_carry_adoptions_total{instance="a1",source="local"} 3',
        'mtp_carry_adoptions_total{instance="a1",source="remote"} 2',
        'mtp_carry_pulls_total{instance="a1",result="received"} 1',
        'mtp_carry_pulls_total{instance="a1",result="no_holder"} 4',
        'mtp_carry_moved_rows_total{instance="a1",direction="in"} 150',
        'mtp_carry_moved_rows_total{instance="a1",direction="out"} 75',
        'mtp_carry_drained_entries_total{instance="a1",result="moved"} 3',
        'dynamo_component_requests_total{dynamo_endpoint="generate",worker_id="a1"} 8',
        'dynamo_component_requests_total{dynamo_endpoint="clear_kv_blocks",worker_id="a1"} 3',
    ])
    assert tally(page) == ("a1", {
        "outcomes": 8.0, "cancelled": 2.0, "rejected": 1.0, "runtime_outcomes": 6.0, "requests": 8.0,
        "rows_adopted_total": 600.0, "rows_adopted_runtime": 640.0, "adopted": 5.0, "adopted_remote": 2.0,
        "pulls_received": 1.0, "moved_rows_in": 150.0, "moved_rows_out": 75.0, "drained_moved": 3.0,
        "drained_dropped": 0.0})
    assert tally("") == ("", dict.fromkeys(TALLY_KEYS, 0.0))


def test_a_worker_counts_its_moves_in_the_mtp_carry_families() -> None:
    from trtllm_mtp_carry.serve.dynamo.metrics import WorkerMetrics

    m = WorkerMetrics("mtp-carry", "a1")
    m.record_pull("received", 12.5)
    m.record_pull("no_holder", 3.0)
    m.record_pull("no_holder", 2.0)
    m.record_moved("in", 76, 20480)
    m.record_adoption("remote")
    m.record_drain("dropped", 2)
    m.record_unadmitted("rejected")
    samples = [ln for ln in m.exposition().splitlines() if not ln.startswith("#")]
    assert samples == [
        'mtp_carry_outcomes_total{model="mtp-carry",instance="a1",kind="rejected"} 1',
        'mtp_carry_adoptions_total{model="mtp-carry",instance="a1",source="remote"} 1',
        'mtp_carry_pulls_total{model="mtp-carry",instance="a1",result="received"} 1',
        'mtp_carry_pulls_total{model="mtp-carry",instance="a1",result="no_holder"} 2',
        'mtp_carry_pull_ms_total{model="mtp-carry",instance="a1",result="received"} 12.5',
        'mtp_carry_pull_ms_total{model="mtp-carry",instance="a1",result="no_holder"} 5',
        'mtp_carry_moved_rows_total{model="mtp-carry",instance="a1",direction="in"} 76',
        'mtp_carry_moved_bytes_total{model="mtp-carry",instance="a1",direction="in"} 20480',
        'mtp_carry_drained_entries_total{model="mtp-carry",instance="a1",result="dropped"} 2']


def test_dynamo_spec_hands_the_moves_settings_to_its_workers() -> None:
    from trtllm_mtp_carry.serve.dynamo.launcher import DynamoSpec

    args = DynamoSpec(http_host="127.0.0.2", pull_budget_ms=250, drain_s=4).worker_args("/d/model")
    assert args[args.index("--transfer-host") + 1] == "127.0.0.2"
    assert (args[args.index("--carry-pull-budget-ms") + 1], args[args.index("--carry-drain-s") + 1]) == ("250", "4")
    assert args[args.index("--stopping-file") + 1] == "/d/stopping"
    assert "--no-carry-moves" in DynamoSpec(carry_moves=False).worker_args("/d/model")
    with pytest.raises(ValueError, match="pull budget ms must be a positive int, got 0"):
        DynamoSpec(pull_budget_ms=0)


def test_without_nixl_the_transport_names_the_extra(monkeypatch) -> None:
    import sys

    from trtllm_mtp_carry.serve.dynamo.nixl_transport import NixlMissing, NixlTransport

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # `import nixl._api` raises ImportError
    with pytest.raises(NixlMissing, match=r'pip install -e "\.\[nixl\]" \(nixl==1\.5\.1\)'):
        NixlTransport("w")
