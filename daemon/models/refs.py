"""A model reference: a folder on disk, or a Hub repo id ``org/name[@revision]``.

Repo ids resolve through ``huggingface_hub`` against its cache (``HF_HOME`` /
``HF_HUB_CACHE``), so a model pulled once is found again by the same name, offline too
(``HF_HUB_OFFLINE=1``), and a token comes from the environment (``HF_TOKEN``) or
``hf auth login`` as the Hub client reads it. The daemon itself never downloads:
``resolve_local`` only looks in the cache; ``councild model pull`` fetches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# The Hub's rule for repo names: letters, digits, '-', '_', '.'; no leading/trailing - or .
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"^({_PART})/({_PART})(?:@([A-Za-z0-9._/-]+))?$")
# The files a model folder needs (mlx-lm's own download filter, plus every safetensors file so
# a sidecar published in the repo comes along). Pull downloads these; serve checks that these
# are all in the cached snapshot.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model",
                  "*.txt", "*.jsonl", "*.jinja"]


class ModelRefError(Exception):
    """A reference that names no usable model; the message says what to do."""


@dataclass(frozen=True)
class ModelRef:
    text: str
    path: Path | None = None  # a local folder
    repo_id: str | None = None  # org/name
    revision: str | None = None  # branch, tag or commit; None = main

    @property
    def is_repo(self) -> bool:
        return self.repo_id is not None

    def __str__(self) -> str:
        return self.text


def parse_ref(text: str) -> ModelRef:
    """A folder when it exists or looks like a path (absolute, ./, ~), else ``org/name[@rev]``."""
    text = str(text).strip()
    if not text:
        raise ModelRefError("empty model reference")
    path = Path(text).expanduser()
    looks_like_path = text.startswith(("/", ".", "~")) or text.split("@", 1)[0].count("/") != 1 or path.exists()
    if looks_like_path:
        return ModelRef(text, path=path)
    m = _REPO_ID.match(text)
    if not m:
        raise ModelRefError(f"{text!r} is neither an existing folder nor a Hub repo id (org/name[@revision])")
    return ModelRef(text, repo_id=f"{m.group(1)}/{m.group(2)}", revision=m.group(3))


def resolve_local(text: str | Path) -> Path:
    """The folder a reference names, without any network: a folder as given, or a repo id's
    snapshot in the Hugging Face cache (complete, as `model pull` left it). Raises
    ModelRefError with the command that fixes it."""
    ref = parse_ref(str(text))
    if not ref.is_repo:
        return ref.path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(ref.repo_id, revision=ref.revision, local_files_only=True,
                                   allow_patterns=ALLOW_PATTERNS)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        raise ModelRefError(
            f"{ref.text} is not in the Hugging Face cache ({hub_cache_dir()}); the daemon does not "
            f"download models: run `councild model pull {ref.text}` first ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    return Path(folder)


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
