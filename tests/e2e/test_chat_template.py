"""Chat template options per request and in the config, and thinking reported apart from the
answer, through a real daemon serving the bundled model given a Qwen3.5-style thinking
template (vocabulary + 2: ``<think>``, ``</think>``; their embedding rows are zero)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from daemon.paths import BUNDLED_MODEL
from protocol.client import Client, InvalidRequest

from e2e_harness import start_daemon

# Qwen3.5's rule: thinking on unless enable_thinking is false; on, the template opens the
# block and the model closes it; off, the template writes an empty block.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def thinking_daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking-model")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, folder / name)
    weights = mx.load(str(BUNDLED_MODEL / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = mx.concatenate([emb, mx.zeros((2, emb.shape[1]), dtype=emb.dtype)])
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = 4098
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((folder / "tokenizer.json").read_text())
    for i, content in ((4096, "<think>"), (4097, "</think>")):
        tok["added_tokens"].append({"id": i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    d = start_daemon(tmp_path_factory.mktemp("thinking"), folder,
                     config="[chat]\ntemplate_kwargs = { enable_thinking = false }\n")
    yield d
    assert d.stop() == 0


def _decode(ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def test_config_default_turns_thinking_off_and_a_request_turns_it_on(thinking_daemon):
    with Client(thinking_daemon.endpoint, seat="chat", timeout_s=60) as c:
        assert "chat_template_kwargs" in c.welcome.capabilities
        off = c.generate(messages=CHAT, max_tokens=24)
        off_chunks = list(off)
        on = c.generate(messages=CHAT, max_tokens=24, chat_template_kwargs={"enable_thinking": True})
        on_chunks = list(on)
        explicit_off = c.complete(messages=CHAT, max_tokens=24, chat_template_kwargs={"enable_thinking": False})
    # [chat] template_kwargs made the template write the empty block: 7 more prompt tokens
    # ("<think>" "\n\n" "</think>" "\n\n" vs "<think>" "\n") than with thinking on.
    assert off.accepted.prompt_tokens == explicit_off.usage.prompt_tokens > on.accepted.prompt_tokens
    # Thinking off: everything is answer.
    assert off.done.reasoning == "" and off.done.text == "".join(off_chunks) != ""
    # Thinking on: the template opened the block, so the output is reasoning until the model
    # closes it (this model never learned to: then all of it), streamed apart from the text.
    ids = on.token_ids
    close = ids.index(4097) if 4097 in ids else len(ids)
    assert on.done.reasoning == _decode(ids[:close]) != ""
    assert on.done.text == _decode(ids[close + 1:]) == "".join(on_chunks)
    assert "".join(on.reasoning_chunks) == on.done.reasoning


def test_template_kwargs_need_messages(thinking_daemon):
    with Client(thinking_daemon.endpoint, seat="chat", timeout_s=60) as c:
        with pytest.raises(InvalidRequest) as err:
            c.complete("def add(a, b):", max_tokens=4, chat_template_kwargs={"enable_thinking": False})
    assert err.value.code == "invalid_request" and "messages only" in str(err.value)
