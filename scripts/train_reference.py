"""Train the reference hybrid LM and its MTP drafter together, deterministically, on CPU.

Builds multi-turn sessions from the local Python stdlib (`engine/corpus.py`),
trains target next-token loss + drafter loss (pair key k predicts t_{k+2} from
(embed(t_{k+1}), hidden_k); hidden is not detached), evaluates on held-out
files, and writes `engine/weights/reference.{safetensors,json}`,
`engine/weights/train_record.json` and `engine/data/heldout_sessions.jsonl`.

    python scripts/train_reference.py            # the shipped weights
    python scripts/train_reference.py --steps 5 --out /tmp/w --heldout-jsonl /tmp/h.jsonl  # smoke
    python scripts/train_reference.py --eval-only   # re-evaluate the shipped weights

Metrics (held-out files, assistant answers after the first turn, teacher
forced): target next-token accuracy; drafter top-1 agreement with the target's
greedy token with all drafter rows ("full") or with TensorRT-LLM's faithful
"blind" rows (a warm turn without the carry: no rows over the reused prefix,
i.e. the previous turn through its answer, but rows for the new span the
prefill computes, from the key of the previous turn's last token on); and
greedy speculative decoding with 3 recurrent drafts: accepted drafts per
verify step, full vs blind.

Same machine + same stdlib + same flags -> same weights (fixed seed, 2 threads).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trtllm_mtp_carry.engine import corpus
from trtllm_mtp_carry.engine.model import (
    DenseTargetCache,
    HybridConfig,
    HybridLM,
    _rope,
    init_random,
    load_reference,
    save_reference,
)
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

PKG = Path(__file__).resolve().parent.parent / "trtllm_mtp_carry" / "engine"


def batches(seqs: list[list[int]], batch: int, pad: int, rng: random.Random):
    """Endless padded batches; each epoch reshuffles, batches group similar lengths."""
    while True:
        idx = list(range(len(seqs)))
        rng.shuffle(idx)
        groups = [idx[i:i + batch * 16] for i in range(0, len(idx), batch * 16)]
        for g in groups:
            g.sort(key=lambda i: len(seqs[i]))
            chunks = [g[i:i + batch] for i in range(0, len(g), batch)]
            rng.shuffle(chunks)
            for c in chunks:
                L = max(len(seqs[i]) for i in c)
                t = torch.full((len(c), L), pad, dtype=torch.long)
                for r, i in enumerate(c):
                    t[r, :len(seqs[i])] = torch.tensor(seqs[i])
                yield t


def losses(model: HybridLM, tokens: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    # tokens: [B, L]
    hidden = model.forward_train(tokens)
    logits = model.lm_head(hidden[:, :-1])
    tgt = tokens[:, 1:].masked_fill(tokens[:, 1:] == pad, -100)
    lm = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
    dl = model.drafter.forward_train(tokens, hidden)[:, :-1]  # keys 0..L-3 -> t_{k+2}
    dtgt = tokens[:, 2:].masked_fill(tokens[:, 2:] == pad, -100)
    draft = F.cross_entropy(dl.flatten(0, 1), dtgt.flatten(), ignore_index=-100)
    return lm, draft


def answer_spans(tok: ChatTokenizer, messages: list[dict]) -> list[tuple[int, int]]:
    """[P, E) token ranges of each assistant answer after the first user turn (P = prompt len)."""
    return [(P, E) for P, E, _ in answer_turns(tok, messages)]


def answer_turns(tok: ChatTokenizer, messages: list[dict]) -> list[tuple[int, int, int]]:
    """`(P, E, R)` per answer after the first user turn: the answer is [P, E), and R is
    the first position a warm turn's prefill computes (the prefix cache holds the
    previous turn through its answer's <|im_end|> except that last sampled token:
    the engine's reused_tokens). The faithful blind drafter has rows for keys R..P-2."""
    turns, seen_user, prev_end = [], 0, 0
    nl = len(tok.encode("\n"))
    for i, m in enumerate(messages):
        if m["role"] == "user":
            seen_user += 1
        if m["role"] == "assistant":
            P = len(tok.render_chat(messages[:i], add_generation_prompt=True))
            E = P + len(tok.encode(m["content"])) + 1  # + <|im_end|>
            if seen_user >= 2:
                turns.append((P, E, max(prev_end - 1, 0)))
            prev_end = len(tok.render_chat(messages[:i + 1], add_generation_prompt=False)) - nl
            assert prev_end == E
    return turns


@torch.no_grad()
def evaluate(model: HybridLM, tok: ChatTokenizer, sessions: list[list[dict]]) -> dict:
    """Target accuracy and drafter agreement with the target's greedy token on answers."""
    model.eval()
    d = model.drafter
    c = model.cfg
    n = tgt_ok = full_ok = blind_ok = all_ok = all_n = 0
    for msgs in sessions:
        ids = torch.tensor(tok.render_chat(msgs, add_generation_prompt=False))
        hidden = model.forward_train(ids[None])[0]
        greedy = model.lm_head(hidden).argmax(-1)  # greedy[p] predicts t_{p+1}
        all_ok += int((greedy[:-1] == ids[1:]).sum())
        all_n += len(ids) - 1
        keys = torch.arange(len(ids) - 1)
        x = d.project(ids[1:], hidden[:-1])
        q, k, v = d.qkv(x, keys)
        k = _rope(k, keys + 1, c.rotary_dim, c.rope_theta)
        full = d.finish(x, q, k, v, keys, keys)[1].argmax(-1)  # key j predicts t_{j+2}
        for P, E, R in answer_turns(tok, msgs):
            # answer tokens t_P..t_{E-1}; the drafter's first key is P-1 (pair (t_P, hidden_{P-1}))
            tgt_ok += int((greedy[P - 1:E - 1] == ids[P:E]).sum())
            ks = torch.arange(P - 1, E - 2)  # keys whose draft t_{k+2} lies in the answer
            if len(ks) == 0:
                continue
            want = greedy[ks + 1]
            full_ok += int((full[ks] == want).sum())
            # faithful blind: rows from key R on (the new span's and the answer's), none below
            vis = torch.arange(R, E - 2)
            blind = d.finish(x[vis], q[vis], k[vis], v[vis], vis, vis)[1].argmax(-1)[P - 1 - R:]
            blind_ok += int((blind == want).sum())
            n += len(ks)
    ntgt = sum(E - P for s in sessions for P, E in answer_spans(tok, s))
    model.train()
    return {"target_all_acc": all_ok / max(all_n, 1), "target_answer_acc": tgt_ok / max(ntgt, 1), "drafter_accept_full": full_ok / max(n, 1),
            "drafter_accept_blind": blind_ok / max(n, 1), "answer_tokens": ntgt, "draft_keys": n}


@torch.no_grad()
def spec_decode(model: HybridLM, prompt: list[int], max_new: int, draft_len: int,
                blind_from: int | None, eos: int) -> tuple[list[int], int, int]:
    """Greedy speculative decoding with the recurrent MTP drafter; returns (output, steps, accepted).

    Drafter rows hold pair keys with target hiddens only; draft rows past the
    first key of a step are dropped after verify and the accepted pairs appended.
    `blind_from` R starts with rows for prompt keys R..L-2 only (TensorRT-LLM's
    blind warm turn: the prefill of the new span [R, L) runs the MTP layer over
    it); None starts with every prompt key's row.
    """
    d, c = model.drafter, model.cfg
    cache = DenseTargetCache(c)
    seq = list(prompt)
    hid, lg = model.forward_target(torch.tensor(seq), 0, cache)
    hiddens = list(hid)  # hiddens[p]: target hidden at position p

    def rows_for(keys: list[int]):
        kt = torch.tensor(keys)
        x = d.project(torch.tensor([seq[k + 1] for k in keys]), torch.stack([hiddens[k] for k in keys]))
        q, k, v = d.qkv(x, kt)
        return x, q, _rope(k, kt + 1, c.rotary_dim, c.rope_theta), v, kt

    rk, rv, rkeys = (torch.empty(0, c.num_kv_heads, c.head_dim),) * 2 + (torch.empty(0, dtype=torch.long),)
    first = 0 if blind_from is None else blind_from
    if len(seq) - 1 > first:
        _, _, rk, rv, rkeys = rows_for(list(range(first, len(seq) - 1)))
    seq.append(int(lg[-1].argmax()))
    out, steps, accepted = [seq[-1]], 0, 0
    while len(out) < max_new and out[-1] != eos:
        key = len(seq) - 2  # pair (seq[-1], hidden_{key}); its row stays (target hidden)
        x, q, k, v, kt = rows_for([key])
        rk, rv, rkeys = torch.cat([rk, k]), torch.cat([rv, v]), torch.cat([rkeys, kt])
        dk, dv, dkeys, drafts = rk, rv, rkeys, []
        h, lgd = d.finish(x, q, dk, dv, dkeys, kt)
        for i in range(draft_len):
            drafts.append(int(lgd[0].argmax()))
            if i + 1 == draft_len:
                break
            kt = torch.tensor([key + i + 1])
            x = d.project(torch.tensor(drafts[-1:]), h)
            q, k, v = d.qkv(x, kt)
            dk = torch.cat([dk, _rope(k, kt + 1, c.rotary_dim, c.rope_theta)])
            dv, dkeys = torch.cat([dv, v]), torch.cat([dkeys, kt])
            h, lgd = d.finish(x, q, dk, dv, dkeys, kt)
        n0, snap = cache.num_tokens, cache.snapshot_ssm()
        hid, lg = model.forward_target(torch.tensor([seq[-1], *drafts]), n0, cache)
        greedy = lg.argmax(-1).tolist()
        a = 0
        while a < draft_len and drafts[a] == greedy[a]:
            a += 1
        if a < draft_len:  # rejection: rewind attention rows and SSM state, re-run the accepted
            cache.truncate(n0)
            cache.restore_ssm(snap)
            hid, _ = model.forward_target(torch.tensor([seq[-1], *drafts[:a]]), n0, cache)
        hiddens += list(hid[:a + 1])
        new = drafts[:a] + [greedy[a]]
        if eos in new:  # stop at <|im_end|>, even when it is an accepted draft
            cut = new.index(eos) + 1
            a, new = min(a, cut), new[:cut]
        seq += new
        out += new
        steps += 1
        accepted += a
        if out[-1] == eos:
            break
        if a:  # rows for the newly verified pairs, keys key+1 .. len(seq)-3
            _, _, k, v, kt = rows_for(list(range(key + 1, len(seq) - 2)))
            rk, rv, rkeys = torch.cat([rk, k]), torch.cat([rv, v]), torch.cat([rkeys, kt])
    return out, steps, accepted


@torch.no_grad()
def spec_eval(model: HybridLM, tok: ChatTokenizer, sessions: list[list[dict]],
              draft_len: int = 3, max_new: int = 128) -> dict:
    """Mean accepted drafts per verify step on each session's last answer, full vs blind."""
    model.eval()
    res = {}
    for mode in ("full", "blind"):
        steps = acc = 0
        for msgs in sessions:
            prompt = tok.render_chat(msgs[:-1], add_generation_prompt=True)
            turns = answer_turns(tok, msgs)
            R = turns[-1][2] if turns and turns[-1][0] == len(prompt) else 0  # 0: a cold turn
            _, s, a = spec_decode(model, prompt, max_new, draft_len,
                                  R if mode == "blind" else None, tok.eos_id)
            steps, acc = steps + s, acc + a
        res[f"spec{draft_len}_accepted_per_step_{mode}"] = acc / max(steps, 1)
    model.train()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--draft-weight", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-sessions", type=int, default=12000)
    ap.add_argument("--heldout-sessions", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--qk-norm-init", type=float, default=1.6)
    ap.add_argument("--out", type=Path, default=PKG / "weights")
    ap.add_argument("--heldout-jsonl", type=Path, default=PKG / "data" / "heldout_sessions.jsonl")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-only", action="store_true",
                    help="evaluate the weights in --out on --heldout-jsonl; train nothing")
    ap.add_argument("--eval-threads", type=int, default=2,
                    help="torch threads for --eval-only (1 on a loaded machine)")
    args = ap.parse_args()
    if args.eval_only:
        torch.set_num_threads(args.eval_threads)
        model, tok = load_reference(path=args.out)
        held = corpus.read_jsonl(args.heldout_jsonl)
        metrics = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in
                   {**evaluate(model, tok, held), **spec_eval(model, tok, held)}.items()}
        rec_path = args.out / "train_record.json"
        if rec_path.exists():  # refresh the recorded metrics, keep the training facts
            rec = json.loads(rec_path.read_text())
            rec.update(metrics, eval_command="python " + " ".join(sys.argv))
            rec_path.write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps(metrics, indent=1))
        return

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    t0 = time.time()
    tok = ChatTokenizer()
    train = corpus.build_sessions(args.train_sessions, heldout=False, seed=args.seed)
    held = corpus.build_sessions(args.heldout_sessions, heldout=True, seed=args.seed + 1)
    corpus.write_jsonl(held, args.heldout_jsonl)
    seqs = [tok.render_chat(s, add_generation_prompt=False)[:args.max_len] for s in train]
    print(f"corpus: {len(seqs)} train sessions, {sum(map(len, seqs))} tokens; "
          f"{len(held)} held-out sessions ({time.time() - t0:.1f}s)", flush=True)

    H = args.hidden
    cfg = HybridConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=H // 4,
                       intermediate_size=3 * H, linear_num_heads=4, linear_key_dim=H // 4,
                       linear_value_dim=H // 4,
                       max_position=32768)  # serving limit; RoPE needs no table
    model = init_random(cfg, args.seed, args.qk_norm_init)
    nparam = sum(p.numel() for p in model.parameters())
    print(f"model: {nparam / 1e6:.2f}M params, {cfg.layer_types}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    warm = max(1, args.steps // 20)

    def lr_at(s: int) -> float:
        if s < warm:
            return args.lr * (s + 1) / warm
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, args.steps - warm))))

    it = batches(seqs, args.batch, tok.pad_id, random.Random(args.seed))
    ema_lm = ema_d = None
    tstart = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        lm, dr = losses(model, next(it), tok.pad_id)
        loss = lm + args.draft_weight * dr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema_lm = lm.item() if ema_lm is None else 0.95 * ema_lm + 0.05 * lm.item()
        ema_d = dr.item() if ema_d is None else 0.95 * ema_d + 0.05 * dr.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - tstart
            print(f"step {step:5d} lm {lm.item():.3f} (ema {ema_lm:.3f}) draft {dr.item():.3f} "
                  f"(ema {ema_d:.3f}) lr {lr_at(step):.2e} {el:.0f}s "
                  f"({el / (step + 1):.2f}s/step)", flush=True)
    train_s = time.time() - tstart
    metrics = {**evaluate(model, tok, held), **spec_eval(model, tok, held)}
    record = {"command": "python " + " ".join(sys.argv), "seed": args.seed, "steps": args.steps,
              "train_seconds": round(train_s, 1), "total_seconds": round(time.time() - t0, 1),
              "final_lm_loss_ema": round(ema_lm, 4), "final_draft_loss_ema": round(ema_d, 4),
              "python": sys.version.split()[0], "torch": torch.__version__,
              **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}}
    save_reference(model, args.out)
    (args.out / "train_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1), flush=True)


if __name__ == "__main__":
    main()
