"""Thinking text apart from the answer, where the chat template marks it.

Templates of thinking models (Qwen3.5, Qwen3, DeepSeek-R1, ...) put the model's reasoning
between markers (``<think>`` ... ``</think>``; mlx-lm's tokenizer wrapper knows each
family's pair). Whether the output *starts* inside a think block is decided by the rendered
prompt: Qwen3.5's template opens ``<think>\\n`` itself when thinking is on (the model then
writes only the closing marker) and emits an empty ``<think>\\n\\n</think>\\n\\n`` when it is off
(``enable_thinking: false``). So: the output starts inside when the prompt's last start
marker comes after its last end marker; after that the markers in the output switch.

The split is on text (the committed tokens' decoded text) and prefix-stable: splitting a
prefix of the text gives prefixes of the final reasoning and answer, provided the prefix
does not end inside a marker; ``safe_end`` moves a streaming cut back to before one.
The markers themselves belong to neither part.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSplit:
    start: str
    end: str
    starts_inside: bool

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of ``text``."""
        reasoning: list[str] = []
        answer: list[str] = []
        inside = self.starts_inside
        pos = 0
        while pos < len(text):
            marker = self.end if inside else self.start
            i = text.find(marker, pos)
            stop = len(text) if i < 0 else i
            (reasoning if inside else answer).append(text[pos:stop])
            if i < 0:
                break
            pos = i + len(marker)
            inside = not inside
        return "".join(reasoning), "".join(answer)

    def safe_end(self, text: str, upto: int) -> int:
        """The largest cut <= ``upto`` that does not end inside a marker (or inside what may
        still become one, at the live end of a stream)."""
        for marker in (self.start, self.end):
            for i in range(max(0, upto - len(marker) + 1), upto):
                if marker.startswith(text[i:upto]):
                    return self.safe_end(text, i)
        return upto


def reasoning_split_for(tokenizer, prompt_ids: list[int]) -> ReasoningSplit | None:
    """The split for a chat request whose rendered prompt is ``prompt_ids``, or None when the
    tokenizer knows no thinking markers."""
    start = getattr(tokenizer, "think_start", None)
    end = getattr(tokenizer, "think_end", None)
    if not getattr(tokenizer, "has_thinking", False) or not start or not end:
        return None
    tail = tokenizer.decode(list(prompt_ids[-256:]))
    return ReasoningSplit(start, end, starts_inside=tail.rfind(start) > tail.rfind(end))
