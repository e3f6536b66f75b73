"""engine/jit/prebuild.py and prebuild_recipes.py: the CUDA modules compiled side by side
before the first forward. The PTX files themselves are CUDA's (measured on the device:
bench/results, issue 46); here, on the CPU: that each recipe names the module the model's
start met (MLX's CPU backend names a fused graph's kernel exactly as its CUDA backend names
the module), that the workers run, record and skip, and that files move in whole."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from daemon.engine.jit import prebuild
from daemon.engine.jit.prebuild_recipes import RECIPES, custom_recipes, recipes_for
from daemon.paths import BUNDLED_MODEL

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

REPO = Path(__file__).resolve().parents[2]

# The fused modules the bundled model's start and first requests compiled on the H200
# (bench/results/h200_2026-12-05/call2/start_timeline_default.json), bfloat16 weights, and the
# gated attention output a fresh H100's start compiled itself once the compiled step traced the
# attention in parts (bench/results/h100_2026-12-07/call3_start).
START_FUSED_MODULES = {
    "CV2ISigmoidBDV2OMultiplyAC_VV_V2V2_6142509188972423790",
    "Cf4IAsTypeADf4ISigmoidCEf4IBroadcastCDFf4IBroadcastDCGf4IMultiplyEFHf4IAsTypeBIf4IBroadcastGHJf4IBroadcastHGK"
    "f4IMultiplyIJLV2OAsTypeK_VV_V2V2_6142509188972423790",
    "CV2ISigmoidADV2IBroadcastACEV2IBroadcastCAFV2IMultiplyDEGV2IBroadcastFBHV2IBroadcastBFIV2OMultiplyGH_VV_V2V2_"
    "6142509188972423790",
    "Cf4IAsTypeADf4ISigmoidCEf4IMultiplyCDFf4IAsTypeBGf4IMultiplyEFHV2OAsTypeG_VV_V2V2_6142509188972423790",
    "CV2ISigmoidADV2IMultiplyACEV2OMultiplyDB_VV_V2V2_6142509188972423790",
    "CV2IBroadcastABDV2IBroadcastBAEV2OLogAddExpCD_VC_V2_2297668033614959926",
    "BV2ISigmoidACV2IBroadcastABDV2IBroadcastBAEV2OMultiplyCD_V_V2_6142509188972423790",
}
H200_OTHER_MODULES = {
    "gather_uint32_uint32_1", "gather_bfloat16_uint32_1", "gather_axis_float32_int32", "gather_axis_bfloat16_int32",
    "gather_float32_uint32_1", "scatter_float32_int32_Assign_2", "gather_float32_int32_2", "gather_int32_int32_1",
    "gather_bool_int32_1", "gather_bfloat16_int32_1", "gather_float32_int32_1",
}
# Met later: a council's first round on an H100 (bench/results/h100_2026-12-06g/call35), and the
# top-logprobs path's, read from engine/decoders/sampling.py.
LATER_MODULES = {"gather_bfloat16_int64_3", "gather_axis_float32_uint32", "gather_axis_uint32_uint32"}


def _run_recipe(recipe: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.engine.jit.prebuild_recipes", recipe, "bfloat16"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_the_fused_recipes_name_the_modules_a_start_compiled(tmp_path):
    # MLX's CPU backend writes each fused kernel's source under $TMPDIR/mlx/<version>/cpu,
    # named by the graph's tape: the name MLX-on-CUDA gives the module.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    fused = [r for r in recipes_for("bfloat16") if r.startswith("fused")]
    for recipe in fused:
        done = _run_recipe(recipe, env)
        assert done.returncode == 0, done.stderr
    written = {p.name.rsplit("_", 1)[0] if p.name.endswith("_contiguous.cpp") else p.name
               for p in (tmp_path / "mlx" / mx.__version__ / "cpu").glob("*_contiguous.cpp")}
    assert written == START_FUSED_MODULES
    assert len(fused) == len(START_FUSED_MODULES)  # one module a recipe: each compiles in its own worker


def test_every_other_recipe_is_named_like_its_module():
    # Gathers and scatters: MLX names them by dtypes and index count (mlx/backend/cuda/indexing.cpp).
    names = set()
    for recipe in recipes_for("bfloat16"):
        kind, *args = recipe.split()
        if kind == "scatter":
            names.add(f"scatter_{args[0]}_{args[1]}_Assign_{args[2]}")
        elif kind != "fused":
            names.add("_".join([kind, *args]))
    assert names == H200_OTHER_MODULES | LATER_MODULES


def test_the_float_dtype_is_read_from_the_model_config():
    assert prebuild.model_float_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert prebuild.model_float_dtype({"text_config": {"torch_dtype": "float16"}}) == "float16"
    assert prebuild.model_float_dtype({"torch_dtype": "int8"}) == "bfloat16"  # not a float: the default
    assert len(recipes_for("float32")) < len(RECIPES)  # F = float32 repeats float32 recipes: kept once


def test_workers_leave_a_core_to_the_daemon_and_none_run_on_a_small_machine():
    assert prebuild.worker_count(17, 16) == 15
    assert prebuild.worker_count(17, 64) == 17
    assert prebuild.worker_count(17, 2) == 0
    assert prebuild.worker_count(17, 2, min_cores=1) == prebuild.worker_count(17, 1, min_cores=1) == 1


def test_modules_move_in_whole_the_binary_last_and_never_over_one_there(tmp_path):
    private, ptx = tmp_path / "private", tmp_path / "ptx"
    (private / "long").mkdir(parents=True)
    ptx.mkdir()
    for stem in ("a", "long/b", "c"):
        for suffix, text in ((".ptx", "bin-" + stem), (".txt", "names"), (".cu", "src")):
            (private / (stem + suffix)).write_text(text)
    (ptx / "c.ptx").write_text("the daemon's own")
    moved = prebuild.move_modules(private, ptx)
    assert moved == ["a.ptx", "c.ptx", "long/b.ptx"]
    assert (ptx / "a.ptx").read_text() == "bin-a" and (ptx / "a.txt").exists() and (ptx / "a.cu").exists()
    assert (ptx / "long" / "b.ptx").read_text() == "bin-long/b" and (ptx / "long" / "b.txt").exists()
    assert (ptx / "c.ptx").read_text() == "the daemon's own"
    assert prebuild.modules_present(ptx, moved) and not prebuild.modules_present(ptx, moved + ["d.ptx"])
    assert not prebuild.modules_present(ptx, None)


def test_the_workers_run_every_recipe_record_it_and_a_second_start_runs_none(tmp_path):
    ptx = tmp_path / "ptx"
    first = prebuild.KernelPrebuild(ptx, "bfloat16", 2).start().join(240)
    assert first["state"] == "done" and first["failed"] == {}, first
    assert first["after_ready"] == list(prebuild.AFTER_READY)
    assert first["ran"] == first["recipes"] == len(recipes_for("bfloat16"))
    assert set(prebuild.read_manifest(ptx)) == set(recipes_for("bfloat16"))
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the private folders are gone
    second = prebuild.KernelPrebuild(ptx, "bfloat16", 2).start().wait(60)
    assert second["ran"] == 0 and second["state"] == "done"


def test_ready_waits_for_every_recipe_but_the_after_ready_ones_which_start_last_and_end_behind_it(tmp_path):
    """One worker: the after-ready recipe is spawned last; ``wait`` returns once the others are
    done, naming it as still running; ``join`` and ``on_finished`` see it finished."""
    import threading

    ptx, late = tmp_path / "ptx", "gather_axis uint32 uint32"
    pb = prebuild.KernelPrebuild(ptx, "bfloat16", 1, recipes=(late, "gather int32 int32 1"), after_ready=(late,))
    finished = threading.Event()
    seen: list[dict] = []
    pb.on_finished = lambda final: (seen.append(final), finished.set())
    report = pb.start().wait(120)
    assert report["state"] == "done" and report["after_ready"] == [late], report
    assert set(prebuild.read_manifest(ptx)) == {"gather int32 int32 1"}  # written at the ready point too
    assert [r for r, _ in report["slowest"]] == ["gather int32 int32 1"]
    final = pb.join(120)
    assert finished.wait(5) and seen == [final] and final["after_ready"] == [late]
    assert set(prebuild.read_manifest(ptx)) == {late, "gather int32 int32 1"}
    # A second start finds both: nothing runs, nothing is said after ready.
    again = prebuild.KernelPrebuild(ptx, "bfloat16", 1, recipes=(late, "gather int32 int32 1"), after_ready=(late,))
    again.on_finished = lambda final: seen.append(final)
    assert again.start().wait(60)["ran"] == 0 and again.join(10)["after_ready"] == [] and len(seen) == 1


def test_a_failing_recipe_is_reported_and_not_recorded(tmp_path):
    ptx = tmp_path / "ptx"
    report = prebuild.KernelPrebuild(ptx, "bfloat16", 2, recipes=("gather int32 int32 1", "gather nosuchtype int32 1")
                                     ).start().wait(120)
    assert list(report["failed"]) == ["gather nosuchtype int32 1"]
    assert "nosuchtype" in report["failed"]["gather nosuchtype int32 1"]
    assert set(prebuild.read_manifest(ptx)) == {"gather int32 int32 1"}


def _safetensors(path: Path, tensors: dict[str, str]) -> None:
    import json

    header = json.dumps({name: {"dtype": dtype, "shape": [1], "data_offsets": [0, 0]} for name, dtype in tensors.items()})
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode())


def test_custom_kernel_recipes_carry_the_model_s_head_shapes_and_stored_dtypes(tmp_path):
    import json

    config = json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())
    assert custom_recipes(Path(BUNDLED_MODEL), config, "bfloat16") == (
        "custom invariant_matmul bfloat16", "custom gemv_rows bfloat16", "custom invariant_sdpa bfloat16 64",
        *(f"custom gdn_conv {v} bfloat16 bfloat16 bfloat16 bfloat16 64 64 4 4 4" for v in ("plain", "mask", "all")))
    # A_log kept in float32, as many checkpoints store it; the dtype is the header's, per tensor.
    _safetensors(tmp_path / "model-00001.safetensors", {"model.layers.0.linear_attn.A_log": "F32",
                                                        "model.layers.0.linear_attn.dt_bias": "BF16"})
    _safetensors(tmp_path / "model-00002.safetensors", {"model.layers.0.linear_attn.conv1d.weight": "F16"})
    wide = {"text_config": {**config["text_config"], "head_dim": 256}} if "text_config" in config else {**config, "head_dim": 256}
    got = custom_recipes(tmp_path, wide, "float16")
    assert "custom invariant_sdpa float16 256" in got
    assert "custom gdn_conv mask float16 float32 bfloat16 float16 64 64 4 4 4" in got
    # No GatedDeltaNet tensors found: the recurrence's recipes are left out, not guessed.
    (tmp_path / "model-00002.safetensors").unlink()
    assert not any("gdn_conv" in r for r in custom_recipes(tmp_path, wide, "float16"))


def test_a_custom_kernel_recipe_runs_in_its_own_worker(tmp_path):
    """On the CPU the daemon's kernels do not run (mlx ops do), so the worker compiles nothing
    and ends cleanly; the recipe is recorded with no module."""
    recipes = custom_recipes(Path(BUNDLED_MODEL), {"num_attention_heads": 4, "hidden_size": 256,
                                                   "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                                                   "linear_num_key_heads": 4, "linear_num_value_heads": 4,
                                                   "linear_conv_kernel_dim": 4}, "bfloat16")
    report = prebuild.KernelPrebuild(tmp_path / "ptx", "bfloat16", 2, recipes=recipes).start().wait(240)
    assert report["state"] == "done" and report["failed"] == {} and report["ran"] == len(recipes) == 6, report
    assert prebuild.read_manifest(tmp_path / "ptx") == {r: [] for r in recipes}


def test_a_daemon_starts_the_workers_before_its_imports_and_waits_before_its_first_forward(tmp_path):
    # "on" runs them on this CPU too: the plumbing from the CLI to the first forward is the
    # same as on CUDA, where the modules are what it is for.
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    from e2e_harness import start_daemon  # noqa: E402 - the e2e tests' daemon launcher

    from daemon.paths import BUNDLED_MODEL

    d = start_daemon(tmp_path, BUNDLED_MODEL, config='kernel_prebuild = "on"\n', warmed=False)
    try:
        # The after-ready recipes end behind "ready" and say so once (their own event).
        deadline = time.monotonic() + 120
        while not [e for e in d.events() if e["event"] == "kernels.prebuilt_after_ready"]:
            assert time.monotonic() < deadline, "no kernels.prebuilt_after_ready in 120 s"
            time.sleep(0.2)
        events = d.events()
    finally:
        d.stop()
    names = [e["event"] for e in events]
    (started,) = [e for e in events if e["event"] == "kernels.prebuild"]
    (done,) = [e for e in events if e["event"] == "kernels.prebuilt"]
    assert started["state"] == "started" and started["folder"].startswith(str(tmp_path))
    assert done["state"] == "done" and done["failed"] == {} and done["ran"] == len(recipes_for("bfloat16"))
    assert names.index("kernels.prebuild") < names.index("daemon.loading") < names.index("kernels.prebuilt")
    assert names.index("kernels.prebuilt") < names.index("model.loaded")
    # Still compiling when the first forward went on (all of them with this box's one worker).
    assert set(done["after_ready"]) <= set(prebuild.AFTER_READY)
    (late,) = [e for e in events if e["event"] == "kernels.prebuilt_after_ready"]
    assert late["after_ready"] == list(prebuild.AFTER_READY) and late["failed"] == {}
    assert set(prebuild.read_manifest(Path(started["folder"]))) == set(recipes_for("bfloat16"))
    # Off CUDA the daemon's kernels are not prebuilt (its layers run mlx ops) and the custom
    # kernels' cache stays idle: the start-up log says so.
    assert started["custom_kernels"] == 0
    (loaded,) = [e for e in events if e["event"] == "model.loaded"]
    assert loaded["custom_kernels"] == {"found": 0, "compiled": 0, "failed": 0, "compile_s": 0.0, "active": False}


def test_a_stopped_daemons_private_folders_are_removed_and_a_live_ones_kept(tmp_path):
    ptx = tmp_path / "ptx"
    ptx.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f".ptx-prebuild-{dead.stdout.strip()}-3"
    live = tmp_path / f".ptx-prebuild-{os.getpid()}-0"
    for d in (orphan, live):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "m.ptx").write_text("x")
    assert prebuild.remove_orphans(ptx) == [orphan]
    assert not orphan.exists() and live.exists()


def test_an_unreadable_weights_header_drops_only_the_recurrence_recipes(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((40).to_bytes(8, "little") + b"{not json" + b" " * 31)
    config = {"num_attention_heads": 4, "hidden_size": 256, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
              "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4}
    assert custom_recipes(tmp_path, config, "bfloat16") == (
        "custom invariant_matmul bfloat16", "custom gemv_rows bfloat16", "custom invariant_sdpa bfloat16 64")
