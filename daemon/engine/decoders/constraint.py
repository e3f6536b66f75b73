"""Constrained decoding: a request's grammar (llguidance) as a per-request token mask.

``compile_constraint`` turns a request's constraint (JSON schema, any JSON object, regex,
Lark grammar) into a ``TokenConstraint`` or raises ``ConstraintError`` naming what cannot
be enforced; the daemon calls it on the intake thread, so a slow or bad grammar never
stalls the engine thread. The ``LLTokenizer`` is built once per model (``grammar_tokenizer``).

A ``TokenConstraint`` is a matcher plus the positions it has seen. Positions count output
tokens: position p is the state after p of them. Every path decodes with the same three
calls (the Sampler applies the mask in ``Sampler.process``, after the penalties and
logit_bias, before the distribution is built):

- ``rows(start, n)``: masks for positions floor+start .. floor+start+n-1, where floor is the
  number of committed tokens. A verify row r sees the committed output plus drafts[:start+r],
  as ``Sampler.process`` promises, so the mask at row r is the matcher's state after those
  drafts: the path must have ``advance``-d the drafts first (asking for a position the
  matcher has not reached raises: a path that forgot is an error, never unconstrained);
- ``advance(tokens)``: the matcher takes drafts (speculatively); a token its mask forbids
  raises ``ConstraintViolation`` (the matcher is never advanced over it);
  ``advance_allowed`` takes a proposal (a prompt-lookup block) up to its first forbidden
  token and says how many it took;
- ``settle(committed)``: these tokens follow the floor: drafts that differ from them are
  rolled back, the rest consumed, and the floor moves past them.

Each position's mask is computed once (when the matcher first stands there) and kept until
the floor passes it, so the verify rows reuse the masks the drafts were drawn under.
After the grammar ends (llguidance: stopped) the mask allows the EOS tokens only, so any
path ends the request with EOS; ``complete`` tells the worker it may end it at once.
Masks are as wide as the model's logits (``width``): columns past the tokenizer's vocabulary
(padded vocabularies) are forbidden.
"""

from __future__ import annotations

import json
import threading
import time

import llguidance
import mlx.core as mx
import numpy as np

KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON is compiled without free whitespace between tokens (``{"a":1,"b":[2]}``): a model
# may otherwise spend its token budget on blanks, and clients parse compact JSON alike.
# A schema's own "x-guidance" options override this.
JSON_DEFAULTS = {"whitespace_flexible": False}


class ConstraintError(ValueError):
    """The constraint cannot be enforced (bad or unsupported grammar); the message names why."""


class ConstraintViolation(RuntimeError):
    """A path tried to advance the matcher over a token its mask forbids (an engine bug)."""


_tokenizers: dict[int, llguidance.LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(lm) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, built once per model (about a second for
    a 250k vocabulary) and shared by every request."""
    key = id(lm)
    with _tokenizers_lock:
        tok = _tokenizers.get(key)
        if tok is None:
            eos = sorted(lm.eos_token_ids) or None
            hf = getattr(lm.tokenizer, "_tokenizer", lm.tokenizer)
            try:
                from llguidance.hf import from_tokenizer

                tok = from_tokenizer(hf, eos_token=eos)
            except (ValueError, ImportError):  # not a fast tokenizer: read its tokenizer.json
                path = lm.path / "tokenizer.json"
                if not path.exists():
                    raise ConstraintError(f"constrained decoding needs a fast tokenizer or {path.name}")
                tok = llguidance.LLTokenizer(path.read_text(), eos_token=eos)
            _tokenizers[key] = tok
        return tok


def grammar_text(kind: str, value: str) -> str:
    """llguidance's grammar for a request's constraint; ConstraintError on malformed input."""
    if kind == "json_object":
        kind, value = "json_schema", '{"type": "object"}'
    try:
        if kind == "json_schema":
            schema = json.loads(value)
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError("json_schema: the schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(value)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"json_schema: the schema is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise ConstraintError(f"{kind}: {exc}") from None
    raise ConstraintError(f"unknown constraint kind {kind!r} (known: {', '.join(KINDS)})")


def compile_constraint(lm, kind: str, value: str, width: int | None = None) -> TokenConstraint:
    """A fresh per-request constraint, its first mask computed (the grammar's lexer is built
    lazily, so the first mask is the slow one: it is paid here, off the engine thread)."""
    tok = grammar_tokenizer(lm)
    text = grammar_text(kind, value)
    matcher = llguidance.LLMatcher(tok, text, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"{kind}: {_first_line(matcher.get_error())}")
    eos = sorted(lm.eos_token_ids)
    c = TokenConstraint(matcher, width or lm.text_args.vocab_size, tok.vocab_size, eos, kind)
    c.mask_words(0)
    return c


def _first_line(error: str) -> str:
    # llguidance appends its parser state and the grammar to some errors; the reason is first.
    return error.split("\n<state>")[0].strip()


class TokenConstraint:
    """One request's matcher and the masks of the positions it stands at (module docstring)."""

    def __init__(self, matcher, width: int, vocab: int, eos_ids: list[int], kind: str = ""):
        self.matcher = matcher
        self.kind = kind
        self.width = width
        self.vocab = vocab
        self.eos_ids = eos_ids
        self.words_per_mask = (max(width, vocab) + 31) // 32
        self.floor = 0
        self.tokens: list[int] = []  # every token the matcher took: committed, then drafts
        self._consumed = 0  # of those, the ones the matcher consumed (none after the grammar's end)
        self._words: dict[int, np.ndarray] = {}  # position -> int32 bitmask words
        self._masks: dict[int, mx.array] = {}  # position -> bool [width]
        self._stopped: dict[int, bool] = {}
        # Set where a batched path could not raise it (batch.constrain_rows): the request fails.
        self.error: Exception | None = None
        # telemetry: masks computed and the host time they took (bench/constraint_bench.py)
        self.masks_computed = 0
        self.mask_s = 0.0

    # ------------------------------------------------------------------ state
    @property
    def position(self) -> int:
        return len(self.tokens)

    @property
    def complete(self) -> bool:
        """The grammar has ended after the committed tokens: only EOS may follow."""
        self.mask_words(self.floor)
        return self._stopped[self.floor]

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"{self.kind}: {_first_line(self.matcher.get_error())}")

    # ------------------------------------------------------------------ masks
    def mask_words(self, pos: int) -> np.ndarray:
        """The bitmask at ``pos`` (computed now if the matcher stands there)."""
        words = self._words.get(pos)
        if words is not None:
            return words
        if pos != self.position:
            raise ConstraintViolation(f"no mask for position {pos}: the matcher stands at {self.position} "
                                      "(advance the drafts before asking for their rows)")
        t0 = time.perf_counter()
        words = np.zeros(self.words_per_mask, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, (self.vocab + 31) // 32 * 4)  # drops the GIL
        self._check()
        stopped = self.matcher.is_stopped()
        if stopped:  # llguidance allows EOS after the end; make sure every EOS id is allowed
            u = words.view(np.uint32)
            for t in self.eos_ids:
                u[t >> 5] |= np.uint32(1 << (t & 31))
        if self.width < self.vocab:  # the logits are narrower than the vocabulary: nothing past them
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")
            bits[self.width :] = 0
            words = np.packbits(bits, bitorder="little").view(np.int32).copy()
        if not words.any():
            raise ConstraintError(f"{self.kind}: the grammar allows no next token after {self.position} tokens")
        self._words[pos] = words
        self._stopped[pos] = stopped
        self.masks_computed += 1
        self.mask_s += time.perf_counter() - t0
        return words

    def mask(self, pos: int) -> mx.array:
        m = self._masks.get(pos)
        if m is None:
            bits = np.unpackbits(self.mask_words(pos).view(np.uint8), bitorder="little")[: self.width]
            m = self._masks[pos] = mx.array(bits.astype(np.bool_))
        return m

    def rows(self, start: int, n: int) -> mx.array:
        """Masks [n, width] for positions floor+start .. floor+start+n-1."""
        base = self.floor + start
        if n == 1:
            return self.mask(base)[None]
        return mx.stack([self.mask(base + r) for r in range(n)])

    def apply(self, logits: mx.array, start: int = 0) -> mx.array:
        """-inf where the grammar forbids, row r at position floor+start+r."""
        if logits.shape[-1] != self.width:
            raise ConstraintViolation(f"logits are {logits.shape[-1]} wide, the constraint's masks {self.width}")
        rows = self.rows(start, logits.shape[-2])
        return mx.where(rows, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def allows(self, pos: int, token: int) -> bool:
        words = self.mask_words(pos)
        return 0 <= token < self.width and bool((int(words[token >> 5]) >> (token & 31)) & 1)

    # ------------------------------------------------------------------ moving
    def advance_allowed(self, tokens) -> int:
        """Take ``tokens`` up to the first one the grammar forbids; return how many were
        taken (a prompt-lookup block is cut there)."""
        n = 0
        for t in tokens:
            if not self.allows(self.position, int(t)):
                break
            self.advance([t])
            n += 1
        return n

    def advance(self, tokens) -> None:
        """Take ``tokens`` (drafts or committed ones), each checked against its mask."""
        for t in tokens:
            t = int(t)
            pos = self.position
            if not self.allows(pos, t):
                raise ConstraintViolation(f"token {t} is forbidden by the grammar at position {pos}")
            if not self._stopped[pos]:  # after the end only EOS follows; the matcher stays put
                if not self.matcher.consume_token(t):
                    self._check()
                    raise ConstraintViolation(f"the matcher refused token {t} at position {pos}")
                self._consumed += 1
            self.tokens.append(t)

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` tokens the matcher took (never below the floor)."""
        if n <= 0:
            return
        keep = self.position - n
        if keep < self.floor:
            raise ConstraintViolation(f"cannot roll back {n} tokens past the committed floor {self.floor}")
        real = self._consumed - min(self._consumed, keep)  # tokens after the end never reached it
        if real and not self.matcher.rollback(real):
            self._check()
            raise ConstraintViolation(f"the matcher could not roll back {real} tokens")
        self._consumed -= real
        for p in range(keep + 1, self.position + 1):
            self._forget(p)
        del self.tokens[keep:]

    def _forget(self, pos: int) -> None:
        self._words.pop(pos, None)
        self._masks.pop(pos, None)
        self._stopped.pop(pos, None)

    def settle(self, committed) -> None:
        """``committed`` follow the floor: keep the drafts that match them, roll back the
        rest, take the others; the floor moves past them."""
        committed = [int(t) for t in committed]
        spec = self.tokens[self.floor :]
        same = 0
        while same < min(len(spec), len(committed)) and spec[same] == committed[same]:
            same += 1
        self.rollback(len(spec) - same)
        self.advance(committed[same:])
        old = self.floor
        self.floor += len(committed)
        for p in range(old, self.floor):  # positions below the floor are never asked for again
            self._forget(p)
