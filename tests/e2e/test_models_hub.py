"""`councild model pull` and `serve --model org/name` against a fake Hub: a real HTTP server
on 127.0.0.1 in the Hub's layout, reached by huggingface_hub through HF_ENDPOINT."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.engine.model.head_layout import read_header
from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

from e2e_harness import REPO, start_daemon
from fake_hub import FakeHub
from hub_repos import BASE, FOREIGN, QUANTIZED, SOURCE, TRUNCATED, build_repos


@pytest.fixture(scope="module")
def hub():
    h = FakeHub()
    for repo_id, files in build_repos().items():
        h.add(repo_id, files)
    h.start()
    yield h
    h.stop()


def hub_env(hub: FakeHub, home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DOWNLOAD_TIMEOUT="60", PYTHONUNBUFFERED="1", **extra)
    return env


def councild(env: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(home: Path, repo_id: str) -> Path | None:
    snaps = home / "hub" / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    found = sorted(snaps.iterdir()) if snaps.exists() else []
    return found[0] if found else None


@pytest.mark.quick
def test_pull_lists_and_says_the_head_is_missing(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    r = councild(env, "model", "pull", BASE)
    assert r.returncode == 0, r.stderr
    assert "has no MTP head" in r.stdout and "--mtp-from" in r.stdout
    assert "checked 5 files against the Hub's checksums" in r.stdout  # README.md is not fetched
    folder = snapshot(tmp_path / "hf", BASE)
    assert (folder / "model.safetensors").read_bytes() == hub.repos[BASE].files["model.safetensors"]
    rows = json.loads(councild(env, "model", "list", "--json").stdout)
    assert [(row["repo_id"], row["model_type"], row["head"]) for row in rows] == [(BASE, "qwen3_5", None)]


def test_pull_with_mtp_from_fetches_only_the_head_shard_and_serves_it(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    r = councild(env, "model", "pull", BASE, "--mtp-from", SOURCE, "--check-tokens", "16")
    assert r.returncode == 0, r.stdout + r.stderr
    # Only the index and the shard holding mtp.* were fetched from the source.
    fetched = sorted({p.rsplit("/", 1)[1] for _, p, _ in hub.gets(SOURCE)})
    assert fetched == ["model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    folder = snapshot(tmp_path / "hf", BASE)
    sidecar = folder / "mtp.safetensors"
    meta = read_header(sidecar)["__metadata__"]
    assert meta["source"] == f"{SOURCE}@{hub.repos[SOURCE].commit}"
    assert meta["base"] == f"{BASE}@{hub.repos[BASE].commit}"
    assert not (folder / ".councild-head-staging").exists()

    # The printed acceptance is the bundled model's own (same trunk, same head) ...
    import mlx.core as mx

    from daemon.models.pull import acceptance_check

    expected, acc, drafted = acceptance_check(BUNDLED_MODEL, BUNDLED_MODEL, tokens=16)
    printed = re.search(r"acceptance at depth 1: ([0-9.]+) \((\d+) of (\d+)", r.stdout)
    assert printed, r.stdout
    assert (int(printed.group(2)), int(printed.group(3))) == (acc, drafted)
    assert expected > 0.5
    # ... and the written sidecar holds the bundled head's tensors bit for bit.
    bundled = {k: v for k, v in mx.load(str(BUNDLED_MODEL / "model.safetensors")).items() if k.startswith("mtp.")}
    written = mx.load(str(sidecar))
    assert written.keys() == bundled.keys()
    assert all(mx.array_equal(written[k], v) and written[k].dtype == v.dtype for k, v in bundled.items())

    # Served by its repo id, offline, with the Hub unreachable: the daemon never downloads.
    requests_before = len(hub.requests)
    d = start_daemon(tmp_path, BASE, env=dict(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
                                              HF_ENDPOINT="http://127.0.0.1:9"))
    try:
        with Client(d.endpoint, seat="hub", timeout_s=60) as c:
            assert c.governor("pin_depth", 1).ok
            done = c.complete("def fibonacci(n):\n", max_tokens=48, speculation="fast")
            status = c.status()
        events = d.events()
        assert [e["model"] for e in events if e["event"] == "daemon.loading"] == [str(folder)]
        assert status.model == folder.name
        loaded = [e for e in events if e["event"] == "head.loaded"]
        assert loaded and loaded[0]["source"] == "sidecar (mtp.safetensors)"
        spec = done.speculation
        assert spec.drafted > 0 and spec.accepted / spec.drafted >= 0.5, spec
    finally:
        assert d.stop() == 0
    assert len(hub.requests) == requests_before

    from daemon.models.inspect import inspect_local

    info = inspect_local(folder)
    assert info["head"]["files"] == {"mtp.safetensors": 15}
    assert info["head"]["provenance"]["mtp.safetensors"]["source"] == meta["source"]


def test_the_head_is_quantized_like_a_quantized_base(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    # --no-check: 4-bit matmuls on this CPU backend cost ~0.2 s a step (a Mac's GPU does not
    # care); the acceptance check itself is covered on the bf16 base above.
    r = councild(env, "model", "pull", QUANTIZED, "--mtp-from", SOURCE, "--no-check")
    assert r.returncode == 0, r.stdout + r.stderr
    folder = snapshot(tmp_path / "hf", QUANTIZED)
    header = read_header(folder / "mtp.safetensors")
    declared = json.loads(header["__metadata__"]["councild_quantization"])
    assert declared["layers.0.self_attn.q_proj"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert header["mtp.layers.0.self_attn.q_proj.weight"]["dtype"] == "U32"
    assert header["mtp.layers.0.mlp.down_proj.scales"]["shape"] == [256, 768 // 64]
    assert header["mtp.fc.weight"]["dtype"] == "BF16"  # fc and norms stay float

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from daemon.engine.model.loading import load_model
    from daemon.engine.model.mtp_head import load_mtp_head

    lm = load_model(folder, compile_decode=False)
    head = load_mtp_head(lm)
    q = head.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 64)
    assert type(head.fc) is nn.Linear
    # The sidecar is exactly what the loader makes of the bf16 head on this base: the
    # bundled head, loaded onto the 4-bit base (quantized there, like the base), matches
    # it tensor for tensor.
    onto_base = dict(tree_flatten(load_mtp_head(lm, BUNDLED_MODEL).parameters()))
    got = dict(tree_flatten(head.parameters()))
    assert got.keys() == onto_base.keys()
    assert all(mx.array_equal(got[k], v) for k, v in onto_base.items())


def test_a_head_from_another_trunk_is_refused(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    r = councild(env, "model", "pull", BASE, "--mtp-from", FOREIGN, "--check-tokens", "8")
    assert r.returncode == 1
    assert "trained with another trunk" in r.stderr and "Not written" in r.stderr
    accepted = re.search(r"acceptance at depth 1: ([0-9.]+)", r.stdout)
    assert accepted and float(accepted.group(1)) < 0.1
    folder = snapshot(tmp_path / "hf", BASE)
    assert not (folder / "mtp.safetensors").exists()
    assert not (folder / ".councild-head-staging").exists()


def test_unknown_repo(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    r = councild(env, "model", "pull", "mlx-community/Qwen3.5-Nonexistent-4bit")
    assert r.returncode == 1
    assert "no repo mlx-community/Qwen3.5-Nonexistent-4bit on " + hub.endpoint in r.stderr
    assert "Traceback" not in r.stderr
    r = councild(env, "model", "pull", BASE + "@v9.9")
    assert r.returncode == 1 and f"{BASE} has no revision 'v9.9'" in r.stderr, r.stderr
    # Serving a repo that was never pulled: exit 78, naming the command that fixes it.
    r = councild(env, "serve", "--model", "mlx-community/Qwen3.5-Nonexistent-4bit",
                 "--endpoint", f"ipc://{tmp_path}/s.sock", timeout=120)
    assert r.returncode == 78
    assert "councild model pull mlx-community/Qwen3.5-Nonexistent-4bit" in r.stderr


def _leaves_no_valid_model(home: Path, repo_id: str, env: dict, tmp_path: Path) -> None:
    folder = snapshot(home, repo_id)
    assert folder is None or not (folder / "model.safetensors").exists()
    blobs = home / "hub" / ("models--" + repo_id.replace("/", "--")) / "blobs"
    for blob in blobs.iterdir() if blobs.exists() else []:
        assert blob.stat().st_size < 1_000_000 or blob.name.endswith(".incomplete"), blob
    # The lookup `serve --model org/name` makes (daemon/models/refs.py) finds no model.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from daemon.models.refs import ALLOW_PATTERNS

    with pytest.raises((LocalEntryNotFoundError, FileNotFoundError, OSError)):
        snapshot_download(repo_id, cache_dir=home / "hub", local_files_only=True, allow_patterns=ALLOW_PATTERNS)


def test_corrupted_shard_is_refused_and_removed(hub, tmp_path):
    repo = hub.repos[BASE]
    good = repo.files["model.safetensors"]
    bad = bytearray(good)
    bad[len(bad) // 2: len(bad) // 2 + 64] = bytes(64)  # same size, other bytes
    repo.served["model.safetensors"] = bytes(bad)
    try:
        env = hub_env(hub, tmp_path / "hf")
        r = councild(env, "model", "pull", BASE)
    finally:
        repo.served.clear()
    assert r.returncode == 1
    assert "model.safetensors: sha256 does not match the Hub's" in r.stderr
    assert "removed from the cache" in r.stderr
    _leaves_no_valid_model(tmp_path / "hf", BASE, env, tmp_path)


def test_truncated_shard_is_refused_and_removed(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    r = councild(env, "model", "pull", TRUNCATED)
    assert r.returncode == 1
    assert "truncated download?" in r.stderr and "removed from the cache" in r.stderr
    _leaves_no_valid_model(tmp_path / "hf", TRUNCATED, env, tmp_path)


def test_a_dropped_connection_resumes_where_it_stopped(hub, tmp_path):
    repo = hub.repos[BASE]
    repo.drop_after["model.safetensors"] = 12_000_000
    env = hub_env(hub, tmp_path / "hf")
    try:
        r = councild(env, "model", "pull", BASE)
    finally:
        repo.drop_after.clear()
    assert r.returncode == 0, r.stderr
    starts = [int(rng[len("bytes="):-1]) for _, _, rng in hub.gets(BASE, "model.safetensors") if rng]
    assert starts and 0 < starts[-1] <= 12_000_000  # a Range request picked up the partial file
    assert (snapshot(tmp_path / "hf", BASE) / "model.safetensors").read_bytes() == repo.files["model.safetensors"]


def test_a_killed_pull_leaves_no_model_and_the_next_pull_completes(hub, tmp_path):
    repo = hub.repos[BASE]
    repo.stall_after["model.safetensors"] = 12_000_000
    hub._release.clear()
    home = tmp_path / "hf"
    env = hub_env(hub, home)
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "model", "pull", BASE], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    blobs = home / "hub" / ("models--" + BASE.replace("/", "--")) / "blobs"
    # The weights' own partial blob (named by its etag): the small files download beside it
    # and their partials vanish as each completes (under load one was taken for it).
    weights_partial = f"{repo.etag('model.safetensors')}.*.incomplete"
    partial = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and partial is None:
            for p in blobs.glob(weights_partial) if blobs.exists() else []:
                if p.stat().st_size > 0:
                    partial = p
            time.sleep(0.1)
        assert partial is not None, "the download never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        repo.stall_after.clear()
        hub.release()
    assert 0 < partial.stat().st_size < len(repo.files["model.safetensors"])
    assert not (snapshot(home, BASE) / "model.safetensors").exists()
    _leaves_no_valid_model(home, BASE, env, tmp_path)

    r = councild(env, "model", "pull", BASE)
    assert r.returncode == 0, r.stderr
    assert (snapshot(home, BASE) / "model.safetensors").read_bytes() == repo.files["model.safetensors"]
    # huggingface_hub 2.x restarts a file a killed process left (its temp file is per process);
    # the pull clears the leftover once the file is complete.
    assert not list(blobs.glob("*.incomplete"))
    assert "removed 1 leftover partial download " in r.stdout


def test_inspect_reads_a_repo_on_the_hub_without_downloading_its_weights(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    before = len(hub.requests)
    r = councild(env, "model", "inspect", SOURCE, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["cached"] is False
    assert info["head"]["files"] == {"model-00003-of-00003.safetensors": 15}
    assert (info["base_bytes"], info["head_bytes"]) == (6_446_880 * 2, 984_448 * 2)
    # Only headers were read: every shard GET is a range request.
    shard_gets = [rng for method, p, rng in hub.requests[before:]
                  if method == "GET" and p.startswith(f"/{SOURCE}/resolve/") and p.endswith(".safetensors")]
    assert shard_gets and all(rng and rng.startswith("bytes=0-") for rng in shard_gets), shard_gets
