"""Fine-tune the bundled model on tools and JSON, so it calls a tool and answers in JSON
without a grammar forcing it: `tools/tiny_finetune.py [--asset DIR] [--stage DIR] CMD`.
It builds on tools/train_tiny_model.py (the model classes, the config, `prepare`'s staged
code tokens), which knows nothing of it.

  ft-data    render chat samples (tools/tiny_tooldata.py, training families only) with the
             daemon's chat template and the bundled tokenizer; token ids + a mask of the
             assistant tokens (the only chat tokens with a loss); plus held-out-family chats for
             the loss curve; the staged stdlib code tokens (`prepare`'s train.npy/heldout.npy)
             copied beside them. Writes --data (default .ft_stage/): chat.npz, chat_held.npz,
             code.npy, code_held.npy, meta.json.
  finetune   from the current weights (--init, default the bundled model): batches half code
             windows, half chat windows (each starting at a sample's start); loss = base +
             0.3 * mtp as in `train`, each averaged over code tokens and over assistant tokens
             and mixed by --chat-weight. Writes state.safetensors + ft_log.json to --out.
  tool-eval  with mlx-lm on the CPU: for each held-out tool (families never trained on), an
             action request, free (unconstrained) greedy generation of 128 tokens; rates of a
             parseable call (daemon/request_text/tool_calls.py) of the right tool, of closed calls (every
             ``<parameter=`` closed and ``</tool_call>`` present), of arguments carrying every
             required key; chit-chat with tools that calls nothing; JSON answers that parse.
  ft-card    the candidate's MODEL_CARD.md: the bundled card plus the fine-tuning's recipe and
             before/after numbers (tool-eval, acceptance).

The chat part of an assistant turn is tokenized on its own (the prompt up to
``<|im_start|>assistant\\n`` first), as the model meets it when it generates.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np

import tiny_tooldata as tdata
import train_tiny_model as ttm

TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- data


def hf_tokenizer(asset):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(asset))


def encode_sample(hf_tok, s):
    """(ids, mask): the rendered chat's tokens; mask 1 on assistant content + <|im_end|>."""
    text = hf_tok.apply_chat_template(s["messages"], tools=s["tools"], tokenize=False)
    ids, mask, pos = [], [], 0
    tk = hf_tok.backend_tokenizer
    for m in TURN.finditer(text):
        a, b = m.start(1), m.end(1)
        pre = tk.encode(text[pos:a], add_special_tokens=False).ids
        mid = tk.encode(text[a:b], add_special_tokens=False).ids
        ids += pre + mid
        mask += [0] * len(pre) + [1] * len(mid)
        pos = b
    tail = tk.encode(text[pos:], add_special_tokens=False).ids
    return ids + tail, mask + [0] * len(tail)


def pack(hf_tok, samples, eot=0, max_len=1024):
    """Samples back to back, each ended by <|endoftext|>; those longer than max_len dropped
    (a training window starts at a sample's start and holds max_len tokens)."""
    ids, mask, starts = [], [], []
    for s in samples:
        i, m = encode_sample(hf_tok, s)
        if len(i) + 1 > max_len:
            continue
        starts.append(len(ids))
        ids += i + [eot]
        mask += m + [0]
    return np.asarray(ids, np.uint16), np.packbits(np.asarray(mask, np.uint8)), np.asarray(starts, np.int64)


def cmd_ft_data(args):
    out = Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(args.stage)
    tok = hf_tokenizer(args.asset)
    t0 = time.time()
    for name, n, seed, split in (("chat", args.samples, args.seed, "train"),
                                 ("chat_held", args.held_samples, args.seed + 1, "heldout")):
        ids, bits, starts = pack(tok, tdata.generate(n, seed=seed, split=split))
        np.savez_compressed(out / f"{name}.npz", ids=ids, mask=bits, starts=starts)
        log(f"{name}: {n} samples, {ids.size} tokens, {int(np.unpackbits(bits)[:ids.size].sum())} "
            f"assistant tokens [{time.time() - t0:.0f}s]")
    for src, dst in (("train.npy", "code.npy"), ("heldout.npy", "code_held.npy")):
        shutil.copyfile(stage / src, out / dst)
    meta = {"samples": args.samples, "held_samples": args.held_samples, "seed": args.seed,
            "train_tools": [t.name for t in tdata.tools("train")],
            "heldout_tools": [t.name for t in tdata.tools("heldout")],
            "heldout_families": list(tdata.HELDOUT_FAMILIES)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    log(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size:,}" for p in sorted(out.iterdir())))


def load_chat(path):
    z = np.load(path)
    ids = z["ids"].astype(np.int64)
    mask = np.unpackbits(z["mask"])[:ids.size].astype(np.float32)
    return ids, mask, z["starts"]


# --------------------------------------------------------------------------- finetune


def cmd_finetune(args):
    torch, TinyQwen35MTP = ttm.make_modules()
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif args.threads:
        torch.set_num_threads(args.threads)
    code = np.load(data / "code.npy").astype(np.int64)
    code_held = np.load(data / "code_held.npy").astype(np.int64)
    chat, chat_mask, chat_starts = load_chat(data / "chat.npz")
    hchat, hchat_mask, hchat_starts = load_chat(data / "chat_held.npz")
    cfg = ttm.build_config()
    model = TinyQwen35MTP(cfg)
    init = Path(args.init) if args.init else Path(args.asset) / "model.safetensors"
    model.load_hf_state_dict({k: v.float() for k, v in load_file(str(init)).items()})
    log(f"start weights: {init}")
    model.to(dev)
    log(f"torch {torch.__version__} on {dev}; code {code.size} tokens, chat {chat.size} tokens "
        f"({int(chat_mask.sum())} assistant) in {len(chat_starts)} samples")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    T, Bc = args.seq, args.batch // 2
    Bx = args.batch - Bc
    amp = dev.type == "cuda"

    def windows(ids, mask, starts, n, r):
        xs, ms = [], []
        for _ in range(n):
            s = int(starts[r.integers(0, len(starts))]) if starts is not None else int(r.integers(0, ids.size - T - 1))
            s = min(s, ids.size - T - 1)
            xs.append(ids[s:s + T])
            ms.append(mask[s:s + T] if mask is not None else np.ones(T, np.float32))
        return (torch.from_numpy(np.stack(xs)).to(dev), torch.from_numpy(np.stack(ms)).to(dev))

    def masked_losses(ids, w):
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=amp):
            h, logits = model.base(ids)
            _, ml = model.mtp_logits(h, ids)
        V = logits.shape[-1]
        lb = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
        lm = F.cross_entropy(ml[:, :-1].float().reshape(-1, V), ids[:, 2:].reshape(-1), reduction="none")
        wb, wm = w[:, 1:].reshape(-1), w[:, 2:].reshape(-1)
        return (lb * wb).sum() / wb.sum().clamp(min=1), (lm * wm).sum() / wm.sum().clamp(min=1)

    @torch.no_grad()
    def held_eval():
        model.eval()
        r = np.random.default_rng(1234)
        res = {}
        n, k = args.held_windows, min(8, args.held_windows)
        for name, src in (("code", (code_held, None, None)), ("chat", (hchat, hchat_mask, hchat_starts))):
            b = m = 0.0
            for _ in range(n // k):
                x, w = windows(*src, k, r)
                lb, lm = masked_losses(x, w)
                b, m = b + lb.item() / (n // k), m + lm.item() / (n // k)
            res[name] = (round(b, 4), round(m, 4))
        model.train()
        return res

    def lr_at(frac):
        if frac < args.warmup:
            return args.lr * frac / args.warmup
        p = min(1.0, (frac - args.warmup) / max(1e-9, 1 - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    hist = {"config": vars(args), "rows": [], "held": []}
    h0 = held_eval()
    hist["held"].append({"step": 0, **h0})
    log(f"held-out before: {h0}")
    model.train()
    t0, step = time.time(), 0
    while True:
        el = time.time() - t0
        if (args.steps and step >= args.steps) or (not args.steps and el >= args.time_budget):
            break
        frac = step / args.steps if args.steps else el / args.time_budget
        for g in opt.param_groups:
            g["lr"] = lr_at(frac)
        xc, wc = windows(code, None, None, Bc, rng)
        xt, wt = windows(chat, chat_mask, chat_starts, Bx, rng)
        cb, cm = masked_losses(xc, wc)
        tb, tm = masked_losses(xt, wt)
        cw = args.chat_weight
        loss = (1 - cw) * cb + cw * tb + ttm.MTP_LOSS_WEIGHT * ((1 - cw) * cm + cw * tm)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            row = {"step": step, "sec": round(time.time() - t0, 1), "lr": lr_at(frac),
                   "code_base": round(cb.item(), 4), "code_mtp": round(cm.item(), 4),
                   "chat_base": round(tb.item(), 4), "chat_mtp": round(tm.item(), 4), "gnorm": round(gn.item(), 3)}
            hist["rows"].append(row)
            log(json.dumps(row))
        if args.eval_every and step % args.eval_every == 0:
            hist["held"].append({"step": step, **held_eval()})
            log(f"  held-out: {hist['held'][-1]}")
    el = time.time() - t0
    hist["held"].append({"step": step, **held_eval()})
    hist["final"] = {"steps": step, "seconds": round(el, 1), "tokens": step * args.batch * T,
                     "tok_per_s": round(step * args.batch * T / max(el, 1e-9)), "device": str(dev),
                     "torch": torch.__version__}
    log(f"done: {step} steps in {el:.0f}s; held-out (base, mtp): {hist['held'][-1]}")
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.hf_state_dict().items()}
    save_file(sd, str(out / "state.safetensors"), metadata={"tag": f"finetune-step{step}"})
    (out / "ft_log.json").write_text(json.dumps(hist, indent=1))
    return hist


# --------------------------------------------------------------------------- tool-eval


def _required_ok(args: dict, tool: dict) -> bool:
    params = tool["function"]["parameters"]
    types = {"integer": int, "number": (int, float), "boolean": bool, "string": str, "array": list, "object": dict}
    for k in params.get("required", []):
        if k not in args:
            return False
    for k, v in args.items():
        sch = params["properties"].get(k)
        if sch is None:
            return False
        t = types.get(sch.get("type"))
        if t and (not isinstance(v, t) or (sch.get("type") in ("integer", "number") and isinstance(v, bool))):
            return False
        if "enum" in sch and v not in sch["enum"]:
            return False
    return True


def cmd_tool_eval(args):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from daemon.request_text.tool_calls import parse_tool_calls
    from protocol import messages as pm

    mx.set_default_device(mx.cpu)
    model, tok = load(str(args.asset))
    stops = {0, 2}

    def gen(messages, tools, max_tokens):
        kw = {"tools": tools} if tools else {}  # as the daemon's encode_prompt renders a chat
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw))
        out = []
        for t, _ in generate_step(mx.array(list(ids)), model, max_tokens=max_tokens,
                                  sampler=lambda lg: mx.argmax(lg, axis=-1)):
            t = int(t)
            if t in stops:
                break
            out.append(t)
        return tok.decode(out), len(out)

    def specs(tools):
        return [pm.ToolSpec(name=t["function"]["name"], description=t["function"]["description"],
                            parameters=t["function"]["parameters"]) for t in tools]

    t0 = time.time()
    cases = tdata.eval_cases(n_per_tool=args.per_tool)
    rows = []
    for c in cases:
        text, n = gen(c["messages"], c["tools"], args.max_tokens)
        _, calls = parse_tool_calls(text, specs(c["tools"]), lambda i: f"call_{i}")
        first = calls[0] if calls else None
        right = first is not None and first.name == c["expect"]
        opened = text.count("<parameter=")
        closed = "<tool_call>" in text and "</tool_call>" in text and text.count("</parameter>") >= opened
        tool = next(t for t in c["tools"] if t["function"]["name"] == c["expect"])
        valid = right and _required_ok(json.loads(first.arguments), tool)
        exact = right and json.loads(first.arguments) == c["args"]
        rows.append({"expect": c["expect"], "user": c["messages"][0]["content"], "text": text, "tokens": n,
                     "call": bool(calls), "right_tool": right, "closed": closed, "args_valid": valid,
                     "args_exact": exact})
    chit = []
    for c in tdata.chitchat_cases():
        text, n = gen(c["messages"], c["tools"], 64)
        _, calls = parse_tool_calls(text, specs(c["tools"]), lambda i: f"call_{i}")
        chit.append({"user": c["messages"][0]["content"], "text": text, "called": bool(calls or "<tool_call>" in text)})
    js = []
    for s in tdata.generate(args.json_cases * 8, seed=777, split="heldout"):
        if s["tools"] is None and s["messages"][-1]["content"].startswith("{"):
            text, n = gen(s["messages"][:-1], None, 160)
            try:
                ok = isinstance(json.loads(text), dict)
            except ValueError:
                ok = False
            js.append({"user": s["messages"][-2]["content"], "text": text, "valid": ok, "tokens": n})
            if len(js) >= args.json_cases:
                break
    n = len(rows)
    res = {"asset": str(args.asset), "heldout_tools": sorted({r["expect"] for r in rows}), "cases": n,
           "max_tokens": args.max_tokens,
           "call_rate": sum(r["call"] for r in rows) / n,
           "right_tool_rate": sum(r["right_tool"] for r in rows) / n,
           "closed_rate": sum(r["closed"] for r in rows) / n,
           "args_valid_rate": sum(r["args_valid"] for r in rows) / n,
           "args_exact_rate": sum(r["args_exact"] for r in rows) / n,
           "chitchat_no_call_rate": sum(not c["called"] for c in chit) / len(chit),
           "json_valid_rate": sum(j["valid"] for j in js) / max(1, len(js)), "json_cases": len(js),
           "seconds": round(time.time() - t0, 1), "rows": rows, "chitchat": chit, "json": js}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(res, indent=1))
    log(json.dumps({k: v for k, v in res.items() if k not in ("rows", "chitchat", "json")}, indent=1))
    return res


def _acc_rows(path):
    acc = json.loads(Path(path).read_text())["acceptance"]
    return {k: [round(x, 3) for x in v["conditional_acceptance_by_position"]] for k, v in acc.items()}


RATES = [("call_rate", "a parseable call"), ("right_tool_rate", "a call of the right tool"),
         ("closed_rate", "the call closed (every `<parameter=` closed, `</tool_call>` present)"),
         ("args_valid_rate", "right tool, arguments with every required key, types and enums right"),
         ("args_exact_rate", "right tool, arguments exactly the requested ones"),
         ("chitchat_no_call_rate", "chit-chat with tools present answered without a call"),
         ("json_valid_rate", "JSON answers (schema in the system turn) that parse, within 160 tokens")]


def cmd_ft_card(args):
    """The candidate's MODEL_CARD.md: the bundled card, its tools sentence updated, plus a
    section on the fine-tuning with before/after numbers."""
    card = (ttm.DEFAULT_ASSET / "MODEL_CARD.md").read_text()
    card = card.replace("the model was not trained on tools, so it only calls one when a grammar makes it",
                        "the model was fine-tuned on them, see the last section")
    ft_log = json.loads(Path(args.ft_log).read_text())
    meta = json.loads((Path(args.data) / "meta.json").read_text())
    b, a = Path(args.before), Path(args.after)
    tb, ta = (json.loads((d / "tool_eval.json").read_text()) for d in (b, a))
    ab, aa = _acc_rows(b / "eval_acceptance_postnorm.json"), _acc_rows(a / "eval_acceptance_postnorm.json")
    c, fin, held = ft_log["config"], ft_log["final"], ft_log["held"]
    size = sum(p.stat().st_size for p in Path(args.asset).iterdir() if p.is_file() and p.name != "MODEL_CARD.md")
    L = ["\n## Fine-tuned on tools and JSON\n",
         "Fine-tuned from the weights above (base and MTP head jointly, loss = base + 0.3 * mtp) by "
         "`tools/tiny_finetune.py finetune`; tokenizer, config and template unchanged. "
         f"Data (`ft-data`, tools/tiny_tooldata.py): {meta['samples']:,} chats rendered with the daemon's chat "
         "template: action requests answered by a call (Qwen3.5 XML, arguments copied from the request: paths, "
         "patterns, text, urls, integers, numbers, booleans, enums, arrays, nested objects; 1-5 tools shown), "
         "tool results as `<tool_response>` turns then a short answer, chit-chat with tools present answered in "
         "text, JSON answers with short strings, plain chats. Tools: hand-written families and, for 65% of the "
         "tool chats, made-up tools (random names and typed parameters). Held-out families, never trained on: "
         f"{', '.join(meta['heldout_families'])} ({len(meta['heldout_tools'])} tools: "
         f"{', '.join('`' + t + '`' for t in meta['heldout_tools'])}); the made-up names use no word of theirs "
         "that the hand-written training tools lack. Loss on assistant tokens only for chats; batches half stdlib code windows (the staged train "
         f"tokens), half chat windows; chat weight {c['chat_weight']}.\n",
         f"- {fin['device']}, torch {fin['torch']}: {fin['steps']} steps of {c['batch']} x {c['seq']} tokens "
         f"({fin['tokens']:,} tokens) in {fin['seconds']} s; peak lr {c['lr']}, warmup {c['warmup']:.0%}, "
         "cosine to 10%.",
         f"- held-out loss (base, mtp) before -> after: code {tuple(held[0]['code'])} -> "
         f"{tuple(held[-1]['code'])}; chats of held-out tool families (assistant tokens) "
         f"{tuple(held[0]['chat'])} -> {tuple(held[-1]['chat'])}.\n",
         "MTP acceptance on held-out code (`evaluate --acceptance-only`, same setup as above), by position, "
         "before -> after:\n",
         "| depth | before | after |\n|---|---|---|"]
    L += [f"| {k} | {ab[k]} | {aa[k]} |" for k in ("1", "2", "3", "4")]
    L += [f"\nHeld-out tool schemas (`tool-eval`, mlx-lm on the CPU, free greedy generation, {ta['cases']} "
          f"action requests over {len(ta['heldout_tools'])} held-out tools, {ta['max_tokens']} tokens):\n",
          "| rate of | before | after |\n|---|---|---|"]
    L += [f"| {d} | {tb[k]:.2f} | {ta[k]:.2f} |" for k, d in RATES]
    L += [f"\nFolder size without this card: {size:,} bytes.\n"]
    Path(args.asset, "MODEL_CARD.md").write_text(card.rstrip() + "\n" + "\n".join(L) + "\n")
    log(f"wrote {Path(args.asset, 'MODEL_CARD.md')}")


def add_parsers(sub):
    p = sub.add_parser("ft-data", help="stage tool/JSON chat data + code tokens for finetune")
    p.add_argument("--data", default=".ft_stage")
    p.add_argument("--samples", type=int, default=30000)
    p.add_argument("--held-samples", type=int, default=400)
    p.add_argument("--seed", type=int, default=41)
    p = sub.add_parser("finetune", help="fine-tune base + MTP from the current weights on code + tool chats")
    p.add_argument("--data", default=".ft_stage")
    p.add_argument("--init", default=None, help="start weights (default: --asset's model.safetensors)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=90.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--warmup", type=float, default=0.05)
    p.add_argument("--chat-weight", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=41)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--held-windows", type=int, default=16, help="windows per held-out loss (code, chat)")
    p.add_argument("--out", default=".ft_stage/run")
    p = sub.add_parser("tool-eval", help="held-out tool schemas: free generation with mlx on the CPU")
    p.add_argument("--per-tool", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json-cases", type=int, default=20)
    p.add_argument("--json-out", default=".ft_stage/tool_eval.json")


    p = sub.add_parser("ft-card", help="--asset's MODEL_CARD.md: the bundled card + the fine-tuning's numbers")
    p.add_argument("--data", default=".ft_stage")
    p.add_argument("--ft-log", required=True)
    p.add_argument("--before", required=True, help="folder with tool_eval.json + eval_acceptance_postnorm.json")
    p.add_argument("--after", required=True, help="the same for the candidate")


COMMANDS = {"ft-data": cmd_ft_data, "finetune": cmd_finetune, "tool-eval": cmd_tool_eval, "ft-card": cmd_ft_card}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default=str(ttm.DEFAULT_STAGE), help="train_tiny_model.py's staging folder (ignored by git)")
    ap.add_argument("--asset", default=str(ttm.DEFAULT_ASSET), help="the model folder fine-tuned and measured")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parsers(sub)
    args = ap.parse_args(argv)
    return COMMANDS[args.cmd](args)


if __name__ == "__main__":
    main()
