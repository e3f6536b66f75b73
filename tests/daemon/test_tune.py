"""`councild tune`: a tiny real run on the random model, the profile's shape, and refusal of a
profile made with other versions, on another device, or for another model."""

from __future__ import annotations

import json

import pytest

from daemon.engine_thread import profile
from daemon.measure import tune


@pytest.fixture(scope="module")
def tuned(random_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    rc = tune.main(["--model", str(random_model_path), "--out", str(out), "--tokens", "4", "--prompts", "2",
                    "--depths", "1,2"])
    assert rc == 0
    return random_model_path, out


def test_profile_shape(tuned):
    model, out = tuned
    p = json.loads(out.read_text())
    assert set(p["cost_s"]) == {"0", "1", "2"} and all(v > 0 for v in p["cost_s"].values())
    assert len(p["acceptance"]) == 2 and all(0.0 <= a <= 1.0 for a in p["acceptance"])
    assert set(p["versions"]) == {"mlx", "mlx_lm", "councild"}
    assert p["model"]["hash"] == profile.model_hash(model) and p["device"]
    assert profile.governor_profile(p) == {"cost_s": p["cost_s"], "acceptance": p["acceptance"]}


def test_loads_on_the_same_stack(tuned):
    model, out = tuned
    p = profile.load_profile(model, out)
    assert p is not None and p["cost_s"]["0"] > 0


def test_refuses_other_versions(tuned):
    model, out = tuned
    versions = dict(profile.current_versions(), mlx="0.0.1")
    assert profile.load_profile(model, out, versions=versions) is None
    assert "mlx" in profile.check_profile(json.loads(out.read_text()), model, versions=versions)
    older = dict(profile.current_versions(), councild="0.0.0")
    assert profile.load_profile(model, out, versions=older) is None


def test_refuses_another_device_and_another_model(tuned, tmp_path):
    model, out = tuned
    assert profile.load_profile(model, out, device="gpu NVIDIA H200") is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen3_5", "other": true}')
    assert "model hash" in profile.check_profile(json.loads(out.read_text()), other)
    assert profile.load_profile(other, out) is None


def test_missing_or_broken_profile_is_none(tuned, tmp_path):
    model, _ = tuned
    assert profile.load_profile(model, tmp_path / "absent.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert profile.load_profile(model, bad) is None


def test_default_path_is_under_the_cache_dir(tuned, tmp_path, monkeypatch):
    model, _ = tuned
    monkeypatch.setenv("COUNCILD_CACHE_DIR", str(tmp_path))
    assert profile.default_profile_path(model) == tmp_path / f"profile-{profile.model_hash(model)}.json"


def test_show(tuned, capsys):
    model, out = tuned
    assert tune.main(["--model", str(model), "--out", str(out), "--show"]) == 0
    text = capsys.readouterr()
    assert "conditional acceptance" in text.out and "loads for this model" in text.err


@pytest.mark.quick
def test_conditional_acceptance_stops_at_first_reject():
    acc, den = tune.conditional_acceptance([[True, False, False], [False, False, False], [True, True, True]], 3)
    assert den == [3, 2, 1] and acc == [2 / 3, 0.5, 1.0]


@pytest.mark.quick
def test_generation_config_sampling_is_read_as_transformers_reads_it(tmp_path):
    assert tune.generation_sampling(tmp_path) is None  # no file
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert tune.generation_sampling(tmp_path) is None  # do_sample false: greedy
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20}')
    assert tune.generation_sampling(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.mark.quick
def test_sampling_entry_and_best_depth_per_request():
    greedy = {"params": None, "cost_s": {"0": 0.010, "1": 0.012, "2": 0.016}, "acceptance": [0.9, 0.8]}
    sampled = {"params": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
               "cost_s": {"0": 0.010, "1": 0.012, "2": 0.016}, "acceptance": [0.3, 0.2]}
    tuned = {"sampling": {"greedy": greedy, "generation_config": sampled}}
    assert profile.sampling_entry(tuned, 0.0) is greedy
    assert profile.sampling_entry(tuned, 0.6, 0.95, 20) is sampled
    assert profile.sampling_entry(tuned, 0.7, 0.95, 20) is None  # not measured there
    assert profile.sampling_entry(None, 0.0) is None
    # greedy: E(2) = 1 + .9 + .72 = 2.62 over 0.016 beats E(1) = 1.9 over 0.012 and 1 / 0.010
    assert profile.best_depth(greedy) == 2
    # sampled: E(1) = 1.3 / 0.012 = 108 > 100 (serial) > E(2) = 1.36 / 0.016 = 85
    assert profile.best_depth(sampled) == 1


def test_tune_measures_the_generation_config_settings_too(random_model_path, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in random_model_path.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    (model / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.8, "top_k": 8}')
    out = tmp_path / "profile.json"
    assert tune.main(["--model", str(model), "--out", str(out), "--tokens", "4", "--prompts", "1", "--depths", "1"]) == 0
    p = json.loads(out.read_text())
    assert set(p["sampling"]) == {"greedy", "generation_config"}
    assert p["sampling"]["generation_config"]["params"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 8}
    assert set(p["sampling"]["generation_config"]["cost_s"]) == {"0", "1"}
    assert p["sampling"]["greedy"]["cost_s"] == p["cost_s"]  # the governor's prior stays greedy's
