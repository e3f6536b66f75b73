"""The wire contract: every message councild and a council process exchange.

Each message is a msgspec Struct in one tagged union (tag field ``type``), and every one
carries the protocol version ``v``. Field constraints live here, on the types, so that
decoding a frame *is* validating it: a frame that decodes is a request the daemon can act on.
PROTOCOL.md documents the same contract for implementers in other languages.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

PROTOCOL_VERSION = 1

# Request ids travel into logs and status output; keep them short and printable.
RequestId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")]
SeatName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._\-]+$")]
Priority = Literal["interactive", "normal", "background"]
Speculation = Literal["off", "exact", "fast"]
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]

# Bounds that hold whatever the daemon's configuration says; the daemon's own (often
# tighter) limits are announced in Welcome.limits and enforced after decoding.
MAX_TOKENS_CEILING = 1 << 20
MAX_PROMPT_CHARS = 4 << 20
MAX_STOP_STRINGS = 16
MAX_MESSAGES = 1024
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
# Generate's optional sampling options and what an absent one means.
SAMPLING_DEFAULTS = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                     "logit_bias": None, "logprobs": False, "top_logprobs": 0}


class _Message(Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    v: int = PROTOCOL_VERSION


# ---------------------------------------------------------------- client -> daemon


class Hello(_Message, tag="hello"):
    """Names the connection's seat. Optional: without it a connection sits in seat ``default``."""

    seat: SeatName = "default"
    client: Annotated[str, Meta(max_length=128)] = ""


ToolName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
MAX_TOOLS = 128


class ToolCall(Struct, forbid_unknown_fields=True, kw_only=True):
    """One function call the model made. ``arguments`` is a JSON object, as JSON text (the
    form OpenAI's API carries it in), so that it round-trips byte for byte."""

    id: Annotated[str, Meta(min_length=1, max_length=128)]
    name: ToolName
    arguments: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] = "{}"


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    """One chat turn. ``tool_calls``: the calls an assistant turn made; ``tool_call_id`` and
    ``name``: which call a ``tool`` turn answers. UNSET unless given, so a chat without
    tools encodes exactly as before and an older daemon still accepts it."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOLS)] | UnsetType = UNSET
    tool_call_id: Annotated[str, Meta(min_length=1, max_length=128)] | UnsetType = UNSET
    name: ToolName | UnsetType = UNSET


class ToolSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    """A function the model may call: rendered into the prompt by the chat template, its
    ``parameters`` (a JSON Schema of the arguments object) used to constrain calls."""

    name: ToolName
    description: Annotated[str, Meta(max_length=1 << 16)] = ""
    parameters: dict = {}

    def __post_init__(self):
        # The chat template, the call grammar and the call parser walk these as JSON Schema
        # has them; decoding refuses other shapes (msgspec reports this ValueError as a
        # validation error at the tool's path).
        params = self.parameters
        if "properties" in params and not isinstance(params["properties"], dict):
            raise ValueError("parameters.properties must be an object of schemas")
        required = params.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise ValueError("parameters.required must be a list of property names")


class NamedToolChoice(Struct, forbid_unknown_fields=True, kw_only=True):
    """tool_choice naming one function: the model must call exactly it."""

    name: ToolName


ToolChoice = Union[Literal["auto", "none", "required"], NamedToolChoice]


TemplateKey = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]

MAX_CONSTRAINT_CHARS = 1 << 20
# Ceiling of Generate.string_max_chars (and of the daemon's default for it).
MAX_STRING_CHARS = 1 << 16


class Constraint(Struct, forbid_unknown_fields=True, kw_only=True):
    """What the output must match. ``json_schema``: ``value`` is a JSON Schema (as JSON
    text); ``json_object``: any JSON object (``value`` empty); ``regex``: a regular
    expression the whole output matches; ``lark``: a grammar in llguidance's Lark dialect.
    A constraint the daemon cannot enforce is refused (``invalid_request``, naming the
    construct): output is never returned unconstrained."""

    kind: Literal["json_schema", "json_object", "regex", "lark"]
    value: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] = ""


class Generate(_Message, tag="generate"):
    """Ask for a completion. Exactly one of ``prompt``, ``messages``, ``prompt_tokens``.

    The sampling options added within version 1 (min_p ... top_logprobs) are UNSET unless
    given, and an UNSET field is not encoded: an older daemon still accepts every request
    that does not use them. Read them with ``option(name)``."""

    request_id: RequestId
    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)] | None = None
    prompt_tokens: Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 31)]], Meta(max_length=1 << 20)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_CEILING)] = 256
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    seed: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] | None = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=MAX_STOP_STRINGS)] = []
    stream: bool = True
    priority: Priority | None = None
    # Milliseconds from the daemon's receipt of this message; relative, so that client and
    # daemon clocks never have to agree.
    deadline_ms: Annotated[int, Meta(ge=1, le=7 * 24 * 3600 * 1000)] | None = None
    # None: the daemon's configured default. "off": serial decode.
    speculation: Speculation | None = None
    # Extra variables for the model's chat template (with ``messages`` only), e.g.
    # {"enable_thinking": false} for Qwen3.5; they override the daemon's [chat] defaults.
    # UNSET unless given (like the sampling options below), so a client that does not use it
    # stays understood by a daemon that predates it.
    chat_template_kwargs: Annotated[dict[TemplateKey, str | bool | int | float], Meta(max_length=16)] | None | UnsetType = UNSET
    # Sampling options (engine/decoders/sampling.py has the order they apply in). Penalties and
    # logit_bias change the distribution at temperature 0 too; min_p only when sampling.
    # UNSET means SAMPLING_DEFAULTS' value.
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | UnsetType = UNSET
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | UnsetType = UNSET
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | UnsetType = UNSET
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | UnsetType = UNSET
    logit_bias: Annotated[dict[Annotated[int, Meta(ge=0, lt=1 << 31)], Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=MAX_LOGIT_BIAS)] | None | UnsetType = UNSET
    # Per output token: its log-probability and the top_logprobs most likely alternatives.
    logprobs: bool | UnsetType = UNSET
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | UnsetType = UNSET
    # Constrained decoding (llguidance): UNSET or None means unconstrained.
    constraint: Constraint | None | UnsetType = UNSET
    # Tool calling (with ``messages`` only): the functions the model may call, and whether it
    # may (auto), must not (none), must (required) or must call one named function. Calls in
    # the output are parsed into Tokens/Done.tool_calls. UNSET unless given.
    tools: Annotated[list[ToolSpec], Meta(max_length=MAX_TOOLS)] | None | UnsetType = UNSET
    tool_choice: ToolChoice | UnsetType = UNSET
    # required/named: whether several calls may come in one turn (default true).
    parallel_tool_calls: bool | UnsetType = UNSET
    # The most characters of a free string (a string with no maxLength, enum, const or
    # format of its own) inside a forced tool call or a json_schema answer, so that a model
    # that never ends a string still closes the call or the answer; 0: no cap. UNSET: the
    # daemon's [constraint] string_max_chars.
    string_max_chars: Annotated[int, Meta(ge=0, le=MAX_STRING_CHARS)] | UnsetType = UNSET
    # Tokenize only: Accepted (with prompt_tokens) then Done with no output; nothing decoded.
    count_only: bool | UnsetType = UNSET
    # The seat's session in the prefix cache: "keep" stores this request's continuation
    # (prompt + answer) for the seat's next turn and pins it; "drop" forgets the seat's
    # kept continuations (RAM and disk) when this request ends. UNSET: the daemon's rule.
    session: Literal["keep", "drop"] | UnsetType = UNSET

    def option(self, name: str):
        """A sampling option's value, its default when it was not sent."""
        value = getattr(self, name)
        return SAMPLING_DEFAULTS[name] if value is UNSET else value

    def option_tools(self) -> list[ToolSpec]:
        """The tools the model may call, [] when none or when tool_choice is "none"."""
        if self.tools is UNSET or not self.tools or self.tool_choice == "none":
            return []
        return list(self.tools)

    def option_tool_choice(self):
        """tool_choice with its default: "auto" when tools are given."""
        return "auto" if self.tool_choice is UNSET else self.tool_choice

    def option_constraint(self) -> Constraint | None:
        """The request's constraint, None when it has none (UNSET or null)."""
        return None if self.constraint is UNSET else self.constraint

    def prompt_kind(self) -> str | None:
        """Which prompt field is set, or None when zero or several are (a client error)."""
        given = [
            name
            for name, value in (("prompt", self.prompt), ("messages", self.messages), ("prompt_tokens", self.prompt_tokens))
            if value is not None
        ]
        return given[0] if len(given) == 1 else None


class Cancel(_Message, tag="cancel"):
    request_id: RequestId


class Status(_Message, tag="status"):
    pass


class Ping(_Message, tag="ping"):
    """Liveness both ways: the reply proves the daemon is up, the ping proves the client is."""

    nonce: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] = 0


class GovernorCommand(_Message, tag="governor"):
    """Operator override: pin a depth, force the MTP head out or in, or hand back to auto."""

    action: Literal["pin_depth", "evict_head", "load_head", "auto"]
    depth: Annotated[int, Meta(ge=0, le=16)] | None = None


# ---------------------------------------------------------------- daemon -> client


class _DaemonMessage(_Message, forbid_unknown_fields=False):
    """Daemon replies tolerate fields a client does not know yet: within a protocol
    version the daemon may add fields, and an older client must read on, not fail."""


class Limits(Struct, kw_only=True):
    max_frame_bytes: int
    max_tokens: int
    max_prompt_tokens: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class Welcome(_DaemonMessage, tag="welcome"):
    seat: str
    server: str
    model: str
    capabilities: list[str]
    limits: Limits


class Accepted(_DaemonMessage, tag="accepted"):
    request_id: str
    queue_position: int
    prompt_tokens: int


class TopLogprob(Struct, kw_only=True):
    token_id: int
    token: str
    logprob: float


class TokenLogprob(Struct, kw_only=True):
    """One output token's log-probability under the request's processed distribution
    (after penalties and logit_bias, before temperature, top-k, top-p and min_p)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = []


class Tokens(_DaemonMessage, tag="tokens"):
    """A chunk of a stream. ``seq`` starts at 0 and rises by one per chunk of a request."""

    request_id: str
    seq: int
    text: str
    token_ids: list[int]
    # Thinking text of this chunk, where the chat template marks it (``text`` is then the
    # answer only). Empty for models and requests without it.
    reasoning: str = ""
    # Only when the request asked for logprobs: one entry per id in token_ids.
    logprobs: list[TokenLogprob] | None = None
    # Tool calls completed in this chunk (each whole, once); their text is never in ``text``.
    tool_calls: list[ToolCall] | None = None


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens served from the daemon's prefix cache (not recomputed); 0 from a daemon
    # without one. Included in prompt_tokens.
    cached_tokens: int = 0


class Timings(Struct, kw_only=True):
    queue_s: float
    prefill_s: float
    decode_s: float
    ttft_s: float
    tokens_per_s: float


class SpecStats(Struct, kw_only=True):
    """Speculation telemetry of one request: what was drafted, what survived, by position."""

    mode: str
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_by_position: list[int] = []
    drafted_by_position: list[int] = []
    guarded: int = 0
    # Prompt-lookup blocks, apart from the head's drafts above.
    lookup_cycles: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0


class Done(_DaemonMessage, tag="done"):
    """Terminal: the request ended normally, by a stop condition or by cancellation."""

    request_id: str
    finish_reason: FinishReason
    text: str
    usage: Usage
    timings: Timings
    speculation: SpecStats | None = None
    # The whole thinking text (``text`` is the answer without it); "" when there was none.
    reasoning: str = ""
    # Only when the request asked for logprobs and did not stream: one entry per output token.
    logprobs: list[TokenLogprob] | None = None
    # Every tool call of the output, in order (``text`` is the text around them).
    tool_calls: list[ToolCall] = []


ErrorCode = Literal[
    "bad_frame",
    "frame_too_large",
    "unsupported_version",
    "unknown_type",
    "invalid_request",
    "duplicate_request",
    "not_found",
    "prompt_too_long",
    "overloaded",
    "deadline_exceeded",
    "shutting_down",
    "slow_consumer",
    "client_gone",
    "internal",
]


class Error(_DaemonMessage, tag="error"):
    """Terminal for ``request_id`` when it is set; otherwise a reply to an undecodable frame."""

    code: ErrorCode
    message: str
    request_id: str | None = None
    retry_after_s: float | None = None


class StatusReply(_DaemonMessage, tag="status_reply"):
    """A snapshot of the daemon. ``detail`` is free-form and grows as features land."""

    server: str
    model: str
    uptime_s: float
    active: int
    queued: int
    detail: dict = {}


class Pong(_DaemonMessage, tag="pong"):
    nonce: int = 0


class GovernorReply(_DaemonMessage, tag="governor_reply"):
    ok: bool
    message: str
    state: dict = {}


ClientMessage = Union[Hello, Generate, Cancel, Status, Ping, GovernorCommand]
DaemonMessage = Union[Welcome, Accepted, Tokens, Done, Error, StatusReply, Pong, GovernorReply]
AnyMessage = Union[ClientMessage, DaemonMessage]

TERMINAL_TYPES = (Done, Error)

__all__ = [
    "PROTOCOL_VERSION",
    "Hello",
    "ChatMessage",
    "Constraint",
    "ToolCall",
    "ToolSpec",
    "NamedToolChoice",
    "Generate",
    "Cancel",
    "Status",
    "Ping",
    "GovernorCommand",
    "Limits",
    "Welcome",
    "Accepted",
    "Tokens",
    "TopLogprob",
    "TokenLogprob",
    "Usage",
    "Timings",
    "SpecStats",
    "Done",
    "Error",
    "StatusReply",
    "Pong",
    "GovernorReply",
    "ClientMessage",
    "DaemonMessage",
    "AnyMessage",
    "TERMINAL_TYPES",
    "msgspec",
]
