#!/usr/bin/env python3
"""Build councild's bundled model: a tiny, trained Qwen3.5 (GatedDeltaNet + gated full
attention) with a trained native MTP head, written in the HF format real Qwen3.5
checkpoints use.

Stages (each a subcommand; see `--help`):

  prepare   collect the Python standard library's source (this interpreter's lib dir),
            split it into train / held-out files by a fixed hash rule, train a byte-level
            BPE tokenizer on the train files, and write uint16 token arrays + a manifest
            into the staging folder (default .train_stage/, ignored by git).
  train     train the base LM and the MTP head jointly (loss = base + 0.3 * mtp) on the
            staged tokens, on cuda or cpu, for --steps steps or --time-budget seconds;
            writes state.safetensors (bf16, HF names incl. mtp.*) and train_log.json.
  export    write daemon/assets/tiny-qwen35/: config.json, model.safetensors (base via
            transformers' save_pretrained + the mtp.* tensors), tokenizer files,
            generation_config.json.
  evaluate  held-out base accuracy / perplexity, MTP acceptance by draft position for
            depths 1..4 against the base model's own greedy continuation, and greedy
            decodes; writes eval.json into the staging folder.
  card      write MODEL_CARD.md from the manifest, train log, eval and test results.

Fine-tuning the trained model on tool calls and JSON answers (ft-data, finetune, tool-eval,
ft-card) is tools/tiny_finetune.py, which builds on this file.

The MTP head (`mtp.*`) follows Qwen3.5's real head: fc [H, 2H] over
concat[pre_fc_norm_embedding(embed(tok t+1)), pre_fc_norm_hidden(base hidden t, post
final norm)], one gated full-attention decoder layer (transformers' own
Qwen3_5DecoderLayer, so names and forward are identical to a base full-attention layer),
mtp.norm, then the shared (tied) lm_head; it predicts token t+2.
"""
from __future__ import annotations

import argparse
import copy
import glob
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from tools/: the chat template is the daemon's
from daemon.engine.model.chat_templates import QWEN_TOOLS_TEMPLATE  # noqa: E402
DEFAULT_STAGE = REPO / ".train_stage"
DEFAULT_ASSET = REPO / "daemon" / "assets" / "tiny-qwen35"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# ChatML, and tools the Qwen3.5 way (daemon/engine/model/chat_templates.py); without tools it is
# exactly the plain ChatML template the model was trained with.
CHAT_TEMPLATE = QWEN_TOOLS_TEMPLATE
HELDOUT_MOD = 25  # a file is held out when int(sha256(relpath)[:8], 16) % 25 == 0
MTP_LOSS_WEIGHT = 0.3

# The model: hidden 256, 6 layers (GDN, GDN, full, GDN, GDN, full), vocab 4096, tied.
MODEL_KW = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    full_attention_interval=3,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- prepare


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_files(root: Path):
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        if not p.is_file():
            continue
        files.append((rel, p))
    return files


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % HELDOUT_MOD == 0


def cmd_prepare(args):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    stage = Path(args.stage)
    stage.mkdir(parents=True, exist_ok=True)
    root = Path(args.corpus) if args.corpus else stdlib_dir()
    train_docs, held_docs, train_names, held_names, skipped = [], [], [], [], []
    agg = hashlib.sha256()
    for rel, p in collect_files(root):
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if not text.strip():
            continue
        agg.update(f"{rel}\0{hashlib.sha256(raw).hexdigest()}\n".encode())
        if is_heldout(rel):
            held_docs.append(text)
            held_names.append(rel)
        else:
            train_docs.append(text)
            train_names.append(rel)
    log(f"corpus {root}: {len(train_docs)} train files, {len(held_docs)} held-out, "
        f"{len(skipped)} skipped (not utf-8)")

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL_KW["vocab_size"],
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t0 = time.time()
    tok.train_from_iterator(train_docs, trainer=trainer)
    log(f"tokenizer trained in {time.time() - t0:.1f}s, vocab {tok.get_vocab_size()}")
    assert tok.get_vocab_size() <= MODEL_KW["vocab_size"]
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2]
    tok.save(str(stage / "tokenizer.json"))

    eot = tok.token_to_id("<|endoftext|>")

    def encode(docs):
        out = []
        for enc in tok.encode_batch(docs):
            out.extend(enc.ids)
            out.append(eot)
        return np.asarray(out, dtype=np.uint16)

    t0 = time.time()
    tr = encode(train_docs)
    ho = encode(held_docs)
    log(f"encoded in {time.time() - t0:.1f}s: train {tr.size} tokens, held-out {ho.size} tokens")
    np.save(stage / "train.npy", tr)
    np.save(stage / "heldout.npy", ho)
    train_bytes = sum(len(d.encode()) for d in train_docs)
    manifest = {
        "corpus_root": str(root),
        "python": sys.version.split()[0],
        "rule": f"held out iff int(sha256(relpath)[:8], 16) % {HELDOUT_MOD} == 0; "
                "files not valid utf-8 skipped",
        "aggregate_sha256": agg.hexdigest(),
        "aggregate_recipe": "sha256 over sorted lines f'{relpath}\\0{sha256(file bytes)}\\n' "
                            "for every used file (train and held-out)",
        "train_files": len(train_names),
        "heldout_files": held_names,
        "skipped_files": skipped,
        "train_bytes": train_bytes,
        "train_tokens": int(tr.size),
        "heldout_tokens": int(ho.size),
        "bytes_per_token_train": round(train_bytes / tr.size, 3),
        "vocab_size": tok.get_vocab_size(),
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log(json.dumps({k: v for k, v in manifest.items() if k != "heldout_files"}, indent=1))


# --------------------------------------------------------------------------- model


def build_config():
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**copy.deepcopy(MODEL_KW))
    cfg._attn_implementation = "sdpa"
    return cfg


def make_modules():
    """Returns the classes, imported here so `prepare` and `card` need no torch."""
    import torch
    from torch import nn
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    class MTPHead(nn.Module):
        """Qwen3.5's native MTP head, one layer. Weight names match real checkpoints
        (under the `mtp.` prefix): fc, pre_fc_norm_embedding, pre_fc_norm_hidden,
        layers.0.*, norm. RMSNorms are transformers' zero-centred Qwen3_5RMSNorm
        (effective scale 1 + w)."""

        def __init__(self, config):
            super().__init__()
            H, eps = config.hidden_size, config.rms_norm_eps
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=eps)
            mcfg = copy.deepcopy(config)
            mcfg.num_hidden_layers = 1
            mcfg.layer_types = ["full_attention"]
            self.layers = nn.ModuleList([Qwen3_5DecoderLayer(mcfg, 0)])
            self.norm = Qwen3_5RMSNorm(H, eps=eps)

        def forward(self, hidden, next_embeds, position_embeddings):
            """hidden: base hidden at t (after the base's final norm) or, at depth > 1,
            the head's own pre-norm output; next_embeds: embed(token t+1).
            Returns (pre-norm output, normed output); lm_head(normed) predicts t+2."""
            x = torch.cat([self.pre_fc_norm_embedding(next_embeds),
                           self.pre_fc_norm_hidden(hidden)], dim=-1)
            x = self.fc(x)
            # attention_mask=None + sdpa -> is_causal (checked by causality_selfcheck)
            out = self.layers[0](x, position_embeddings, None)
            if isinstance(out, tuple):
                out = out[0]
            return out, self.norm(out)

    class TinyQwen35MTP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.lm = Qwen3_5ForCausalLM(config)
            self.mtp = MTPHead(self.lm.config)
            for m in self.mtp.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=config.initializer_range)
                elif isinstance(m, Qwen3_5RMSNorm):
                    nn.init.zeros_(m.weight)

        def rope(self, x, T, offset=0):
            # [3, B, T] (text positions for mrope's three sections): transformers 5.17
            # requires the 3-d form, 5.24 accepts it too
            pos = torch.arange(offset, offset + T, device=x.device)[None, None].expand(3, x.shape[0], -1)
            return self.lm.model.rotary_emb(x, pos)

        def base(self, ids):
            h = self.lm.model(input_ids=ids).last_hidden_state  # post final norm
            return h, self.lm.lm_head(h)

        def mtp_logits(self, h, ids):
            """Teacher-forced head over slots t = 0..T-2: pair (h_t, ids_{t+1}).
            Returns (pre-norm g [B,T-1,H], logits [B,T-1,V]) predicting ids_{t+2}."""
            T = ids.shape[1]
            e = self.lm.model.embed_tokens(ids[:, 1:])
            pe = self.rope(h, T - 1)
            g, gn = self.mtp(h[:, :-1], e, pe)
            return g, self.lm.lm_head(gn)

        def hf_state_dict(self):
            sd = {k: v for k, v in self.lm.state_dict().items()}
            sd.update({"mtp." + k: v for k, v in self.mtp.state_dict().items()})
            if self.lm.config.tie_word_embeddings:
                sd.pop("lm_head.weight", None)
            return sd

        def load_hf_state_dict(self, sd):
            base = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
            head = {k[4:]: v for k, v in sd.items() if k.startswith("mtp.")}
            missing, unexpected = self.lm.load_state_dict(base, strict=False)
            missing = [m for m in missing if m != "lm_head.weight"]
            assert not missing and not unexpected, (missing, unexpected)
            self.mtp.load_state_dict(head, strict=True)
            if self.lm.config.tie_word_embeddings:
                self.lm.tie_weights()

    return torch, TinyQwen35MTP


def causality_selfcheck(torch, model, device):
    """Future tokens must not change earlier outputs of base or head."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.lm.config.vocab_size, (1, 24), generator=g).to(device)
    ids2 = ids.clone()
    ids2[0, 16:] = (ids2[0, 16:] + 7) % model.lm.config.vocab_size
    with torch.no_grad():
        h1, l1 = model.base(ids)
        h2, l2 = model.base(ids2)
        _, m1 = model.mtp_logits(h1, ids)
        _, m2 = model.mtp_logits(h2, ids2)
    db = (l1[0, :16] - l2[0, :16]).abs().max().item()
    dm = (m1[0, :15] - m2[0, :15]).abs().max().item()
    assert db < 1e-3 and dm < 1e-3, f"causality broken: base {db}, mtp {dm}"
    log(f"causality self-check ok (base {db:.2e}, mtp {dm:.2e})")


def count_params(model):
    base = sum(p.numel() for p in model.lm.parameters())
    head = sum(p.numel() for p in model.mtp.parameters())
    return base, head


# --------------------------------------------------------------------------- train


def cmd_train(args):
    torch, TinyQwen35MTP = make_modules()
    import torch.nn.functional as F
    from safetensors.torch import save_file

    import transformers
    stage = Path(args.stage)
    out = Path(args.out or stage)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    np_rng = np.random.default_rng(args.seed)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    train = np.load(stage / "train.npy").astype(np.int64)
    held = np.load(stage / "heldout.npy").astype(np.int64)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {dev}; "
        f"train tokens {train.size}, held-out {held.size}")

    cfg = build_config()
    model = TinyQwen35MTP(cfg).to(dev)
    nb, nh = count_params(model)
    log(f"params: base {nb} (embedding {cfg.vocab_size * cfg.hidden_size}, tied), mtp {nh}; "
        f"layer_types {model.lm.config.layer_types}; attn {model.lm.config._attn_implementation}")
    causality_selfcheck(torch, model, dev)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
        fused=(dev.type == "cuda"),
    )
    B, T = args.batch, args.seq
    amp = dev.type == "cuda"

    def batch():
        starts = np_rng.integers(0, train.size - T - 1, size=B)
        x = np.stack([train[s:s + T] for s in starts])
        return torch.from_numpy(x).to(dev, non_blocking=True)

    def losses(ids):
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=amp):
            h, logits = model.base(ids)
            _, ml = model.mtp_logits(h, ids)
        V = logits.shape[-1]
        lb = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))
        lm = F.cross_entropy(ml[:, :-1].float().reshape(-1, V), ids[:, 2:].reshape(-1))
        return lb, lm

    @torch.no_grad()
    def held_eval(n_seq=32):
        model.eval()
        rng = np.random.default_rng(1234)
        starts = rng.integers(0, held.size - T - 1, size=n_seq)
        tot_b = tot_m = 0.0
        for i in range(0, n_seq, 8):
            x = torch.from_numpy(np.stack([held[s:s + T] for s in starts[i:i + 8]])).to(dev)
            lb, lm = losses(x)
            tot_b += lb.item() * len(x)
            tot_m += lm.item() * len(x)
        model.train()
        return tot_b / n_seq, tot_m / n_seq

    def lr_at(frac):
        if frac < args.warmup:
            return args.lr * frac / args.warmup
        p = min(1.0, (frac - args.warmup) / max(1e-9, 1 - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    def save(tag):
        sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.hf_state_dict().items()}
        save_file(sd, str(out / "state.safetensors"), metadata={"tag": tag})

    hist = {"config": {k: v for k, v in vars(args).items()}, "rows": [], "held": []}
    model.train()
    t_start = time.time()
    last_save = t_start
    step, toks = 0, 0
    run_lb = run_lm = None
    while True:
        el = time.time() - t_start
        if args.steps and step >= args.steps:
            break
        if args.time_budget and el >= args.time_budget:
            break
        frac = (step / args.steps) if args.steps else (el / args.time_budget)
        lr = lr_at(frac)
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        ids = batch()
        lb, lm = losses(ids)
        loss = lb + MTP_LOSS_WEIGHT * lm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        toks += B * T
        if step % args.log_every == 0 or step == 1:
            lbv, lmv = lb.item(), lm.item()
            run_lb = lbv if run_lb is None else 0.9 * run_lb + 0.1 * lbv
            run_lm = lmv if run_lm is None else 0.9 * run_lm + 0.1 * lmv
            el = time.time() - t_start
            row = {"step": step, "tokens": toks, "sec": round(el, 1), "lr": lr,
                   "loss_base": round(lbv, 4), "loss_mtp": round(lmv, 4), "gnorm": round(gn.item(), 3)}
            hist["rows"].append(row)
            log(f"step {step} tok {toks/1e6:.1f}M {el:.0f}s lr {lr:.2e} base {lbv:.3f} "
                f"mtp {lmv:.3f} gn {gn.item():.2f} {toks/max(el,1e-9)/1e3:.0f}k tok/s")
        if step % args.eval_every == 0:
            hb, hm = held_eval()
            hist["held"].append({"step": step, "tokens": toks, "sec": round(time.time() - t_start, 1),
                                 "held_base": round(hb, 4), "held_mtp": round(hm, 4)})
            log(f"  held-out: base {hb:.3f} (ppl {math.exp(hb):.2f}) mtp {hm:.3f}")
        if time.time() - last_save > args.save_every:
            save(f"step{step}")
            last_save = time.time()
            (out / "train_log.json").write_text(json.dumps(hist, indent=1))
    el = time.time() - t_start
    hb, hm = held_eval()
    hist["held"].append({"step": step, "tokens": toks, "sec": round(el, 1),
                         "held_base": round(hb, 4), "held_mtp": round(hm, 4)})
    hist["final"] = {"steps": step, "tokens": toks, "train_seconds": round(el, 1),
                     "tok_per_s": round(toks / el), "held_base_loss": hb, "held_mtp_loss": hm,
                     "device": str(dev), "device_name": (torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "params_base": nb, "params_mtp": nh}
    log(f"done: {step} steps, {toks/1e6:.1f}M tokens in {el:.0f}s; held-out base {hb:.3f} "
        f"(ppl {math.exp(hb):.2f}) mtp {hm:.3f}")
    save(f"final-step{step}")
    (out / "train_log.json").write_text(json.dumps(hist, indent=1))


# --------------------------------------------------------------------------- export


def cmd_export(args):
    torch, TinyQwen35MTP = make_modules()
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    stage = Path(args.stage)
    asset = Path(args.asset)
    asset.mkdir(parents=True, exist_ok=True)
    cfg = build_config()
    model = TinyQwen35MTP(cfg)
    sd = load_file(str(Path(args.state) if args.state else stage / "state.safetensors"))
    model.load_hf_state_dict({k: v.float() for k, v in sd.items()})
    model.lm.to(torch.bfloat16)
    model.lm.config.architectures = ["Qwen3_5ForCausalLM"]
    model.lm.save_pretrained(str(asset), safe_serialization=True)
    # config: transformers' own text config, plus what mlx-lm and the MTP loader read
    cpath = asset / "config.json"
    c = json.loads(cpath.read_text())
    c["model_type"] = "qwen3_5"  # mlx-lm has a qwen3_5 module, not qwen3_5_text
    c["full_attention_interval"] = MODEL_KW["full_attention_interval"]
    c["mtp_num_hidden_layers"] = 1
    c["mtp_use_dedicated_embeddings"] = False
    cpath.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    # append the mtp.* tensors to the same safetensors file
    wpath = asset / "model.safetensors"
    base = load_file(str(wpath))
    head = {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items() if k.startswith("mtp.")}
    base.update(head)
    save_file(base, str(wpath), metadata={"format": "pt"})
    os.chmod(wpath, 0o644)
    log(f"wrote {len(base)} tensors ({len(head)} mtp.*) to {wpath}")
    # tokenizer
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(stage / "tokenizer.json")),
        eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=MODEL_KW["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(asset))
    tcfg = json.loads((asset / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = CHAT_TEMPLATE
    (asset / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    for extra in ("chat_template.jinja",):
        p = asset / extra
        if p.exists():
            p.unlink()
    GenerationConfig(
        bos_token_id=None, eos_token_id=[0, 2], pad_token_id=0,
        do_sample=False, max_new_tokens=256,
    ).save_pretrained(str(asset))
    total = sum(p.stat().st_size for p in asset.iterdir() if p.is_file())
    for p in sorted(asset.iterdir()):
        log(f"  {p.name}: {p.stat().st_size}")
    log(f"total {total} bytes")


# --------------------------------------------------------------------------- evaluate


def load_exported(asset):
    """The torch model (base + head) from the exported folder, float32 on cpu."""
    torch, TinyQwen35MTP = make_modules()
    from safetensors.torch import load_file

    cfg = build_config()
    model = TinyQwen35MTP(cfg)
    sd = load_file(str(Path(asset) / "model.safetensors"))
    model.load_hf_state_dict({k: v.float() for k, v in sd.items()})
    model.eval()
    return torch, model


def held_prompts(held, n, plen, gen, seed=7):
    """n prompts of plen tokens from the held-out stream, each followed by >= gen tokens
    of the same file (no <|endoftext|> inside prompt + continuation)."""
    rng = np.random.default_rng(seed)
    out, tries = [], 0
    while len(out) < n and tries < 10000:
        tries += 1
        s = int(rng.integers(0, held.size - plen - gen - 1))
        win = held[s:s + plen + gen]
        if (win == 0).any():
            continue
        out.append(held[s:s + plen].copy())
    return out


FEEDBACK_DOC = {
    "postnorm": "the head's normed output (after mtp.norm, the tensor the lm_head reads), as vLLM's "
                "Qwen3-Next/Qwen3.5 MTP and councild's engine feed it back",
    "prenorm": "the head's pre-norm output (the input of mtp.norm)",
}


def cmd_evaluate(args):
    torch, model = load_exported(args.asset)
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.asset) / "tokenizer.json"))
    stage = Path(args.stage)
    held = np.load(stage / "heldout.npy").astype(np.int64)
    res = {}
    T = 512
    # ---- base next-token accuracy / perplexity over the first N held-out tokens
    n_tok = 0 if args.acceptance_only else min(args.eval_tokens, held.size - 1)
    nll = correct = count = 0
    mtp_correct = mtp_count = 0
    t0 = time.time()
    with torch.no_grad():
        for s in range(0, n_tok - T, T):
            ids = torch.from_numpy(held[s:s + T + 1][None])
            h, logits = model.base(ids[:, :T])
            lp = torch.log_softmax(logits[0].float(), -1)
            tgt = ids[0, 1:T + 1]
            nll += -lp.gather(1, tgt[:, None]).sum().item()
            correct += (logits[0].argmax(-1) == tgt).sum().item()
            count += T
            _, ml = model.mtp_logits(h, ids[:, :T])
            mtp_correct += (ml[0, :-1].argmax(-1) == ids[0, 2:T]).sum().item()
            mtp_count += T - 2
    if not args.acceptance_only:
        res["heldout_tokens_scored"] = count
        res["base_next_token_acc"] = correct / count
        res["base_ppl"] = math.exp(nll / count)
        res["base_nll"] = nll / count
        res["mtp_teacher_forced_acc_vs_data"] = mtp_correct / mtp_count
        log(f"held-out: {count} tokens, base acc {res['base_next_token_acc']:.4f}, ppl {res['base_ppl']:.3f}, "
            f"mtp(t+2 vs data) acc {res['mtp_teacher_forced_acc_vs_data']:.4f} [{time.time()-t0:.0f}s]")
    if args.base_only:  # refresh only the held-out scores in an existing eval.json
        old = json.loads((stage / "eval.json").read_text())
        old.update(res)
        (stage / "eval.json").write_text(json.dumps(old, indent=1))
        return

    # ---- acceptance against the base's own greedy continuation
    prompts = held_prompts(held, args.n_prompts, args.prompt_len, args.gen)
    lm_head = model.lm.lm_head
    embed = model.lm.model.embed_tokens
    stats = {k: {"attempted": [0] * k, "accepted": [0] * k, "cycles": 0, "tokens": 0}
             for k in (1, 2, 3, 4)}
    t0 = time.time()
    # the base's greedy continuations do not depend on the head: cache them per asset + setup
    wsha = hashlib.sha256((Path(args.asset) / "model.safetensors").read_bytes()).hexdigest()[:16]
    gpath = stage / f"greedy_{wsha}_{len(prompts)}_{args.prompt_len}_{args.gen}.npy"
    greedy = np.load(gpath) if gpath.exists() else None
    new_greedy = []
    for pi, prompt in enumerate(prompts):
        with torch.no_grad():
            if greedy is not None:
                seq = torch.from_numpy(greedy[pi][None].astype(np.int64))
            else:
                seq = torch.from_numpy(prompt[None])
                for _ in range(args.gen):  # greedy, full forward each step
                    _, lg = model.base(seq)
                    seq = torch.cat([seq, lg[:, -1:].argmax(-1)], 1)
                new_greedy.append(seq[0].numpy())
            H, _ = model.base(seq)  # base hiddens (post final norm) for the whole sequence
        x = seq[0]
        N, P = x.shape[0], prompt.shape[0]
        for k in (1, 2, 3, 4):
            st = stats[k]
            q = P  # index of the primary token (the newest committed token)
            while q + k < N:
                # head history: slots S = 0..q-1 hold (H_S, x_{S+1}); the last one is the query
                hs = H[:, :q]
                es = embed(x[None, 1:q + 1])
                drafts = []
                with torch.no_grad():
                    for i in range(k):
                        L = hs.shape[1]
                        g, gn = model.mtp(hs, es, model.rope(hs, L))
                        d = lm_head(gn[:, -1]).argmax(-1)  # drafts x_{q+i+1}
                        drafts.append(int(d))
                        # depth i+1: feed the head's own output hidden + its draft
                        fb = gn if args.feedback == "postnorm" else g
                        hs = torch.cat([hs, fb[:, -1:]], 1)
                        es = torch.cat([es, embed(d)[:, None]], 1)
                n_acc = 0
                for i, d in enumerate(drafts):
                    st["attempted"][i] += 1
                    if d == int(x[q + i + 1]):
                        st["accepted"][i] += 1
                        n_acc += 1
                    else:
                        break
                st["cycles"] += 1
                st["tokens"] += n_acc + 1
                q += n_acc + 1
        if pi % 4 == 3:
            log(f"  prompt {pi+1}/{len(prompts)} [{time.time()-t0:.0f}s] d1 "
                f"{stats[1]['accepted'][0]/max(1,stats[1]['attempted'][0]):.3f}")
    if greedy is None:
        np.save(gpath, np.stack(new_greedy))
    acc = {}
    for k, st in stats.items():
        cond = [a / t if t else None for a, t in zip(st["accepted"], st["attempted"])]
        acc[str(k)] = {"conditional_acceptance_by_position": cond,
                       "attempted": st["attempted"], "accepted": st["accepted"],
                       "tokens_per_cycle": st["tokens"] / max(1, st["cycles"])}
        log(f"depth {k}: acceptance by position {[round(c, 3) if c is not None else None for c in cond]}, "
            f"tokens/cycle {acc[str(k)]['tokens_per_cycle']:.3f}")
    res["acceptance"] = acc
    res["acceptance_setup"] = {"prompts": len(prompts), "prompt_len": args.prompt_len,
                               "greedy_tokens_per_prompt": args.gen,
                               "feedback_hidden": FEEDBACK_DOC[args.feedback]}
    (stage / f"eval_acceptance_{args.feedback}.json").write_text(
        json.dumps({"acceptance": acc, "acceptance_setup": res["acceptance_setup"]}, indent=1))
    if args.acceptance_only:
        return

    # ---- greedy decodes from 3 held-out code prompts
    samples = []
    ids_all = held
    names = json.loads((stage / "manifest.json").read_text())["heldout_files"]
    import re

    root = Path(json.loads((stage / "manifest.json").read_text())["corpus_root"])
    defre = re.compile(r"^[ \t]*def ", re.M)
    if args.sample_files is None:
        pick = [n for n in names if "test" not in n and defre.search((root / n).read_text())][:3]
    else:
        pick = args.sample_files
    for name in pick[:3]:
        src = (root / name).read_text()
        # prompt: the first function definition in the file, dedented to its line start
        i = defre.search(src).start()
        prompt_text = src[i:i + 160]
        ids = torch.tensor([tok.encode(prompt_text).ids])
        with torch.no_grad():
            for _ in range(args.sample_tokens):
                _, lg = model.base(ids)
                nxt = lg[:, -1:].argmax(-1)
                ids = torch.cat([ids, nxt], 1)
                if int(nxt) == 0:
                    break
        text = tok.decode(ids[0].tolist())
        samples.append({"file": name, "prompt": prompt_text, "completion": text[len(prompt_text):]})
        log(f"--- {name}\n{text}\n")
    res["samples"] = samples
    res["measured_with"] = f"torch {torch.__version__} cpu float32 from the exported bf16 weights"
    (stage / "eval.json").write_text(json.dumps(res, indent=1))


# --------------------------------------------------------------------------- mlx speed


def cmd_mlx_speed(args):
    import platform

    import mlx.core as mx
    import mlx_lm
    from mlx_lm import load, stream_generate

    stage = Path(args.stage)
    model, tok = load(args.asset)
    held = np.load(stage / "heldout.npy")
    prompt = [int(t) for t in held[5000:5128]]
    for _ in range(2):  # warm-up, then measure
        last = None
        for r in stream_generate(model, tok, prompt, max_tokens=args.tokens):
            last = r
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    res = {"mlx_lm": mlx_lm.__version__, "device": str(mx.default_device()), "cpu": f"{cpu}, {os.cpu_count()} cores",
           "prompt_tokens": len(prompt), "tokens": last.generation_tokens,
           "generation_tps": last.generation_tps, "prompt_tps": last.prompt_tps}
    (stage / "mlx_speed.json").write_text(json.dumps(res, indent=1))
    log(json.dumps(res))


# --------------------------------------------------------------------------- card

RUN_NOTES = [
    "\n## Runs\n",
    "Two GPU runs were made with this script and the same seed and data. The first, "
    "`--time-budget 345` (2,032 steps, 133M tokens, 15 epochs), overfit: its held-out base loss was "
    "best at step 1,200 (1.765) and ended at 1.879 (ppl 6.55), held-out MTP loss 1.834. The second, "
    "`--time-budget 150` (885 steps, 58M tokens, 6.6 epochs), is the one shipped: held-out base loss "
    "1.785 (ppl 5.96) at its end, MTP 1.870. It was chosen on held-out base loss alone, before its "
    "acceptance was measured. Device time for both calls: about 10.3 minutes of the H200, machine "
    "start and a first call that failed in 20 s (transformers 5.17 wants 3-d rope positions) included.",
    "\nCross-check with councild's own MLX engine (2026-11-29, the engine as committed then): "
    "`python -m daemon.measure.spec_bench --model daemon/assets/tiny-qwen35 --rounds 5 --tokens 32 "
    "--prompts 2 --depths 1,2` loads this head from model.safetensors and reports depth-1 acceptance 0.67 at 1.64 tokens/cycle "
    "on its first two (short, code) prompts, i.e. about 26 accepted of about 39 drafts; this script's "
    "torch simulation on the same prompts and 32 greedy tokens accepted 26 of 37 (0.70; the engine's "
    "run also counts the drafts of its last cycle). Short prompts give the head "
    "little history, hence lower than the 192-token-prompt figure above.",
    "\nCaveat on acceptance: a 7M-parameter model's greedy continuation falls into loops after a "
    "few dozen tokens (see the decodes below), and loops are easy to draft, so the acceptance above "
    "is higher than it would be on a real model's non-repeating output. The teacher-forced head "
    "accuracy against the real held-out text (the MTP line above) is the harder number.",
]

REPRODUCE = """\
# here (CPU; .venv with mlx[cpu] 0.32.4, mlx-lm 0.32.2, transformers 5.24, tokenizers)
.venv/bin/pip install torch==2.13.0                     # CPU wheel: train/export/evaluate/test need it
.venv/bin/python tools/train_tiny_model.py prepare      # stdlib -> .train_stage/{train,heldout}.npy, tokenizer, manifest
.venv/bin/python tools/train_tiny_model.py train --device cpu --steps 6 --batch 2 --seq 256 --out /tmp/smoke  # smoke
# on the H200 (torch 2.11 + transformers 5.17), repo + .train_stage carried, about 2.7 min:
python3 tools/train_tiny_model.py train --device cuda --time-budget 150 --batch 64 --seq 1024 --eval-every 100 --out $OUT
#   (the lr schedule runs on elapsed time; for a step-exact rerun give --steps 885 instead)
# back here, $OUT/{state.safetensors,train_log.json} copied to .train_stage/run2/:
.venv/bin/python tools/train_tiny_model.py export --state .train_stage/run2/state.safetensors
cp .train_stage/run2/train_log.json .train_stage/train_log.json
# (on a shared, busy CPU add --threads 1: oversubscribed torch threads ran ~10x slower here)
.venv/bin/python tools/train_tiny_model.py evaluate     # -> .train_stage/eval.json, eval_acceptance_postnorm.json
.venv/bin/python tools/train_tiny_model.py evaluate --acceptance-only --feedback prenorm   # -> eval_acceptance_prenorm.json
.venv/bin/python tools/train_tiny_model.py evaluate --base-only --eval-tokens 500000   # all held-out tokens
.venv/bin/python tools/train_tiny_model.py mlx-speed    # -> .train_stage/mlx_speed.json
.venv/bin/python -m pytest -q -s tests/daemon/test_bundled_model.py   # prints the logits line
.venv/bin/python tools/train_tiny_model.py card --logits-line "<the printed line>"
"""



def cmd_card(args):
    stage = Path(args.stage)
    asset = Path(args.asset)
    man = json.loads((stage / "manifest.json").read_text())
    tl = json.loads((stage / "train_log.json").read_text())
    ev = json.loads((stage / "eval.json").read_text())
    from safetensors import safe_open

    with safe_open(str(asset / "model.safetensors"), framework="numpy") as f:
        mtp_keys = sorted(k for k in f.keys() if k.startswith("mtp."))
    extra = {"mtp_tensors": mtp_keys, "notes": RUN_NOTES, "reproduce": REPRODUCE}
    if args.logits_line:
        extra["logits_test"] = args.logits_line
    if (stage / "mlx_speed.json").exists():
        sp = json.loads((stage / "mlx_speed.json").read_text())
        extra["mlx_speed"] = (f"mlx-lm {sp['mlx_lm']} on this machine's CPU ({sp['cpu']}), bf16, greedy, "
                              f"{sp['tokens']} tokens after a {sp['prompt_tokens']}-token prompt: "
                              f"**{sp['generation_tps']:.1f} tok/s** decode, {sp['prompt_tps']:.0f} tok/s prefill "
                              "(serial, no speculation; the machine was shared with other jobs).")
    cfg = json.loads((asset / "config.json").read_text())
    sizes = {p.name: p.stat().st_size for p in sorted(asset.iterdir()) if p.is_file() and p.name != "MODEL_CARD.md"}
    fin = tl["final"]
    L = []
    w = L.append
    w("# tiny-qwen35: councild's bundled model\n")
    w("A small **trained** Qwen3.5-architecture language model (GatedDeltaNet linear-attention "
      "layers + gated full attention) with a **trained native MTP head**, shipped so that every "
      "machine can run councild's whole job, MTP self-speculation included, with no download. "
      "It writes recognisable Python and nothing else of use; it is a test and demo fixture, "
      "not an assistant.\n")
    w("## Format\n")
    w("HF format, as real Qwen3.5 checkpoints: `config.json` (transformers' own "
      "`Qwen3_5TextConfig` output), `model.safetensors` (bf16; base tensors exactly as "
      "`Qwen3_5ForCausalLM.save_pretrained` writes them — zero-centred RMSNorm weights "
      "(effective scale 1+w), conv1d as [C, 1, K] — plus the `mtp.*` tensors in the same "
      "convention), `tokenizer.json`, `tokenizer_config.json` (chat template "
      "`<|im_start|>role\\n...<|im_end|>`), `generation_config.json`.\n")
    w("- `model_type` is `qwen3_5` (transformers writes `qwen3_5_text` for the text-only config; "
      "mlx-lm has a `qwen3_5` module and no `qwen3_5_text` one, and its `qwen3_5.Model` accepts a "
      "flat text config). Loading with transformers: `Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg))` "
      "(see the test), or `from_pretrained`, which warns about the type name.\n")
    w("- `full_attention_interval`, `mtp_num_hidden_layers: 1` and `mtp_use_dedicated_embeddings: false` "
      "are added to the config as real Qwen3.5 configs carry them (mlx-lm reads the interval).\n")
    w("- Embeddings are tied (`tie_word_embeddings: true`), so there is no `lm_head.weight`; the "
      "MTP head shares the lm_head (= the embedding).\n")
    w("\n## Config\n")
    keys = ["model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "layer_types", "full_attention_interval", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "mtp_num_hidden_layers"]
    w("```json\n" + json.dumps({k: cfg.get(k) for k in keys}, indent=1) + "\n```\n")
    w(f"Parameters: base {fin['params_base']:,} (of which the tied embedding "
      f"{cfg['vocab_size'] * cfg['hidden_size']:,}), MTP head {fin['params_mtp']:,}.\n")
    w("\n## Files\n")
    w("| file | bytes |\n|---|---|")
    for k, v in sizes.items():
        w(f"| {k} | {v:,} |")
    w(f"| **total (without this card)** | **{sum(sizes.values()):,}** |\n")
    if "mtp_tensors" in extra:
        w(f"`mtp.*` tensors ({len(extra['mtp_tensors'])}): " + ", ".join(f"`{t}`" for t in extra["mtp_tensors"]) + "\n")
    w("\n## The MTP head\n")
    w("Forward for position t: `e = pre_fc_norm_embedding(embed(token t+1))`, "
      "`h = pre_fc_norm_hidden(base hidden at t, after the base's final norm)`, "
      "`x = fc(concat[e, h])` (embedding first), then `mtp.layers.0` (transformers' own "
      "`Qwen3_5DecoderLayer` built as a full-attention layer: input_layernorm, gated "
      "self_attn with q_proj twice as wide, q_norm/k_norm, post_attention_layernorm, SwiGLU mlp; "
      "causal attention over the head's own sequence, rotary position t for slot t, the base's "
      "rotary settings), then `mtp.norm`, then the shared lm_head: predicts token t+2.\n")
    w("Depth k > 1 feeds back the head's output hidden together with the token it just drafted. "
      "Which output: vLLM's Qwen3-Next MTP (`qwen3_next_mtp.py`) applies `mtp.norm` inside the "
      "head's forward and feeds that normed output back, and councild's engine does the same, so the "
      "primary acceptance numbers below use the **post-norm** output; the pre-norm output (the input of "
      "`mtp.norm`) is measured too.\n")
    w("\n## Data\n")
    w(f"The Python standard library's source from `{man['corpus_root']}` (CPython {man['python']}; "
      "`*.py`, `site-packages` excluded, tests included). "
      f"Rule: {man['rule']}.\n")
    w(f"- aggregate sha256: `{man['aggregate_sha256']}` ({man['aggregate_recipe']})")
    w(f"- train: {man['train_files']} files, {man['train_bytes']:,} bytes, {man['train_tokens']:,} tokens "
      f"({man['bytes_per_token_train']} bytes/token)")
    w(f"- held out (never trained on, tokenizer not trained on them either): "
      f"{len(man['heldout_files'])} files, {man['heldout_tokens']:,} tokens")
    w(f"- skipped (not utf-8): {', '.join(man['skipped_files']) or 'none'}")
    w(f"\nHeld-out files: {', '.join('`' + f + '`' for f in man['heldout_files'])}\n")
    w("Tokenizer: byte-level BPE trained with `tokenizers` on the train files, vocab "
      f"{man['vocab_size']}, NFC normaliser and Qwen3.5's pre-tokenizer regex; special tokens "
      "`<|endoftext|>` (0, also eos/pad; separates files), `<|im_start|>` (1), `<|im_end|>` (2).\n")
    w("\n## Training recipe\n")
    c = tl["config"]
    w(f"- seed {c['seed']}; AdamW (betas 0.9/0.95, weight decay {c['weight_decay']} on matrices), "
      f"peak lr {c['lr']}, linear warmup over the first {c['warmup']:.0%} of the budget then cosine "
      "to 10% of peak; the schedule runs on elapsed time over the time budget (or on steps when "
      "`--steps` is given); grad clip 1.0; bf16 autocast, fp32 master weights.")
    w(f"- batch {c['batch']} x {c['seq']} tokens, random windows of the train token stream.")
    w(f"- loss = CE(base next token) + {MTP_LOSS_WEIGHT} * CE(MTP, token t+2), trained **jointly** "
      "from scratch, gradients of the MTP loss flowing into the base (as real Qwen3.5/DeepSeek-V3 "
      "MTP). Why jointly: one run inside the device-time budget trains both; the 0.3 weight keeps the "
      "base objective dominant; and the base hidden the head sees at inference is the one it "
      "was trained with (no separate head phase to schedule).")
    w(f"- ran on: {fin['device_name']} (torch {fin['torch']}, transformers {fin['transformers']}): "
      f"{fin['steps']} steps, {fin['tokens']:,} tokens ({fin['tokens']/man['train_tokens']:.1f} epochs) "
      f"in {fin['train_seconds']} s ({fin['tok_per_s']:,} tok/s).\n")
    w("Loss curve (train: single-batch values at the logged step; held-out: 32 x "
      f"{c['seq']}-token windows):\n")
    w("| step | tokens | sec | train base | train mtp | lr |\n|---|---|---|---|---|---|")
    rows = tl["rows"]
    pick = rows if len(rows) <= 16 else [rows[int(i * (len(rows) - 1) / 15)] for i in range(16)]
    for r in pick:
        w(f"| {r['step']} | {r['tokens']:,} | {r['sec']} | {r['loss_base']:.3f} | {r['loss_mtp']:.3f} | {r['lr']:.2e} |")
    w("\n| step | tokens | held-out base loss | held-out ppl | held-out mtp loss |\n|---|---|---|---|---|")
    for r in tl["held"]:
        w(f"| {r['step']} | {r['tokens']:,} | {r['held_base']:.3f} | {math.exp(r['held_base']):.2f} | {r['held_mtp']:.3f} |")
    w("\n## Measured (held-out)\n")
    w(f"Measured with {ev['measured_with']}.\n")
    w(f"- base next-token accuracy **{ev['base_next_token_acc']:.4f}**, perplexity **{ev['base_ppl']:.3f}** "
      f"(first {ev['heldout_tokens_scored']:,} held-out tokens, i.e. "
      f"{'all of them' if ev['heldout_tokens_scored'] > 0.98 * man['heldout_tokens'] else 'the first held-out files'}, "
      "in consecutive 512-token windows; the training-time figure above uses 32 random 1024-token windows)")
    w(f"- MTP head, teacher-forced, top-1 vs the data's token t+2: {ev['mtp_teacher_forced_acc_vs_data']:.4f}\n")
    runs = [(fb, json.loads((stage / f"eval_acceptance_{fb}.json").read_text()))
            for fb in ("postnorm", "prenorm") if (stage / f"eval_acceptance_{fb}.json").exists()]
    if not runs:
        runs = [("as measured", {"acceptance": ev["acceptance"], "acceptance_setup": ev["acceptance_setup"]})]
    s = runs[0][1]["acceptance_setup"]
    w(f"Greedy MTP acceptance against the base model's own greedy continuation: {s['prompts']} "
      f"held-out prompts of {s['prompt_len']} tokens, {s['greedy_tokens_per_prompt']} greedy tokens "
      "each; speculation simulated cycle by cycle with committed head history (slot S of the head's "
      "sequence holds (base hidden at S, real token S+1), the query slot is (base hidden at q-1, "
      "primary token q)); accept the longest matching prefix, then the bonus token. Acceptance by "
      "position is conditional (accepted / attempted at that position). Depth 1 does not depend on "
      "the feedback choice; depths 2-4 do, so both are shown. The head was trained at depth 1 only.\n")
    for i, (fb, r) in enumerate(runs):
        w(f"{'**Primary**' if i == 0 else 'Alternative'}: feedback hidden at depth > 1 = "
          f"{r['acceptance_setup']['feedback_hidden']}.\n")
        w("| depth | pos 1 | pos 2 | pos 3 | pos 4 | tokens / cycle |\n|---|---|---|---|---|---|")
        for k in ("1", "2", "3", "4"):
            a = r["acceptance"][k]
            cells = [f"{x:.3f}" if x is not None else "-" for x in a["conditional_acceptance_by_position"]]
            cells += [""] * (4 - len(cells))
            w(f"| {k} | " + " | ".join(cells) + f" | {a['tokens_per_cycle']:.3f} |")
        w("")
    if "logits_test" in extra:
        w("\n## mlx vs transformers\n")
        w(extra["logits_test"] + "\n")
    if "mlx_speed" in extra:
        w(extra["mlx_speed"] + "\n")
    for note in extra.get("notes", []):
        w(note + "\n")
    w("\n## Greedy decodes (held-out files; prompt = the first 160 characters from the file's first `def`)\n")
    for smp in ev["samples"]:
        w(f"`{smp['file']}`:\n")
        w("```python\n" + smp["prompt"] + "⟨generated:⟩" + smp["completion"] + "\n```\n")
    w("\n## Reproduce\n")
    w("```sh\n" + extra.get("reproduce", "see tools/train_tiny_model.py --help") + "\n```\n")
    (asset / "MODEL_CARD.md").write_text("\n".join(L) + "\n")
    log(f"wrote {asset / 'MODEL_CARD.md'}")


# --------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", default=str(DEFAULT_STAGE), help="staging folder (ignored by git)")
    ap.add_argument("--asset", default=str(DEFAULT_ASSET), help="output model folder")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--corpus", default=None, help="default: this interpreter's stdlib dir")
    p = sub.add_parser("train")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=0, help="fixed step count (0: use --time-budget)")
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds of training")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-every", type=float, default=90.0)
    p.add_argument("--out", default=None, help="where state.safetensors/train_log.json go (default: stage)")
    p = sub.add_parser("export")
    p.add_argument("--state", default=None)
    p = sub.add_parser("evaluate")
    p.add_argument("--eval-tokens", type=int, default=100_000)
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--sample-tokens", type=int, default=96)
    p.add_argument("--sample-files", nargs="*", default=None)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--feedback", choices=("postnorm", "prenorm"), default="postnorm",
                   help="which head output is fed back at depth > 1")
    p.add_argument("--acceptance-only", action="store_true",
                   help="only the acceptance simulation, written to eval_acceptance_<feedback>.json")
    p.add_argument("--base-only", action="store_true",
                   help="only the held-out accuracy / ppl / teacher-forced head scores, merged into eval.json")
    p = sub.add_parser("mlx-speed")
    p.add_argument("--tokens", type=int, default=128)
    p = sub.add_parser("card")
    p.add_argument("--logits-line", default=None, help="the logits test's printed result")
    args = ap.parse_args(argv)
    if args.cmd == "train" and not args.steps and not args.time_budget:
        ap.error("train needs --steps or --time-budget")
    {"prepare": cmd_prepare, "train": cmd_train, "export": cmd_export,
     "evaluate": cmd_evaluate, "mlx-speed": cmd_mlx_speed, "card": cmd_card}[args.cmd](args)


if __name__ == "__main__":
    main()
