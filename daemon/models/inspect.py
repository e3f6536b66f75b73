"""`councild model inspect PATH|REPO` and `councild model list`: what a checkpoint is and
whether it fits this machine, read from its config and safetensors headers (no weights are
loaded, no mlx imported).

Memory figures:
- base: the bytes of every non-head tensor as stored (a quantized checkpoint's packed
  weights, scales and biases included): what the loaded model keeps resident;
- head: the head's tensors as stored; a float head beside a quantized base is quantized on
  load, so it is also given at the base's bits;
- KV per token: full-attention layers x 2 (K and V) x KV heads x head_dim x 2 bytes (bf16);
- recurrent state per sequence (GatedDeltaNet layers, fixed size, whatever the length):
  float32 state [Hv, Dv, Dk] plus the conv window (kernel - 1) x conv channels in bf16.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from daemon.engine.model.head_layout import SIDECARS, head_files, is_mtp_key, read_header
from .refs import ModelRefError, hub_cache_dir, parse_ref, resolve_local

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
KV_CONTEXT = 32768  # the context length the fit line is computed for


def _nbytes(info: dict) -> int:
    start, end = info["data_offsets"]
    return end - start


def _text(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def describe(folder: Path, cfg: dict, headers: dict[str, dict]) -> dict:
    """The facts about a checkpoint from its config and its files' headers
    ({file name: safetensors header})."""
    text = _text(cfg)
    base_bytes = head_bytes = 0
    dtypes: Counter = Counter()
    n_tensors = 0
    head_where: dict[str, int] = {}
    head_names: list[str] = []
    for fname, header in headers.items():
        sidecar = fname in SIDECARS
        for name, info in header.items():
            if name == "__metadata__":
                continue
            n_tensors += 1
            nb = _nbytes(info)
            if sidecar or is_mtp_key(name):
                head_bytes += nb
                head_where[fname] = head_where.get(fname, 0) + 1
                head_names.append(name)
            else:
                base_bytes += nb
                dtypes[info["dtype"]] += nb
    q = cfg.get("quantization") or cfg.get("quantization_config")
    quant = None
    if q and "bits" in q:
        quant = f"{q['bits']}-bit, group size {q.get('group_size')}, mode {q.get('mode', 'affine')}"
    elif q:
        quant = q.get("quant_method", "yes")
    elif any(d.startswith("F8") for d in dtypes):
        quant = "fp8"
    layer_types = text.get("layer_types") or []
    n_layers = text.get("num_hidden_layers", len(layer_types))
    if not layer_types and text.get("full_attention_interval"):
        k = text["full_attention_interval"]
        layer_types = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n_layers)]
    n_full = sum(t == "full_attention" for t in layer_types) or (n_layers if not layer_types else 0)
    n_linear = sum(t == "linear_attention" for t in layer_types)
    hd = text.get("head_dim") or (text.get("hidden_size", 0) // max(text.get("num_attention_heads", 1), 1))
    kv_per_token = n_full * 2 * text.get("num_key_value_heads", 0) * hd * 2
    hv, dv, dk = text.get("linear_num_value_heads", 0), text.get("linear_value_head_dim", 0), text.get("linear_key_head_dim", 0)
    conv_dim = 2 * text.get("linear_num_key_heads", 0) * dk + hv * dv
    recurrent = n_linear * (hv * dv * dk * 4 + (text.get("linear_conv_kernel_dim", 4) - 1) * conv_dim * 2)
    head_file_meta = {}
    for f in head_where:
        meta = headers[f].get("__metadata__") or {}
        head_file_meta[f] = {k: v for k, v in meta.items() if k in ("source", "base", "councild_head", "extracted_at")}
    head_resident = head_bytes
    if head_bytes and q and "bits" in q and not any(n.endswith(".scales") for n in head_names):
        # float head, quantized base: the loader quantizes the projections (fc, norms stay)
        h = text.get("hidden_size", 0)
        fc_norms = (2 * h * h + 5 * h) * 2
        head_resident = fc_norms + (head_bytes - fc_norms) * q["bits"] // 16
    return {
        "path": str(folder),
        "model_type": cfg.get("model_type"),
        "architectures": cfg.get("architectures"),
        "layers": n_layers,
        "full_attention_layers": n_full,
        "linear_attention_layers": n_linear,
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "experts": text.get("num_experts") or None,
        "tensors": n_tensors,
        "dtypes": dict(dtypes),
        "quantization": quant,
        "files": sorted(headers),
        "head": ({"files": head_where, "tensors": len(head_names),
                  "layout": sorted({n.rsplit("mtp.", 1)[0] + "mtp.*" if "mtp." in n else "(bare names)" for n in head_names}),
                  "provenance": head_file_meta} if head_names else None),
        "base_bytes": base_bytes,
        "head_bytes": head_bytes,
        "head_resident_bytes": head_resident,
        "kv_bytes_per_token": kv_per_token,
        "recurrent_bytes_per_sequence": recurrent,
    }


def machine_memory() -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {"total_bytes": vm.total, "available_bytes": vm.available}


def inspect_local(folder: Path) -> dict:
    if not (folder / "config.json").exists():
        raise ModelRefError(f"no model at {folder}: config.json is missing")
    cfg = json.loads((folder / "config.json").read_text())
    files = sorted(p for p in folder.glob("*.safetensors"))
    headers = {p.name: read_header(p) for p in files}
    out = describe(folder, cfg, headers)
    where = head_files(folder)
    out["head_source"] = ", ".join(p.name for p in where) if where else None
    return out


def inspect_remote(repo_id: str, revision: str | None) -> dict:
    """Config and headers read from the Hub (HTTP range reads of the headers only)."""
    from huggingface_hub import HfApi, hf_hub_download

    cfg = json.loads(Path(hf_hub_download(repo_id, "config.json", revision=revision)).read_text())
    meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)
    headers = {}
    for fname, fm in meta.files_metadata.items():
        header = {}
        for name, t in fm.tensors.items():
            header[name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": list(t.data_offsets)}
        header["__metadata__"] = fm.metadata or {}
        headers[fname] = header
    out = describe(Path(f"hub:{repo_id}"), cfg, headers)
    out["head_source"] = ", ".join(out["head"]["files"]) if out["head"] else None
    return out


def inspect(text: str) -> dict:
    ref = parse_ref(text)
    if not ref.is_repo:
        return inspect_local(ref.path)
    try:
        folder = resolve_local(text)
        out = inspect_local(folder)
        out["cached"] = True
    except ModelRefError:
        out = inspect_remote(ref.repo_id, ref.revision)
        out["cached"] = False
    out["ref"] = text
    return out


def _gb(n: float | None) -> str:
    if n is None:
        return "?"
    if n < 1e9:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e9:.2f} GB"


def format_inspect(info: dict, machine: dict) -> str:
    head = info["head"]
    if head:
        where = ", ".join(f"{f} ({n} tensors)" for f, n in head["files"].items())
        prov = "; ".join(f"{k}={v}" for m in head["provenance"].values() for k, v in m.items())
        head_line = f"present: {where}; names {', '.join(head['layout'])}" + (f"; {prov}" if prov else "")
    else:
        head_line = ("absent (serial decode only; add one with `councild model pull REPO --mtp-from SOURCE`)"
                     if info["model_type"] in ("qwen3_5", "qwen3_5_moe", "qwen3_next") else
                     "absent (this model family has no native MTP head)")
    total_mem = machine["total_bytes"]
    need = info["base_bytes"] + info["head_resident_bytes"] + info["kv_bytes_per_token"] * KV_CONTEXT \
        + info["recurrent_bytes_per_sequence"]
    rows = [
        ("model", f"{info.get('ref') or info['path']}" + ("" if info.get("cached", True) else " (on the Hub, not cached)")),
        ("path", info["path"]),
        ("architecture", f"{info['model_type']} ({', '.join(info['architectures'] or [])}), {info['layers']} layers: "
                         f"{info['linear_attention_layers']} GatedDeltaNet + {info['full_attention_layers']} full attention, "
                         f"hidden {info['hidden_size']}, vocab {info['vocab_size']}"
                         + (f", {info['experts']} experts" if info["experts"] else "")),
        ("files", f"{len(info['files'])} safetensors, {info['tensors']} tensors"),
        ("weights", ", ".join(f"{d} {_gb(n)}" for d, n in sorted(info["dtypes"].items()))),
        ("quantization", info["quantization"] or "none"),
        ("MTP head", head_line),
        ("memory: base", _gb(info["base_bytes"])),
        ("memory: head", _gb(info["head_bytes"]) + (f" on disk, {_gb(info['head_resident_bytes'])} once quantized like the base"
                                                    if info["head_resident_bytes"] != info["head_bytes"] else "")),
        ("memory: KV", f"{info['kv_bytes_per_token'] / 1024:.1f} KiB per token (bf16), {_gb(info['kv_bytes_per_token'] * KV_CONTEXT)} "
                       f"at {KV_CONTEXT} tokens"),
        ("memory: state", f"{_gb(info['recurrent_bytes_per_sequence'])} recurrent state per sequence"),
        ("this machine", f"{_gb(total_mem)} total, {_gb(machine['available_bytes'])} available; base + head + "
                         f"{KV_CONTEXT}-token KV + state = {_gb(need)} ({need / total_mem:.2%} of total)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def list_cached() -> list[dict]:
    """Models in the Hugging Face cache: repo, revisions, size, and whether each snapshot has
    a config and an MTP head."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir()
    except Exception as exc:  # no cache yet, or unreadable
        if not Path(hub_cache_dir()).exists():
            return []
        raise ModelRefError(f"cannot read the Hugging Face cache {hub_cache_dir()}: {exc}") from None
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
            folder = Path(rev.snapshot_path)
            cfg = {}
            if (folder / "config.json").exists():
                try:
                    cfg = json.loads((folder / "config.json").read_text())
                except ValueError:
                    pass
            try:
                head = ", ".join(p.name for p in head_files(folder)) or None
            except Exception as exc:  # a damaged shard: say so rather than fail the listing
                head = f"? ({exc})"
            sidecar_bytes = sum((folder / s).stat().st_size for s in SIDECARS
                                if (folder / s).exists() and not (folder / s).is_symlink())
            out.append({
                "repo_id": repo.repo_id,
                "revision": rev.commit_hash,
                "refs": sorted(rev.refs),
                "bytes": rev.size_on_disk + sidecar_bytes,
                "model_type": cfg.get("model_type"),
                "complete": (folder / "config.json").exists() and (any(folder.glob("*.safetensors"))),
                "head": head,
                "path": str(folder),
            })
    return out


def format_list(rows: list[dict]) -> str:
    if not rows:
        return f"no models in the Hugging Face cache ({hub_cache_dir()}); `councild model pull ORG/NAME` adds one"
    lines = [f"{'repo':<44} {'rev':<9} {'refs':<8} {'size':>9}  {'type':<12} head"]
    for r in rows:
        lines.append(f"{r['repo_id']:<44} {r['revision'][:8]:<9} {','.join(r['refs']) or '-':<8} {_gb(r['bytes']):>9}  "
                     f"{r['model_type'] or '?':<12} {r['head'] or 'none'}")
    lines.append(f"cache: {hub_cache_dir()}")
    return "\n".join(lines)


__all__ = ["inspect", "format_inspect", "machine_memory", "list_cached", "format_list"]
