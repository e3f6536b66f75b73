"""One accepted request's life on the engine thread: tokens in, text chunks out.

A Job turns committed token ids into the text they mean (``detokenize.CommittedText``),
holds back any tail that could still become a stop string, and decides when the request is
finished (eos, stop string, max tokens). It also aggregates speculation telemetry for the
Done message. No sockets here: the worker sends what the Job returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol import messages as m

from ..engine.types import DecodeStep
from .tool_calls import ToolCallStream, parse_tool_calls


@dataclass
class SpecTally:
    mode: str = "off"
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    guarded: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    # Cycles that verified a prompt-lookup block (engine/decoders/lookup.py), counted apart; the
    # per-position tallies above hold the head's drafts only.
    lookup_cycles: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    # Head cycles that stopped below the depth ceiling; steps under the loop guard's penalty.
    draft_stops: int = 0
    penalised: int = 0

    def add(self, step: DecodeStep) -> None:
        """``drafted`` / ``accepted`` and the by-position arrays count the head's drafts only
        (PROTOCOL.md), so the arrays sum to them; prompt-lookup blocks are counted apart."""
        self.draft_stops += step.stopped_early
        self.cycles += 1
        self.guarded += step.guarded
        if step.draft_source == "lookup":
            self.lookup_cycles += 1
            self.lookup_drafted += step.drafted
            self.lookup_accepted += step.accepted
            return
        self.drafted += step.drafted
        self.accepted += step.accepted
        for i, ok in enumerate(step.accepted_mask):
            while len(self.drafted_by_position) <= i:
                self.drafted_by_position.append(0)
                self.accepted_by_position.append(0)
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(ok)

    def message(self) -> m.SpecStats:
        return m.SpecStats(
            mode=self.mode,
            cycles=self.cycles,
            drafted=self.drafted,
            accepted=self.accepted,
            accepted_by_position=list(self.accepted_by_position),
            drafted_by_position=list(self.drafted_by_position),
            guarded=self.guarded,
            lookup_cycles=self.lookup_cycles,
            lookup_drafted=self.lookup_drafted,
            lookup_accepted=self.lookup_accepted,
        )


class Job:
    """State of one request. Attributes the scheduler reads: seat, priority, enqueued_at,
    weight."""

    def __init__(self, *, msg: m.Generate, identity: bytes, seat: str, priority: str, weight: float,
                 deadline: float | None, received_at: float):
        self.msg = msg
        self.identity = identity
        self.seat = seat
        self.priority = priority
        self.weight = weight
        self.deadline = deadline
        self.received_at = received_at
        self.enqueued_at = received_at
        self.request_id = msg.request_id
        self.key = (seat, msg.request_id)
        self.prompt: list[int] = []
        # (code, message) when the intake thread refused the prompt (intake.py).
        self.rejection: tuple[str, str] | None = None
        # The request's compiled constraint (engine/decoders/constraint.py), set by the intake thread.
        self.constraint = None
        self.generator = None
        self.detok = None
        self.cancelled = False
        self.cancel_reason = "cancelled"
        self.token_ids: list[int] = []
        self.text = ""
        self.sent_chars = 0
        # Set for chat requests whose template marks thinking (daemon/request_text/reasoning.py): chunks
        # and Done then carry the thinking in ``reasoning`` and the answer in ``text``.
        self.reasoning = None
        self.sent_reasoning = 0
        self.sent_answer = 0
        self.seq = 0
        # Requests with tools: calls are parsed out of the answer (daemon/request_text/tool_calls.py).
        self.tools = msg.option_tools() if msg.messages is not None else []
        # The one function a forced choice allows (names a call cut before its name).
        choice = msg.option_tool_choice() if self.tools else None
        self.forced_tool = (choice.name if isinstance(choice, m.NamedToolChoice)
                            else self.tools[0].name if choice == "required" and len(self.tools) == 1 else None)
        self.tool_stream = ToolCallStream(self.tools, self.call_id, self.forced_tool) if self.tools else None
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None  # when output tokens were last delivered
        self.finished_reason: str | None = None
        self.spec = SpecTally()
        # Requests that asked for logprobs: every kept token's entry, and where the stream is.
        self.logprobs: list[m.TokenLogprob] = []
        self.sent_logprobs = 0
        # Set by the worker when the job starts: its sampler, whether it must be exact at
        # temperature 0, and, for a row of the continuous batch, its state while parked.
        self.sampler = None
        self.exact = True
        # An exact request decoding serially only until the verify verdict is in
        # (decode_paths.py): its prefill still primes the head's history, for its snapshots.
        self.prefill_head = False
        self.batched = False
        self.parked_state = None
        # A solo speculative decode (it may move into the batch: ``handoff`` asks its
        # generator to hand its state over) and, for a batch row, its last cycle's depth.
        self.solo_spec = False
        self.handoff = False
        self.row_depth = 0
        # While its prompt is being prefilled (engine/prefill/prefill.py): the ChunkedPrefill, and
        # the speculation mode its decode will use.
        self.prefill = None
        self.mode = "off"
        # Prefix cache (engine/caches/prefix_cache.py): prompt tokens restored from a snapshot,
        # the prompt's segment ends (chat messages), and where its prefill takes snapshots.
        self.cached_tokens = 0
        self.segment_ends: list[int] = []
        self.snapshot_at: set[int] = set()
        # Whether the state it started from is a cold run's (an inexact hit taints what its
        # prefill stores); every token its decoder committed, and the decoder's cache and
        # head history, for the continuation kept when it finishes.
        self.exact_chain = True
        # The prefix cache's generation when this job looked it up (decode_paths.refresh_prefill).
        self.looked_at: int | None = None
        # Whether the prefill pacer may cut this prompt's chunks, and whether a cut keeps a cold
        # run's numbers (decode_paths._open_prefill).
        self.prefill_may_cut = False
        self.prefill_splits_exact = False
        self.prefill_forwards = 0  # forwards its prefill took (more than its chunks where paced)
        self.decoded: list[int] = []
        self.decode_cache = None
        self.decode_history = None

    # What the scheduler's prefill phase reads (scheduler.prefill_plan).
    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill; 0 once decoding (or before its prefill began)."""
        return 0 if self.prefill is None else max(0, self.prefill.total - self.prefill.pos)

    @property
    def prefill_chunk(self) -> int:
        return self.prefill.chunk if self.prefill is not None else 1

    # ------------------------------------------------------------------ output
    def start(self, generator, detokenizer, spec_mode: str, started_at: float | None = None) -> None:
        """``started_at``: when work on it began, if before this call (a batch row's
        prefill runs before its generator exists)."""
        self.generator = generator
        self.detok = detokenizer
        # Set already when its chunked prefill began; a batch row's prefill passes it here.
        self.started_at = started_at if started_at is not None else (self.started_at or time.monotonic())
        self.spec.mode = spec_mode

    def absorb(self, step: DecodeStep, eos_ids: frozenset[int], token_text=None, complete: bool = False) -> list[int]:
        """Take one decode cycle's tokens; return those that belong to the output (cut at
        eos or max_tokens), and set ``finished_reason`` when the request is complete.
        ``token_text(id)`` names tokens in logprob entries (given when the request asked).
        ``complete``: the request's grammar ended after these tokens (only EOS could follow),
        so it stops here without spending a forward on that EOS."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if step.depth or step.drafted:
            self.spec.add(step)
        self.spec.penalised += step.penalised
        kept: list[int] = []
        for tok in step.tokens:
            if tok in eos_ids:
                self.finished_reason = "stop"
                break
            kept.append(tok)
            if len(self.token_ids) + len(kept) >= self.msg.max_tokens:
                self.finished_reason = "length"
                break
        if complete and len(kept) == len(step.tokens):  # the output is whole: a stop, not a cut
            self.finished_reason = "stop"
        if token_text is not None and step.logprobs is not None:
            for tok, (lp, top) in zip(kept, step.logprobs):
                self.logprobs.append(m.TokenLogprob(
                    token_id=tok, token=token_text(tok), logprob=lp,
                    top_logprobs=[m.TopLogprob(token_id=t, token=token_text(t), logprob=v) for t, v in top]))
        self.detok.add(kept)
        self.token_ids.extend(kept)
        self.text = self.detok.text if self.finished_reason is None else self._final_text()
        self._apply_stop_strings()
        return kept

    def _final_text(self) -> str:
        self.detok.finalize()
        return self.detok.text

    def _apply_stop_strings(self) -> None:
        if not self.msg.stop:
            return
        hits = [i for i in (self.text.find(s) for s in self.msg.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finished_reason = "stop"

    def pending_text(self) -> str:
        """Text that is safe to send now: everything unless a stop string could still be
        forming at the end, in which case that tail is held back."""
        end = len(self.text)
        if self.finished_reason is None and self.msg.stop:
            hold = max(len(s) for s in self.msg.stop) - 1
            end = max(self.sent_chars, end - hold)
        return self.text[self.sent_chars : end]

    def call_id(self, index: int) -> str:
        """The id of the request's index-th tool call: the same in its chunk and in Done."""
        return f"call_{self.request_id[:48]}_{index}"

    def chunk(self, token_ids: list[int]) -> m.Tokens | None:
        text = self.pending_text()
        if self.reasoning is not None:
            return self._split_chunk(self.sent_chars + len(text), token_ids)
        if not text and not token_ids and self.finished_reason is None:
            return None
        self.sent_chars += len(text)
        lps = None
        if self.msg.option("logprobs"):
            lps = self.logprobs[self.sent_logprobs : self.sent_logprobs + len(token_ids)]
            self.sent_logprobs += len(lps)
        return self._tokens(text, "", token_ids, lps)

    def _tokens(self, answer: str, reasoning: str, token_ids: list[int], lps=None) -> m.Tokens | None:
        calls = None
        if self.tool_stream is not None:  # calls out of the answer; partial tags held back
            answer, calls = self.tool_stream.feed(answer, final=self.finished_reason is not None)
        if not answer and not reasoning and not token_ids and not calls:
            return None
        msg = m.Tokens(request_id=self.request_id, seq=self.seq, text=answer, token_ids=token_ids,
                       reasoning=reasoning, logprobs=lps, tool_calls=calls or None)
        self.seq += 1
        return msg

    def _split_chunk(self, upto: int, token_ids: list[int]) -> m.Tokens | None:
        if self.finished_reason is None:
            upto = max(self.sent_chars, self.reasoning.safe_end(self.text, upto))
        reasoning, answer = self.reasoning.split(self.text[:upto])
        new_r, new_a = reasoning[self.sent_reasoning:], answer[self.sent_answer:]
        if not new_r and not new_a and not token_ids and self.finished_reason is None:
            return None
        self.sent_chars, self.sent_reasoning, self.sent_answer = upto, len(reasoning), len(answer)
        return self._tokens(new_a, new_r, token_ids)

    def done(self, reason: str | None = None) -> m.Done:
        now = time.monotonic()
        started = self.started_at or now
        first = self.first_token_at or now
        decode_s = max(now - first, 1e-9)
        n = len(self.token_ids)
        reasoning, answer = ("", self.text) if self.reasoning is None else self.reasoning.split(self.text)
        calls: list[m.ToolCall] = []
        if self.tools:
            answer, calls = parse_tool_calls(answer, self.tools, self.call_id, self.forced_tool)
        finish = reason or self.finished_reason or "stop"
        if calls and finish == "stop":
            finish = "tool_calls"
        return m.Done(
            request_id=self.request_id,
            finish_reason=finish,
            text=answer,
            reasoning=reasoning,
            tool_calls=calls,
            usage=m.Usage(prompt_tokens=len(self.prompt), completion_tokens=n, cached_tokens=self.cached_tokens),
            timings=m.Timings(
                queue_s=started - self.received_at,
                prefill_s=first - started,
                decode_s=now - first,
                ttft_s=first - self.received_at,
                tokens_per_s=(n - 1) / decode_s if n > 1 else 0.0,
            ),
            speculation=self.spec.message() if self.spec.mode != "off" else None,
            logprobs=list(self.logprobs) if self.msg.option("logprobs") and not self.msg.stream else None,
        )
