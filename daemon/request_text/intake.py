"""The intake thread: tokenizes Generate prompts before they reach the engine thread.

Tokenizing is the one per-request cost that grows with what a client sends (a 4 MB prompt
takes seconds), so it must not run on the thread that decodes everyone's streams. Every
command the socket loop sends passes through here, in order, so a Cancel or a Stop never
overtakes the Generate it follows; only a Submit is worked on, and only a bounded amount
(``prompt_bounds``): text longer than ``CHARS_PER_TOKEN`` characters per allowed token, or
more chat messages than allowed tokens, is refused before it is tokenized.

A request's constraint (a grammar: JSON schema, regex, Lark) is compiled here too, with its
first token mask: a large or pathological grammar costs this thread, never the engine's, and
one that cannot be enforced is refused (``invalid_request``) before the request is accepted.
"""

from __future__ import annotations

import json
import queue
import threading

import msgspec

from ..engine.decoders.constraint import ConstraintError, compile_constraint
from ..logs import get_logger
from .reasoning import reasoning_split_for
from .requests import Job
from .tool_grammar import ToolGrammarError, bound_schema, budget_cap, string_slots, tool_constraint

log = get_logger("councild.intake")

# No tokenizer of a served model averages more characters per token than this over a
# prompt; real text averages about four. So text past it cannot fit the token limit.
CHARS_PER_TOKEN = 32


def prompt_bounds(job: Job, limit: int) -> tuple[str, str] | None:
    """(code, message) when the request's prompt is over the limit before tokenizing."""
    msg = job.msg
    if msg.prompt_tokens is not None and len(msg.prompt_tokens) > limit:
        return "prompt_too_long", f"prompt has {len(msg.prompt_tokens)} tokens; this daemon accepts at most {limit}"
    if msg.messages is not None and len(msg.messages) > limit:
        return "prompt_too_long", (f"{len(msg.messages)} chat messages cannot fit in {limit} tokens "
                                   "(each message costs at least one)")
    chars = len(msg.prompt) if msg.prompt is not None else sum(len(c.content) for c in msg.messages or ())
    if chars > CHARS_PER_TOKEN * limit:
        return "prompt_too_long", (f"prompt has {chars} characters; this daemon accepts at most {limit} tokens and "
                                   f"refuses text over {CHARS_PER_TOKEN * limit} characters without tokenizing it")
    return None


def string_cap(msg, constraint=None) -> int:
    """The request's cap on free strings in forced calls and json_schema answers: its own
    ``string_max_chars``, else the daemon's [constraint] default (0: none)."""
    asked = msg.string_max_chars
    if asked is not msgspec.UNSET:
        return asked
    return constraint.string_max_chars if constraint is not None else 0


def tokenize(job: Job, lm, limit: int, chat=None, constraint=None) -> tuple[str, str] | None:
    """Fill ``job.prompt`` (and, for a chat, where its reasoning is split off and where its
    shared first message ends); return (code, message) when the request must be refused.
    ``chat``: the daemon's [chat] config (template defaults, reasoning split);
    ``constraint``: its [constraint] config (the free-string cap)."""
    bad = prompt_bounds(job, limit)
    if bad is not None:
        return bad
    msg = job.msg
    if msg.messages is None and (msg.tools or msg.tool_choice):
        return "invalid_request", "tools and tool_choice apply to messages only (the chat template renders them)"
    try:  # tool_choice required or named: a grammar in the model's call format (tool_grammar.py)
        derived = tool_constraint(msg, getattr(lm.tokenizer, "chat_template", None), string_cap(msg, constraint))
    except ToolGrammarError as exc:
        return "invalid_request", str(exc)
    if derived is not None:
        if msg.option_constraint() is not None:
            return "invalid_request", "give a constraint or tool_choice 'required' / a named tool, not both"
        job.msg = msg = msgspec.structs.replace(msg, constraint=derived)
    try:
        # The daemon's [chat] defaults, then the request's own (chat requests only).
        asked = msg.chat_template_kwargs or None  # UNSET (not sent) and None alike: none
        template_kwargs = ({**(chat.template_kwargs if chat else {}), **(asked or {})}
                           if msg.messages is not None else asked)
        job.prompt = lm.encode_prompt(
            msg.prompt,
            [template_message(c) for c in msg.messages] if msg.messages is not None else None,
            msg.prompt_tokens,
            template_kwargs,
            tools=[template_tool(t) for t in job.tools] or None,
        )
        if msg.messages is not None and chat is not None and chat.separate_reasoning:
            job.reasoning = reasoning_split_for(lm.tokenizer, job.prompt)
    except Exception as exc:  # noqa: BLE001 - a prompt the tokenizer rejects is the client's error
        return "invalid_request", f"could not tokenize the {msg.prompt_kind()}: {exc}"
    if not job.prompt:
        return "invalid_request", "the prompt is empty after tokenization"
    vocab = lm.text_args.vocab_size
    if any(t >= vocab for t in job.prompt):
        return "invalid_request", f"prompt_tokens holds ids outside the vocabulary (size {vocab})"
    if len(job.prompt) > limit:
        return "prompt_too_long", f"prompt has {len(job.prompt)} tokens; this daemon accepts at most {limit}"
    if msg.messages is not None:
        job.segment_ends = chat_segment_ends(lm, msg, job.prompt)
    return compile_request_constraint(job, lm, string_cap(msg, constraint))


def compile_request_constraint(job: Job, lm, max_chars: int = 0) -> tuple[str, str] | None:
    """Set ``job.constraint`` from the request's; (code, message) when it cannot be
    enforced (fail closed: such a request is refused, never decoded unconstrained).
    A json_schema's free strings are capped at ``max_chars`` (tool_grammar.bound_schema)."""
    spec = job.msg.option_constraint()
    if spec is None:
        return None
    value = spec.value
    if spec.kind == "json_schema" and max_chars:
        try:
            schema = json.loads(value)
        except ValueError:
            schema = None  # compile_constraint names the error
        if isinstance(schema, dict):
            cap = budget_cap(max_chars, job.msg.max_tokens, string_slots(schema))
            value = json.dumps(bound_schema(schema, cap, False))
    try:
        job.constraint = compile_constraint(lm, spec.kind, value)
    except ConstraintError as exc:
        return "invalid_request", f"unsupported constraint: {exc}"
    return None


def template_message(c) -> dict:
    """A ChatMessage as chat templates read it (the shape of OpenAI's messages, which
    Hugging Face templates follow): an assistant's calls with their arguments as a mapping
    (Qwen's templates iterate over them), a tool turn with the call it answers."""
    out: dict = {"role": c.role, "content": c.content}
    if c.tool_calls:
        out["tool_calls"] = [{"id": t.id, "type": "function",
                              "function": {"name": t.name, "arguments": _arguments(t.arguments)}}
                             for t in c.tool_calls]
    if c.tool_call_id:
        out["tool_call_id"] = c.tool_call_id
    if c.name:
        out["name"] = c.name
    return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_tool(t) -> dict:
    return {"type": "function", "function": {"name": t.name, "description": t.description,
                                             "parameters": t.parameters or {"type": "object", "properties": {}}}}


# Message boundaries looked for besides the first message's: the last ones (a seat's next
# turn re-sends them; a template that rewrites turn k then loses only what follows it).
# Each costs one render of the chat so far, on the intake thread.
RECENT_SEGMENTS = 8


def chat_segment_ends(lm, msg, prompt: list[int]) -> list[int]:
    """Where message boundaries fall in the prompt's tokens: after the first message (the
    shared system prompt, so other seats start from it) and after each of the last
    RECENT_SEGMENTS, wherever the chat template renders the messages up to there as a
    prefix of the whole prompt (templates that rewrite past turns, e.g. strip their
    reasoning, do not for the turns they rewrite). The prefix cache keeps snapshots there."""
    n = len(msg.messages)
    ends = []
    for k in sorted({1} | set(range(max(1, n - RECENT_SEGMENTS), n))):
        try:
            head = [{"role": x.role, "content": x.content} for x in msg.messages[:k]]
            tok = lm.tokenizer
            if getattr(tok, "chat_template", None):
                ids = list(tok.apply_chat_template(head, add_generation_prompt=False, tokenize=True))
            else:
                ids = list(tok.encode("".join(f"{x['role']}: {x['content']}\n" for x in head)))
        except Exception:  # noqa: BLE001 - no segment: the cache still keeps the prompt's end
            continue
        if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids:
            ends.append(len(ids))
    return ends


class Intake(threading.Thread):
    """Moves commands from ``source`` to ``sink`` in order, tokenizing each Submit's job on
    the way (a refused one carries ``job.rejection``; the engine sends it)."""

    def __init__(self, source: queue.Queue, sink: queue.Queue, lm, limit: int, submit_type: type, chat=None,
                 constraint=None):
        super().__init__(name="councild-intake", daemon=True)
        self.chat = chat
        self.constraint = constraint
        self.source = source
        self.sink = sink
        self.lm = lm
        self.limit = limit
        self.submit_type = submit_type

    def run(self) -> None:
        while True:
            cmd = self.source.get()
            if isinstance(cmd, self.submit_type):
                try:
                    cmd.job.rejection = tokenize(cmd.job, self.lm, self.limit, self.chat, self.constraint)
                except Exception as exc:  # noqa: BLE001 - never lose the command, whatever failed
                    log.error("intake.failed", request_id=cmd.job.request_id, seat=cmd.job.seat, error=repr(exc))
                    cmd.job.rejection = ("internal", f"tokenization failed: {type(exc).__name__}: {exc}")
            self.sink.put(cmd)
