"""Model references and the pull's guards that need no Hub."""

from __future__ import annotations

import pytest

from daemon.models.pull import PullError, _room_for_check
from daemon.models.refs import ModelRefError, parse_ref, resolve_local


@pytest.mark.parametrize("text, repo, revision", [
    ("mlx-community/Qwen3.5-27B-4bit", "mlx-community/Qwen3.5-27B-4bit", None),
    ("Qwen/Qwen3.5-27B@main", "Qwen/Qwen3.5-27B", "main"),
    ("Qwen/Qwen3.5-27B@0123456789abcdef0123456789abcdef01234567", "Qwen/Qwen3.5-27B",
     "0123456789abcdef0123456789abcdef01234567"),
])
def test_repo_ids(text, repo, revision):
    ref = parse_ref(text)
    assert ref.is_repo and (ref.repo_id, ref.revision) == (repo, revision)


@pytest.mark.parametrize("text", ["./models/qwen", "/opt/models/qwen", "~/models/qwen", "qwen", "a/b/c"])
def test_paths(text):
    ref = parse_ref(text)
    assert not ref.is_repo and ref.path is not None


def test_an_existing_folder_wins_over_a_repo_id_of_the_same_spelling(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not parse_ref("org/name").is_repo


def test_bad_references():
    with pytest.raises(ModelRefError):
        parse_ref("")
    with pytest.raises(ModelRefError):
        parse_ref("-org/name")


def test_an_unpulled_repo_names_the_command_that_fixes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelRefError, match="councild model pull nobody/nothing"):
        resolve_local("nobody/nothing")


def test_the_check_refuses_a_base_larger_than_free_memory(tmp_path):
    with open(tmp_path / "model.safetensors", "wb") as fh:
        fh.truncate(1 << 42)  # sparse: 4 TB on paper, nothing on disk
    with pytest.raises(PullError, match="--no-check"):
        _room_for_check(tmp_path)


def test_a_local_model_folder_gets_a_head_from_a_local_source(tmp_path):
    import shutil

    import mlx.core as mx

    from daemon.engine.head_layout import is_mtp_key, read_header
    from daemon.models.pull import pull
    from daemon.paths import BUNDLED_MODEL

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, tmp_path / name)
    weights = mx.load(str(BUNDLED_MODEL / "model.safetensors"))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {k: v for k, v in weights.items() if not is_mtp_key(k)})
    result = pull(str(tmp_path), mtp_from=str(BUNDLED_MODEL), check=False)
    assert result.acceptance is None and "mtp.safetensors" in result.head
    written = mx.load(str(tmp_path / "mtp.safetensors"))
    assert sorted(written) == sorted(k for k in weights if is_mtp_key(k))
    assert all(mx.array_equal(written[k], weights[k]) for k in written)
    assert read_header(tmp_path / "mtp.safetensors")["__metadata__"]["source"] == str(BUNDLED_MODEL.resolve())
    with pytest.raises(PullError, match="already has an MTP head"):
        pull(str(tmp_path), mtp_from=str(BUNDLED_MODEL), check=False)
