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
