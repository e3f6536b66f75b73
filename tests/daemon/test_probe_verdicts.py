"""The start-up probes' verdicts cache (daemon/engine_thread/probe_verdicts.py): a stored verdict is read
back only for the same stack and model; a corrupt or foreign file is a miss."""

from __future__ import annotations

import json

import pytest

from daemon.engine.decoders.exactness import verify_matches_serial
from daemon.engine.model.loading import load_model
from daemon.engine_thread.probe_verdicts import ProbeVerdicts, verdicts_for


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


def _never() -> bool:
    raise AssertionError("a cached verdict must not probe again")


@pytest.mark.quick
def test_a_probed_verdict_is_read_back_by_the_next_start(lm, tmp_path):
    first = ProbeVerdicts(lm, tmp_path)
    assert first.get("verify", "capture", lambda: verify_matches_serial(lm, "capture")) == (True, "probed")
    assert first.get("batch", "4", lambda: False) == (False, "probed")
    again = ProbeVerdicts(lm, tmp_path)  # a new process would build the same key
    assert again.path == first.path
    assert again.get("verify", "capture", _never) == (True, "cached")
    assert again.get("batch", "4", _never) == (False, "cached")
    # Another variant of the same probe is its own verdict.
    assert again.get("verify", "snapshot", lambda: True) == (True, "probed")


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", '{"key": {}, "verdicts": {"verify": {"capture": true}}}',
                                     "KEYED_BUT_NOT_BOOL"])
def test_a_corrupt_or_foreign_file_is_a_miss(lm, tmp_path, content):
    v = ProbeVerdicts(lm, tmp_path)
    v.path.parent.mkdir(parents=True)
    if content == "KEYED_BUT_NOT_BOOL":
        content = json.dumps({"key": v.key, "verdicts": {"verify": {"capture": "yes"}}})
    v.path.write_text(content)
    calls = []
    assert v.get("verify", "capture", lambda: calls.append(1) or False) == (False, "probed")
    assert calls == [1]
    assert ProbeVerdicts(lm, tmp_path).get("verify", "capture", _never) == (False, "cached")  # rewritten whole


def test_the_key_holds_what_the_verdict_depends_on(lm, tmp_path):
    v = ProbeVerdicts(lm, tmp_path)
    assert set(v.key) >= {"versions", "engine_source", "device", "dtypes", "decode_path", "model_hash"}
    assert set(v.key["versions"]) == {"mlx", "mlx_lm", "councild"}
    # Another decode path (compiled or eager) is another file.
    saved = lm.decode_path
    try:
        lm.decode_path = saved + " (another)"
        assert ProbeVerdicts(lm, tmp_path).path != v.path
    finally:
        lm.decode_path = saved


def test_no_folder_or_a_process_group_always_probes(lm, tmp_path, monkeypatch):
    monkeypatch.setenv("COUNCILD_CACHE_DIR", str(tmp_path))
    grouped = verdicts_for(lm, group=object())
    assert grouped.path is None
    assert grouped.get("verify", "capture", lambda: True) == (True, "probed")
    assert grouped.get("verify", "capture", lambda: False) == (False, "probed")
    alone = verdicts_for(lm)
    assert alone.path is not None and alone.path.is_relative_to(tmp_path)


def test_an_unusable_cache_folder_still_answers(lm, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("COUNCILD_CACHE_DIR", str(blocker))
    v = verdicts_for(lm)
    assert v.get("verify", "capture", lambda: True) == (True, "probed")
    assert v.get("verify", "capture", lambda: True) == (True, "probed")  # nothing stored, nothing read


def test_the_split_probe_is_kept_per_chunk_and_per_key(lm, tmp_path):
    """The prefix cache's chunk-split verdict (splits_agree) as _open_prefix_cache asks for
    it: read back for the same chunk, probed for another chunk or another key."""
    from daemon.engine.caches.prefix_cache import splits_agree

    first = ProbeVerdicts(lm, tmp_path)
    probed = first.get("splits", "16", lambda: splits_agree(lm, 16))
    assert probed[1] == "probed"
    assert ProbeVerdicts(lm, tmp_path).get("splits", "16", _never) == (probed[0], "cached")
    calls = []
    assert ProbeVerdicts(lm, tmp_path).get("splits", "8", lambda: calls.append(8) or splits_agree(lm, 8))[1] == "probed"
    assert calls == [8]
    saved = lm.decode_path
    try:
        lm.decode_path = saved + " (another)"
        assert ProbeVerdicts(lm, tmp_path).get("splits", "16", lambda: splits_agree(lm, 16))[1] == "probed"
    finally:
        lm.decode_path = saved


def test_the_compiled_steps_self_check_is_read_back_and_keyed_without_the_decode_path(random_model_path, tmp_path,
                                                                                      monkeypatch):
    """load_model's compile_check (CompiledStepCheck): the first load runs the compiled
    step's self-check and stores its verdict, the next one reads it (the self-check is not
    run) and still decodes on the compiled step; a stored "differs" keeps the next load
    eager. Its key is the decode path's own: the path it decides is not in it."""
    from daemon.engine.model import compiled
    from daemon.engine_thread.probe_verdicts import CompiledStepCheck

    monkeypatch.setenv("COUNCILD_CACHE_DIR", str(tmp_path))
    runs = []
    real = compiled.self_check
    monkeypatch.setattr(compiled, "self_check", lambda lm_, c: runs.append(1) or real(lm_, c))
    first = CompiledStepCheck()
    a = load_model(random_model_path, compile_check=first)
    assert (first.verdict, a.decode_path, len(runs)) == ("probed", "compiled", 1)
    again = CompiledStepCheck()
    b = load_model(random_model_path, compile_check=again)
    assert (again.verdict, b.decode_path, len(runs)) == ("cached", "compiled", 1)
    assert b.compiled_decode is not None
    key = verdicts_for(b, decode_path=False)
    assert key.key["decode_path"] == "(being decided)" and key.path != verdicts_for(b).path
    # A stored "not bit-identical" is read back as such: the next load stays eager.
    assert key.get("compiled_step", "self_check", _never) == (True, "cached")
    data = json.loads(key.path.read_text())
    data["verdicts"]["compiled_step"]["self_check"] = False
    key.path.write_text(json.dumps(data))
    third = CompiledStepCheck()
    c = load_model(random_model_path, compile_check=third)
    assert third.verdict == "cached" and c.decode_path.startswith("eager: compiled differs from eager")
    assert c.compiled_decode is None and len(runs) == 1
