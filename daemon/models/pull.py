"""`councild model pull REPO [--mtp-from SOURCE]`: download a model into the Hugging Face
cache, check what arrived, and give it an MTP head when it lacks one.

The download is huggingface_hub's own (``snapshot_download``: its cache layout, resume of a
cut-short file from its ``.incomplete`` blob, its tqdm progress bars, HF_TOKEN, HF_ENDPOINT).
On top of it, every file is checked against the Hub's listing (LFS sha256, git blob sha1)
and every safetensors header against its file's size; a file that fails is removed from the
cache (blob and snapshot link), so what is left never looks like a complete model.

The head: mlx-community conversions drop ``mtp.*``. ``--mtp-from`` reads the source repo's
``model.safetensors.index.json``, fetches only the shard(s) holding the head, checks the
head's shapes against the base's config, quantizes its projections as the base is
quantized (fc and norms stay in the source's float dtype, as the loader expects), runs a
short depth-1 acceptance check against the base, and only then puts ``mtp.safetensors``
beside the model, with its provenance in the file's metadata. A head whose acceptance is
near zero was trained on another trunk: it is refused and nothing is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from daemon.engine.model.head_layout import (INDEX, SIDECAR, SafetensorsError, canonical_mtp_key, head_files,
                                       head_tensor_shapes, is_mtp_key, read_header)
from daemon.head_acceptance import CHECK_PROMPTS, CHECK_TOKENS, MIN_ACCEPTANCE, acceptance_check

from .refs import ALLOW_PATTERNS, ModelRef, parse_ref


class PullError(Exception):
    """A pull that cannot finish; the message says why and what to do."""


@dataclass
class PullResult:
    repo_id: str
    folder: Path
    commit: str
    files: list[str] = field(default_factory=list)
    head: str = "absent"
    acceptance: float | None = None


def _say(msg: str) -> None:
    print(msg, flush=True)


# -- download -----------------------------------------------------------------------------

def _hub_errors():
    from huggingface_hub import errors

    return errors


def _explain(exc: BaseException, ref: ModelRef) -> str:
    errors = _hub_errors()
    from huggingface_hub import constants

    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{ref.repo_id} has no revision {ref.revision!r} on {constants.ENDPOINT}"
    if isinstance(exc, errors.GatedRepoError):
        return (f"{ref.repo_id} is gated on {constants.ENDPOINT}: accept its terms on the Hub, then set HF_TOKEN "
                "(or run `hf auth login`)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"no repo {ref.repo_id} on {constants.ENDPOINT} (check the spelling; a private repo needs "
                "HF_TOKEN)")
    if isinstance(exc, errors.LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE:
        return f"{ref.text} is not in the cache and HF_HUB_OFFLINE is set: unset it to download"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"downloading {ref.text} failed: {first}. Files that arrived whole stay in the cache; "
            "run the same command again to fetch the rest")


def download(ref: ModelRef, allow_patterns: list[str] | None = ALLOW_PATTERNS) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=allow_patterns))
    except (ValueError, OSError, _hub_errors().HfHubHTTPError) as exc:
        raise PullError(_explain(exc, ref)) from None
    except Exception as exc:  # httpx errors and the like: the message, not a traceback
        raise PullError(_explain(exc, ref)) from None


def download_file(ref: ModelRef, filename: str, missing_ok: bool = False) -> Path | None:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(ref.repo_id, filename, revision=ref.revision))
    except _hub_errors().EntryNotFoundError:
        if missing_ok:
            return None
        raise PullError(f"{ref.text} has no file {filename}") from None
    except Exception as exc:
        raise PullError(_explain(exc, ref).replace(f"downloading {ref.text}", f"downloading {ref.text}/{filename}")) from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1()
    h.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _discard(folder: Path, name: str) -> None:
    """Remove a damaged file from the cache: its snapshot link and the blob behind it."""
    link = folder / name
    blob = link.resolve() if link.is_symlink() else None
    link.unlink(missing_ok=True)
    if blob is not None:
        blob.unlink(missing_ok=True)


def verify(ref: ModelRef, folder: Path, out: Callable[[str], None] = _say) -> list[str]:
    """Check every downloaded file against the Hub's listing for this commit, and every
    safetensors file's header against its size. Damaged files are removed from the cache;
    raises PullError naming them."""
    from huggingface_hub import HfApi, constants

    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != SIDECAR)
    problems: list[str] = []
    if constants.HF_HUB_OFFLINE:
        out("offline (HF_HUB_OFFLINE): the cached files were not re-checked against the Hub")
        listing = {}
    else:
        try:
            listing = {f.path: f for f in HfApi().list_repo_tree(ref.repo_id, revision=folder.name, recursive=True)
                       if hasattr(f, "blob_id")}
        except Exception as exc:
            raise PullError(f"could not list {ref.repo_id} to check the download: {exc}") from None
    t0 = time.perf_counter()
    for name in files:
        path = folder / name
        entry = listing.get(name)
        if entry is not None:
            size = entry.lfs.size if entry.lfs is not None else entry.size
            if path.stat().st_size != size:
                problems.append(f"{name}: {path.stat().st_size} bytes, the Hub lists {size}")
            elif entry.lfs is not None and _sha256(path) != entry.lfs.sha256:
                problems.append(f"{name}: sha256 does not match the Hub's ({entry.lfs.sha256[:12]}...)")
            elif entry.lfs is None and _git_blob_sha1(path) != entry.blob_id:
                problems.append(f"{name}: content does not match the Hub's git blob {entry.blob_id[:12]}...")
        if name.endswith(".safetensors") and not any(p.startswith(name + ":") for p in problems):
            try:
                read_header(path)
            except SafetensorsError as exc:
                problems.append(str(exc))
        if name.endswith(".json") and not any(p.startswith(name + ":") for p in problems):
            try:
                json.loads(path.read_text())
            except ValueError as exc:
                problems.append(f"{name}: not valid JSON ({exc})")
    if problems:
        for p in problems:
            _discard(folder, p.split(":", 1)[0])
        raise PullError(
            f"{ref.text}: {len(problems)} damaged file(s), removed from the cache so nothing half-written is "
            f"left looking like a model: " + "; ".join(problems)
            + ". Run the pull again; if it repeats, the files on the Hub themselves are damaged")
    if listing:
        out(f"checked {len(files)} files against the Hub's checksums ({time.perf_counter() - t0:.1f} s)")
    return files


def clear_leftovers(folder: Path, out: Callable[[str], None] = _say) -> int:
    """Remove partial downloads a killed pull left in this repo's blob store. huggingface_hub
    2.x writes each download to a per-process ``<etag>.<id>.incomplete`` file and never
    reuses another process's, so once ``<etag>`` itself is complete such a file is garbage;
    one is only removed while holding the blob's download lock (nobody is writing it)."""
    from filelock import FileLock, Timeout

    storage = folder.parent.parent  # .../models--org--name
    locks = storage.parent / ".locks" / storage.name
    removed = freed = 0
    for part in sorted((storage / "blobs").glob("*.incomplete")):
        etag = part.name.split(".", 1)[0]
        if not (storage / "blobs" / etag).exists():
            continue
        try:
            with FileLock(str(locks / f"{etag}.lock"), timeout=0):
                freed += part.stat().st_size
                part.unlink()
                removed += 1
        except (Timeout, OSError):
            continue
    if removed:
        out(f"removed {removed} leftover partial download{'s' if removed > 1 else ''} "
            f"({freed / 1e6:.1f} MB) an interrupted pull had left")
    return removed


# -- the head -----------------------------------------------------------------------------

def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def _source_folder_files(src: ModelRef) -> tuple[dict[str, Path], str]:
    """Fetch only the source's files that hold the head. Returns ({name: local path}, a
    provenance string (repo@commit or the folder))."""
    if not src.is_repo:
        folder = src.path
        files = head_files(folder)
        if not files:
            raise PullError(f"{folder} holds no MTP head tensors (no mtp.* in its safetensors)")
        return {f.name: f for f in files}, str(folder.resolve())
    index_path = download_file(src, INDEX, missing_ok=True)
    if index_path is not None:
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        names = sorted({f for k, f in weight_map.items() if is_mtp_key(k)})
        if not names:
            raise PullError(f"{src.text}: its {INDEX} lists no mtp.* tensors, so it has no MTP head to take")
    else:
        names = ["model.safetensors"]  # an unsharded checkpoint: the one file holds everything
    commit = index_path.parent.name if index_path is not None else ""
    _say(f"{src.text}: the head is in {', '.join(names)}; fetching only {'that' if len(names) == 1 else 'those'}")
    paths = {n: download_file(src, n) for n in names}
    commit = commit or next(iter(paths.values())).parent.name
    for n, p in paths.items():
        try:
            read_header(p)
        except SafetensorsError as exc:
            _discard(p.parent, n)
            raise PullError(f"{src.text}: {exc}; removed it from the cache, run the pull again") from None
    return paths, f"{src.repo_id}@{commit}"


def check_head_shapes(tensors: dict, base_cfg: dict, source: str) -> None:
    expected = head_tensor_shapes(_text_config(base_cfg))
    missing = [k for k in expected if k not in tensors]
    wrong = [f"{k} is {tuple(tensors[k].shape)}, the base needs {v}" for k, v in expected.items()
             if k in tensors and tuple(tensors[k].shape) != v]
    if missing or wrong:
        raise PullError(
            f"the head from {source} does not fit this base (a different model size or family?): "
            + "; ".join(([f"missing {', '.join(missing)}"] if missing else []) + wrong))


def _quant_params(base_cfg: dict, module: str) -> dict | None:
    """mlx-lm's ``quantization`` table for the base's counterpart of a head module (the
    first full-attention layer's), falling back to the table's defaults; None = unquantized."""
    q = base_cfg.get("quantization") or base_cfg.get("quantization_config")
    if not q or "bits" not in q:
        return None
    text = _text_config(base_cfg)
    types = text.get("layer_types") or []
    first_attn = types.index("full_attention") if "full_attention" in types else \
        (text.get("full_attention_interval", 4) - 1)
    sub = module.split(".", 2)[2]  # layers.0.self_attn.q_proj -> self_attn.q_proj
    for prefix in ("language_model.model.layers", "model.layers", "model.language_model.layers"):
        override = q.get(f"{prefix}.{first_attn}.{sub}")
        if override is False:
            return None
        if isinstance(override, dict):
            return {"group_size": override["group_size"], "bits": override["bits"],
                    "mode": override.get("mode", q.get("mode", "affine"))}
    return {"group_size": q["group_size"], "bits": q["bits"], "mode": q.get("mode", "affine")}


def quantize_like_base(tensors: dict, base_cfg: dict) -> tuple[dict, dict]:
    """Quantize the head's dense projections as the base's are (mx.quantize, the base's
    group size / bits / mode). fc, norms and MoE experts stay float (the loader quantizes
    experts after stacking them). Returns (tensors, {module: params})."""
    import mlx.core as mx

    out = dict(tensors)
    declared: dict[str, dict] = {}
    for name in list(out):
        if not name.endswith("_proj.weight") or ".experts." in name or out[name].ndim != 2:
            continue
        module = name[len("mtp."):-len(".weight")]
        params = _quant_params(base_cfg, module)
        if params is None:
            continue
        q = mx.quantize(out[name], group_size=params["group_size"], bits=params["bits"], mode=params["mode"])
        out[name] = q[0]
        out[name[:-len("weight")] + "scales"] = q[1]
        if len(q) > 2 and q[2] is not None:
            out[name[:-len("weight")] + "biases"] = q[2]
        declared[module] = params
    return out, declared


def _room_for_check(folder: Path) -> None:
    """The check loads the whole base in this process. With the daemon already serving the
    same model that can be twice its size in memory: refuse up front rather than push a Mac
    into swap (or a Linux box into the OOM killer)."""
    import psutil

    need = int(sum(p.stat().st_size for p in folder.glob("*.safetensors")) * 1.1)
    available = psutil.virtual_memory().available
    if need > available:
        raise PullError(
            f"the acceptance check loads the base ({need / 1e9:.1f} GB with headroom) and only "
            f"{available / 1e9:.1f} GB is available: stop the daemon (`councild service` or Ctrl-C) and pull "
            "again, or pass --no-check to write the head unchecked")


def add_head(folder: Path, base: ModelRef, source_text: str, *, check: bool = True,
             min_acceptance: float = MIN_ACCEPTANCE, check_tokens: int = CHECK_TOKENS) -> tuple[str, float | None]:
    """Extract the head from ``source_text`` into ``folder/mtp.safetensors``. Returns
    (where the head now is, measured acceptance or None without the check)."""
    import mlx.core as mx

    from daemon.engine.model.mtp_head import read_tensors

    src = parse_ref(source_text)
    base_cfg = json.loads((folder / "config.json").read_text())
    paths, provenance = _source_folder_files(src)
    tensors: dict = {}
    for name, path in paths.items():
        got, _ = read_tensors(path, is_mtp_key)
        tensors.update({canonical_mtp_key(k): v for k, v in got.items()})
    if not tensors:
        raise PullError(f"{src.text}: no mtp.* tensors in {', '.join(paths)}")
    check_head_shapes(tensors, base_cfg, src.text)
    tensors, declared = quantize_like_base(tensors, base_cfg)
    metadata = {
        "format": "pt",  # HF conventions: zero-centred norms (the loader adds the 1)
        "councild_head": "1",
        "source": provenance,
        "source_files": ",".join(sorted(paths)),
        "base": f"{base.repo_id}@{folder.name}" if base.is_repo else str(folder),
        "extracted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if declared:
        metadata["councild_quantization"] = json.dumps(declared, sort_keys=True)
    staging = folder / ".councild-head-staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        mx.eval(list(tensors.values()))
        mx.save_safetensors(str(staging / SIDECAR), tensors, metadata=metadata)
        acceptance = None
        if check:
            _room_for_check(folder)
            _say(f"acceptance check: depth 1, {CHECK_PROMPTS} prompts x {check_tokens} tokens, greedy ...")
            acceptance, acc, drafted = acceptance_check(folder, staging, tokens=check_tokens)
            _say(f"acceptance at depth 1: {acceptance:.3f} ({acc} of {drafted} drafts accepted)")
            if acceptance < min_acceptance:
                raise PullError(
                    f"the head from {src.text} is accepted {acceptance:.3f} of the time at depth 1 on "
                    f"{base.text} (threshold {min_acceptance}): it was trained with another trunk (a different "
                    "fine-tune or release), so it would only slow decoding down. Not written. Take the head "
                    "from the checkpoint this model was converted from")
        os.replace(staging / SIDECAR, folder / SIDECAR)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return f"sidecar {folder / SIDECAR} (from {provenance})", acceptance


# -- the command --------------------------------------------------------------------------

def pull(text: str, *, mtp_from: str | None = None, check: bool = True,
         min_acceptance: float = MIN_ACCEPTANCE, check_tokens: int = CHECK_TOKENS) -> PullResult:
    ref = parse_ref(text)
    if not ref.is_repo:  # a model already on disk (e.g. your own mlx_lm.convert): only a head to add
        if not mtp_from or not (ref.path / "config.json").exists():
            raise PullError(f"{text!r} is a folder, not a Hub repo id (org/name[@revision]); a model folder "
                            "needs no pull, but can be given a head with --mtp-from SOURCE")
        folder = ref.path.resolve()
        if head_files(folder):
            raise PullError(f"{folder} already has an MTP head ({', '.join(p.name for p in head_files(folder))})")
        result = PullResult(str(folder), folder, "")
        result.head, result.acceptance = add_head(folder, ref, mtp_from, check=check, min_acceptance=min_acceptance,
                                                  check_tokens=check_tokens)
        _say(f"ready: {folder}\n  serve it with: councild serve --model {folder}")
        return result
    _say(f"pulling {ref.text} into {_cache_dir()}")
    folder = download(ref)
    files = verify(ref, folder)
    clear_leftovers(folder)
    result = PullResult(ref.repo_id, folder, folder.name, files)
    present = head_files(folder)
    if present:
        result.head = f"in {', '.join(p.name for p in present)}"
        if mtp_from:
            _say(f"{ref.text} already has an MTP head ({result.head}); --mtp-from {mtp_from} not needed")
    elif mtp_from:
        result.head, result.acceptance = add_head(folder, ref, mtp_from, check=check, min_acceptance=min_acceptance,
                                                  check_tokens=check_tokens)
    else:
        cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
        if _text_config(cfg).get("mtp_num_hidden_layers") or cfg.get("model_type", "").startswith(("qwen3_5", "qwen3_next")):
            _say(f"{ref.text} has no MTP head (conversions drop mtp.*): the daemon would serve it serially. "
                 f"Add one with --mtp-from <the original repo>, e.g. --mtp-from Qwen/<name>")
    _say(f"ready: {folder}\n  serve it with: councild serve --model {ref.text}")
    return result


def _cache_dir() -> str:
    from .refs import hub_cache_dir

    return hub_cache_dir()

