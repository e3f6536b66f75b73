"""The bundled model's tool/JSON fine-tuning step (tools/tiny_finetune.py, tiny_tooldata.py):
its samples render with the daemon's chat template and their calls parse back with the
daemon's parser, the held-out tool families stay out of training, and the pipeline
(ft-data's packing, then finetune from the bundled weights) runs a couple of steps on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from daemon.engine.model.chat_templates import QWEN_TOOLS_TEMPLATE
from daemon.paths import BUNDLED_MODEL
from daemon.request_text.tool_calls import parse_tool_calls
from protocol import messages as pm

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS_DIR))

import tiny_finetune as ft  # noqa: E402
import tiny_tooldata as td  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    t = ft.hf_tokenizer(BUNDLED_MODEL)
    assert t.chat_template == QWEN_TOOLS_TEMPLATE  # the daemon's template, not a copy
    return t


def specs(tools):
    return [pm.ToolSpec(name=t["function"]["name"], description=t["function"]["description"],
                        parameters=t["function"]["parameters"]) for t in tools or []]


def test_samples_render_and_calls_parse_back(tok):
    samples = td.generate(300, seed=3)
    kinds = {"call": 0, "json": 0, "text": 0}
    for s in samples:
        text = tok.apply_chat_template(s["messages"], tools=s["tools"], tokenize=False)
        turns = ft.TURN.findall(text)
        asked = [m for m in s["messages"] if m["role"] == "assistant"]
        assert len(turns) == len(asked)
        for m, turn in zip(asked, turns):
            content = turn[: -len("<|im_end|>")]
            rest, calls = parse_tool_calls(content, specs(s["tools"]), lambda i: f"call_{i}")
            want = m.get("tool_calls") or []
            assert [(c.name, json.loads(c.arguments)) for c in calls] == \
                [(w["function"]["name"], w["function"]["arguments"]) for w in want], content
            if want:
                kinds["call"] += 1
                assert rest == "" and "<tool_call>" not in rest
            elif content.startswith("{"):
                kinds["json"] += 1
                assert isinstance(json.loads(content), dict)
            else:
                kinds["text"] += 1
                assert "<tool_call>" not in content
    assert min(kinds.values()) > 10, kinds


def test_mask_covers_exactly_the_assistant_turns(tok):
    s = td.generate(1, seed=5)[0]
    while not any(m.get("tool_calls") for m in s["messages"]):
        s = td.generate(1, seed=len(s["messages"]) + 6)[0]
    ids, mask = ft.encode_sample(tok, s)
    text = tok.apply_chat_template(s["messages"], tools=s["tools"], tokenize=False)
    assert tok.decode(ids) == text
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "".join(ft.TURN.findall(text))


def test_heldout_families_never_in_training():
    train = {t.name for t in td.tools("train")}
    held = {t.name for t in td.tools("heldout")}
    assert not train & held and len(held) >= 20
    seen, made_up = set(), 0
    for s in td.generate(2000, seed=1):
        names = {t["function"]["name"] for t in s["tools"] or []}
        seen |= names
        made_up += bool(names - train)
    assert not seen & held and made_up > 300  # made-up tools: names to copy, not to recall
    held_words = {w for n in held for w in n.split("_")} - {w for n in train for w in n.split("_")}
    assert not held_words & (set(td.VERBS) | set(td.NOUNS))
    cases = td.eval_cases(n_per_tool=1)
    assert {c["expect"] for c in cases} == held
    assert all({t["function"]["name"] for t in c["tools"]} <= held for c in cases)


# A training run (the `slow` tier, as the other training runs): it needs torch, which only the
# training tools use (`pip install torch==2.13.0`), not the daemon or the suite's other tests.
@pytest.mark.slow
def test_finetune_runs_two_steps_on_cpu(tok, tmp_path):
    pytest.importorskip("torch")
    ids, bits, starts = ft.pack(tok, td.generate(40, seed=9), max_len=512)
    np.savez_compressed(tmp_path / "chat.npz", ids=ids, mask=bits, starts=starts)
    ids, bits, starts = ft.pack(tok, td.generate(10, seed=10, split="heldout"), max_len=512)
    np.savez_compressed(tmp_path / "chat_held.npz", ids=ids, mask=bits, starts=starts)
    rng = np.random.default_rng(0)
    for name in ("code.npy", "code_held.npy"):
        np.save(tmp_path / name, rng.integers(3, 4096, 4000).astype(np.uint16))
    out = tmp_path / "run"
    ft.main(["--asset", str(BUNDLED_MODEL), "finetune", "--data", str(tmp_path), "--device", "cpu",
              "--steps", "2", "--batch", "2", "--seq", "512", "--eval-every", "0", "--held-windows", "1", "--threads", "1",
              "--out", str(out)])
    from safetensors.torch import load_file as tload  # bf16: read with torch

    got = tload(str(out / "state.safetensors"))
    ref = tload(str(BUNDLED_MODEL / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    log = json.loads((out / "ft_log.json").read_text())
    assert log["final"]["steps"] == 2
    assert all(np.isfinite(r["code_base"]) and np.isfinite(r["chat_base"]) for r in log["rows"])
