"""Model references and the pull's guards that need no Hub."""

from __future__ import annotations

import pytest

from daemon.models.pull import PullError, _room_for_check
from daemon.models.refs import ModelRefError, parse_ref, resolve_local

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


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

    from daemon.engine.model.head_layout import is_mtp_key, read_header
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


def _shapes_of(cfg: dict) -> dict:
    from types import SimpleNamespace

    from daemon.engine.model.head_layout import head_tensor_shapes

    return {k: SimpleNamespace(shape=v) for k, v in head_tensor_shapes(cfg).items()}


DENSE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "intermediate_size": 96}


def test_a_head_that_fits_the_base_passes_and_one_that_does_not_is_refused_by_name():
    from daemon.models.pull import check_head_shapes

    check_head_shapes(_shapes_of(DENSE), {"text_config": DENSE}, "src")
    # A head from a model twice as wide: every tensor is the wrong shape.
    with pytest.raises(PullError, match=r"does not fit this base.*mtp\.fc\.weight is \(128, 256\), the base needs \(64, 128\)"):
        check_head_shapes(_shapes_of({**DENSE, "hidden_size": 128}), {"text_config": DENSE}, "src")
    missing = _shapes_of(DENSE)
    del missing["mtp.norm.weight"]
    with pytest.raises(PullError, match="missing mtp.norm.weight"):
        check_head_shapes(missing, DENSE, "src")


def test_head_shapes_fall_back_to_hidden_over_heads_and_leave_moe_experts_alone():
    from daemon.engine.model.head_layout import head_tensor_shapes

    no_hd = {k: v for k, v in DENSE.items() if k != "head_dim"}
    assert head_tensor_shapes(no_hd)["mtp.layers.0.self_attn.q_norm.weight"] == (16,)
    moe = head_tensor_shapes({**DENSE, "num_experts": 8})
    assert not any(".mlp." in k for k in moe) and "mtp.norm.weight" in moe
