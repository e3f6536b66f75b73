"""Native-MTP self-speculative decode, as a generator with serial_decode's contract.

State between cycles (P = the base cache's position, read from an attention layer):
- the base cache holds positions 0..P-1; ``primary`` is the last committed token, at
  position P, not yet forwarded (initially the prompt's last token);
- the head's KV cache holds committed slots; slot S is the pair (base hidden at S, real
  token S+1). Pairs not yet fed to the head wait in ``pending``; it always ends with
  (base hidden at P-1, primary), the input of the next first draft.

One cycle at depth k:
1. draft: one head forward over all pending pairs (they become committed slots; the last
   output drafts d1), then k-1 single steps feeding the head's own output hidden back with
   the token it just drafted (speculative slots);
2. verify: ONE base forward over [primary, d1..dk];
3. accept the longest prefix.
   temperature 0: d_{i+1} is accepted when it equals argmax at verify position i.
   temperature > 0: accept d with probability min(1, p(d)/q(d)); at the first reject sample
   from normalize(max(p - q, 0)); if all k are accepted, sample the bonus token from p at
   the last position (p, q: the request's sampler transforms of the base/head logprobs);
4. commit accepted + 1 tokens; roll the base cache back to the kept prefix (rollback.py);
   trim the head's speculative slots (back to the cycle start + 1) and queue the committed
   pairs (verify hidden at P+i, committed token P+i+1) for the next draft.

exact (temperature 0 only): where a verify position's top-2 logprob margin is within the
guard, that position is decided with serial numerics: keep the verify prefix before it,
run it as a one-token (M=1) forward like serial_decode, and commit what that says. So
every committed token was decided either with a top-2 margin wider than the guard or by
the serial computation itself. Where the verify is bit-identical to serial steps (CPU)
that is exact by construction. Where it is not (MLX on CUDA: other kernels for 2-5 rows),
the guard bounds flips but cannot exclude them: the committed cache was written by the
verify, so even the serial re-decision runs on slightly different state, and an exact tie
can fall either way (H200, bundled model: 1 prompt in 10, 1.6-1.7 flips per 1000 tokens).
``exactness.verify_matches_serial`` tells the two apart at start-up and the daemon then
serves exact greedy requests serially (``speculation.exact_on_inexact_backend``);
``councild gate fidelity`` measures the deviation and the flips. fast: takes the verify's
argmax everywhere.

Depth 0 (or no head, or nothing to pair with yet) is a serial step identical to
serial_decode's; its pair is queued so the head's history stays whole and depth can rise
again.

Constrained decoding (constraint.py, through the Sampler): every head draft is drawn under
the grammar's mask at its position (the host reads each draft and the matcher takes it), a
prompt-lookup block is cut at its first forbidden token, and verify row i is masked with the
matcher's state after the committed tokens and d1..di; the decision settles the matcher on
what was committed (rejected drafts rolled back). Serial and verify see the same mask at
every position, so exact stays token-identical to constrained serial decode and rejection
sampling still samples the constrained base distribution.

Other drafts and limits, per request (lookup.py, loop_guard.py):
- prompt lookup: when the committed tail recurs in prompt + output, the next cycle verifies
  that earlier continuation instead of head drafts (at any depth, 0 included, and with no
  head). Its q is a point mass, so at temperature > 0 the rule above becomes: accept x
  with probability p(x), on reject sample p without x. Misses put it to sleep (back-off).
- per-request depth: depth() is a ceiling; past the first position the head drafts the
  next only while its prefix confidence times the request's running acceptance pays.
- loop guard (sampled requests only): once the output loops, cycles are serial steps under
  a DRY penalty, each token known before the next step is built.

Overlap: as serial_decode queues its next step before handing out a token, a cycle here
queues the next cycle's first draft (head feed + d1) before yielding, and a depth-0 cycle
queues the next serial step (undone through a snapshot if depth rises). Neither is queued
when the next cycle will verify a lookup block or run under the loop guard.

Pipeline (a cycle costs what its forwards cost): a cycle's acceptance is decided on the
device down to one small int array, read once per cycle (the only host sync; a guarded
cycle adds one). While the device runs a head-drafted cycle, the host builds the next one
as if this one accepts everything: the committed block, the head's pairs and the bonus
token are all known lazily then, so the next drafts and verify are built without waiting.
When the host then reads a full accept, that prebuilt cycle is issued at once (the device
never waits for Python to build a graph); otherwise it is undone before it ever ran
(``rollback.CacheMark``: cache slots, the head's history and the sampler's key and counts
back as they were) and the cycle is committed as before. Either way the same tokens are
committed. The next cycle's depth is read when it is built (the cycle boundary before
the current one is decided), so a depth change lands one cycle later. Not built ahead:
after a lookup block, when the loop guard is armed, when the draft stopper would read a
draft's confidence (depth above its base), while fewer than PIPELINE_MIN_FULL of cycles
accept everything, or while the shortest of the request's recent steady cycles is shorter
than PIPELINE_MIN_CYCLE_S (the host is the bottleneck then, and a build thrown away is pure
loss; PIPELINE_WINDOW). ``pipeline=None`` (the default)
builds ahead on CUDA only (``resolve_pipeline``).

The tokens of one DecodeStep may run past an EOS; the caller cuts at the first one. In a
guarded cycle, draft positions from the guarded one on are reported not accepted (they
were not judged); ``guarded`` says so.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from ..caches.head_history import HeadHistory
from ..model.model import LoadedModel
from ..prefill.prefill import PREFILL_CHUNK
from ..types import DEFAULT_GUARD, DecodeStep
from .lookup import DraftStop, DraftStopConfig, LookupConfig, PromptLookup
from .loop_guard import LoopGuard, LoopGuardConfig
from .rollback import CacheMark, Snapshot, check_cache, make_rollback
from .sampling import Sampler, logprob_entries, logprobs as _logprobs, near_tie
# Rollback strategy. "auto" picks capture wherever mlx-lm itself runs GatedDeltaNet through
# its ops path (CPU, CUDA): there capturing the per-token states adds no kernels, and it won
# every CPU measurement (`councild bench spec`, bench/results/spec_summary.md: by 38% when
# every draft is rejected, 3-15% at 0.76-0.92 acceptance). On Metal, mlx-lm uses a fused GDN
# kernel that capture would replace by the ops path (other kernels, other rounding), so auto
# picks snapshot there until `councild bench spec` on that machine says otherwise.
DEFAULT_ROLLBACK = "auto"


def resolve_rollback(strategy: str) -> str:
    if strategy != "auto":
        return strategy
    on_metal = mx.default_device() == mx.gpu and mx.metal.is_available()
    return "snapshot" if on_metal else "capture"
# Queued head pairs are fed to the head once this many accumulate at depth 0.
FLUSH_PENDING = 64
# Building the next cycle ahead (on the guess that this one accepts all its drafts) costs
# host time that is wasted when the guess is wrong: build ahead while at least this share
# of cycles accept everything (a running mean with this weight).
# Measured on the H200 (bench/results/README.md, the pipelined cycle): where fewer cycles
# accept everything the builds thrown away cost more than the overlap wins.
PIPELINE_MIN_FULL = 0.6
FULL_RATE_ALPHA = 0.1
# Building ahead hides the host's build behind the device's work; where a cycle is this
# short the host is the bottleneck (launching kernels is host work too) and there is no
# device time to hide it behind: the bundled model on the H200 (3.6-6 ms cycles) lost
# 5-20% with it, the 27B shape (40-120 ms cycles) gained up to 20% at 4-bit.
PIPELINE_MIN_CYCLE_S = 0.010
# A request's cycle time, against that floor, is the shortest of its last PIPELINE_WINDOW
# steady head cycles: a cycle is never cheaper than its work, while first uses (a new cache
# length's shapes, a kernel's first launch) only lengthen cycles. A running mean let such
# cycles open the speculating batch's build-ahead in a fresh council's first round on an H100,
# every cycle built then undone (bench/results/h100_2026-12-07c, calls 6-8); a request decides
# from its first steady cycle (a short answer keeps its pipelining) and a faster one closes it.
PIPELINE_WINDOW = 16


def resolve_pipeline(pipeline: bool | None) -> bool:
    """None ("auto"): build ahead on CUDA, where it was measured (27B shape 4-bit on the
    H200: 1.13-1.20x at depths 1, 2 and 4). Not on the CPU, where the host and the device
    share the cores (`councild bench spec --pipeline ab`: 0.96-0.97x), and not on Metal
    until it is measured there (``speculation.build_ahead = true`` turns it on)."""
    if pipeline is not None:
        return pipeline
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


@dataclass
class _Cycle:
    """One cycle's graph, built: its verify and what the host reads to decide acceptance."""

    k: int
    source: str
    stopped_early: bool
    committed_slots: int  # the head's committed slots; drafts 2..k are speculative ones
    verify_in: mx.array  # [1, k+1]
    d_all: mx.array  # [k] drafts
    hid: mx.array  # [1, k+1, H] verify hiddens
    lp: mx.array  # [k+1, V] processed log-probabilities
    picks: mx.array | None = None  # [k+1]: argmax (greedy) or the sample (sampled) per position
    bonus: mx.array | None = None  # [1]: picks[k], the token after a full accept
    host: mx.array | None = None  # int32: picks, drafts, then guard flags or accept coins

    def step(self, a: int, committed: list[int], guarded: int, cycle_s: float, logprobs,
             transition: bool) -> DecodeStep:
        return DecodeStep(tokens=committed, depth=self.k, drafted=self.k, accepted=a,
                          accepted_mask=[True] * a + [False] * (self.k - a), guarded=guarded,
                          cycle_s=cycle_s, logprobs=logprobs, draft_source=self.source,
                          stopped_early=self.stopped_early, transition=transition)


def draft_token(sampler: Sampler, head_logits: mx.array, before: list[mx.array]) -> tuple[mx.array, mx.array | None, mx.array]:
    """One draft from the head's logits [1, V]: (draft token [1], its log q or None when
    greedy, the head's top-1 probability). The request's processors see the drafts before
    this one, as serial decode would."""
    extra = mx.concatenate(before) if before else None
    lp = _logprobs(sampler.process(head_logits, extra, len(before)))  # [1, V]
    if sampler.greedy:
        return mx.argmax(lp, axis=-1).reshape(-1).astype(mx.uint32), None, mx.exp(lp.max())
    ql = sampler.log_distribution(lp)
    d = mx.random.categorical(ql, key=sampler.next_key())
    return d.reshape(-1).astype(mx.uint32), ql, mx.exp(ql.max())


def rejection_sample(sampler: Sampler, lp: mx.array, d_all: mx.array, logq: list | None) -> tuple[mx.array, mx.array]:
    """Rejection sampling (Leviathan et al. / Chen et al.), on the device: output ~ p exactly.
    ``lp`` [k+1, V]: the verify's processed logprobs; ``d_all`` [k]: the drafts; ``logq``:
    each draft's log q [1, V], or None for a deterministic proposal (a lookup block: q is a
    point mass, so accept with probability p(x); the residual is p without x, renormalised).
    Returns (picks [k+1]: the residual sample at every position, the bonus from p at k;
    accept [k] bool: u < min(1, p/q)). Draws two keys from the sampler, in that order."""
    k = d_all.size
    logp = sampler.log_distribution(lp).astype(mx.float32)  # [k+1, V]
    if logq is None:
        vocab = mx.arange(logp.shape[-1])[None, :]
        logq_a = mx.where(vocab == d_all[:, None], 0.0, -mx.inf).astype(mx.float32)  # [k, V]
    else:
        logq_a = mx.concatenate(logq, axis=0).astype(mx.float32)  # [k, V]
    idx = d_all[:, None].astype(mx.int32)
    p_d = mx.exp(mx.take_along_axis(logp[:k], idx, axis=-1))[:, 0]
    q_d = mx.exp(mx.take_along_axis(logq_a, idx, axis=-1))[:, 0]
    u = mx.random.uniform(shape=(k,), key=sampler.next_key())
    accept = u * q_d < p_d  # u < min(1, p/q)
    resid = mx.maximum(mx.exp(logp[:k]) - mx.exp(logq_a), 0.0)
    has_mass = resid.sum(axis=-1, keepdims=True) > 0
    log_resid = mx.where(has_mass, mx.log(resid), logp[:k])
    fallback = mx.concatenate([log_resid, logp[k:]], axis=0)  # row k: bonus from p
    return mx.random.categorical(fallback, key=sampler.next_key()), accept  # [k+1], [k]


def greedy_accepted(picks: list[int], drafts: list[int], guards: list | None = None) -> int:
    """Temperature 0: drafts accepted while each equals the base model's argmax at its
    position, stopping at a guarded (near-tie) position."""
    k = len(drafts)
    guards = guards or [0] * (k + 1)
    a = 0
    while not guards[a] and a < k and picks[a] == drafts[a]:
        a += 1
    return a


def sampled_accepted(coins: list) -> int:
    """Temperature > 0: drafts accepted while their coins say so."""
    a = 0
    while a < len(coins) and coins[a]:
        a += 1
    return a


def prefill_with_hidden(lm: LoadedModel, prompt: list[int], cache: list, history: HeadHistory, chunk: int = PREFILL_CHUNK) -> mx.array:
    """prefill.prefill's chunks, op for op (so the caches match serial decode's), plus the
    head's priming: pair each chunk's base hiddens with the next prompt tokens and feed all
    but the very last pair (it drafts the first cycle). Returns the last prompt token."""
    ids = mx.array(prompt, dtype=mx.uint32)
    while ids.size > 1:
        n = min(chunk, ids.size - 1)
        h = lm.prefill_hidden(ids[None, :n], cache)
        history.add(h, ids[1 : n + 1])
        history.feed(keep_last=True)
        mx.eval([h] + [c.state for c in cache] + history.state())
        ids = ids[n:]
    return ids


def speculative_decode(
    lm: LoadedModel,
    head,
    prompt: list[int],
    sampler: Sampler,
    depth: Callable[[], int] | int,
    exact: bool = True,
    guard_margin: float | None = DEFAULT_GUARD,
    cache: list | None = None,
    rollback: str = DEFAULT_ROLLBACK,
    logit_jitter: float = 0.0,
    history: HeadHistory | None = None,
    lookup: LookupConfig | None = None,
    draft_stop: DraftStopConfig | None = None,
    loop_guard: LoopGuardConfig | None = None,
    context: list[int] | None = None,
    pipeline: bool | None = None,
    handoff: Callable[[], bool] | None = None,
) -> Iterator[DecodeStep]:
    """Yield one DecodeStep per cycle, forever (the caller stops it).

    depth() is read at the start of every cycle: the governor's ceiling. ``rollback`` is
    "capture", "snapshot" or "auto" (see DEFAULT_ROLLBACK). ``guard_margin`` None: exact
    mode without the near-tie guard, for where a verify is bit-identical to serial steps
    (exactness.exact_guard).
    ``lookup``: propose prompt-lookup blocks (lookup.py) beside the head's drafts.
    ``draft_stop``: stop a cycle's head drafting early below the ceiling (lookup.DraftStop).
    ``loop_guard``: for sampled requests only (ignored at temperature 0), detect a loop and
    decode serially under a DRY penalty while it lasts (loop_guard.py).
    ``logit_jitter`` is a test hook: uniform noise of that amplitude on the verify's
    logprobs (never on serial steps), standing in for batch-height-dependent kernels.
    ``history``: pass a fresh ``HeadHistory(head)`` to inspect the head's state afterwards.
    ``context``: the whole prompt, when ``prompt`` is only its tail and ``cache`` holds the
    rest (a chunked prefill or a prefix-cache hit ran it); prompt lookup and the loop guard
    match against it.
    ``pipeline``: build each head-drafted cycle's successor while the device runs it (see
    the module docstring); False builds every cycle after the previous one is decided;
    None: ``resolve_pipeline`` (on a GPU only). All commit the same tokens.
    ``handoff``: asked at every cycle boundary (no cycle built ahead); when it says True
    the generator ends, returning its state for the continuous batch (batch_spec.py):
    (cache holding every position before ``primary``, primary, the head history). Work
    issued ahead is undone first (a serial step's cache slots); a first draft issued ahead
    only fed committed pairs to the head, which stay.
    """
    if not prompt:
        raise ValueError("speculative_decode needs at least one prompt token")
    depth_fn = depth if callable(depth) else (lambda d=int(depth): d)
    cache = cache if cache is not None else lm.make_cache()
    if head is not None or lookup is not None:
        check_cache(cache)
    rb = make_rollback(resolve_rollback(rollback), lm, cache)
    hist = history if history is not None else HeadHistory(head)
    greedy = sampler.greedy
    pipeline = resolve_pipeline(pipeline)
    # Constrained decoding (constraint.py): each draft is drawn under the grammar's mask at its
    # position, so the host reads every draft before the next (one small sync per draft) and
    # the matcher takes it; the verify rows reuse those masks. A cycle cannot be built ahead:
    # its masks depend on the bonus token, read only when this cycle is decided.
    con = sampler.constraint
    if con is not None:
        pipeline = False
    jitter_key = mx.random.key(0x5EED)
    whole = list(context) if context is not None else list(prompt)
    finder = PromptLookup(whole, lookup) if lookup is not None else None
    stopper = DraftStop(draft_stop) if draft_stop is not None else None
    loops = LoopGuard(whole, loop_guard) if loop_guard is not None and not greedy else None

    primary = prefill_with_hidden(lm, prompt, cache, hist)  # [1]
    n_cycles = 0

    def serial_step(token: mx.array, extra: mx.array | None = None, start: int = 0,
                    penalty: dict[int, float] | None = None) -> tuple:
        """serial_decode's step, op for op (plus the loop guard's penalty, when armed).
        Returns (next token [1], hidden [1, 1, H], its logprob arrays or None).
        ``extra[:start]``: drafts ahead of it not yet committed."""
        h = lm.hidden(token.reshape(1, 1), cache)
        lp = _logprobs(sampler.process(lm.logits(h)[:, -1, :], extra, start))
        if penalty:
            lp = lp.astype(mx.float32).at[:, mx.array(list(penalty), dtype=mx.int32)].add(
                -mx.array(list(penalty.values()), dtype=mx.float32))
        nxt = sampler(lp).reshape(-1).astype(mx.uint32)
        return nxt, h, sampler.logprob_arrays(lp, nxt)

    # A serial step issued ahead at the end of a depth-0 cycle (as serial_decode does, so
    # Python's per-step work overlaps the device's): (next token, hidden, snapshot before it).
    ahead: tuple | None = None
    # The first draft issued ahead at the end of a cycle at depth > 0 (the committed pairs
    # fed to the head, d1 drafted): (committed head slots, head output, d1, log q1, conf1).
    draft_ahead: tuple | None = None
    # The lookup block planned for the next cycle (decided when the last one committed, so
    # no head draft or serial step is issued ahead for a cycle that will not use it).
    plan: list[int] = finder.propose() if finder is not None else []

    def first_draft() -> tuple:
        committed_slots = hist.offset + hist.n  # after the feed; drafts 2..k are speculative
        g = hist.feed(keep_last=False)
        return (committed_slots, g) + draft_from(g, [])

    def draft_from(g: mx.array, before: list[mx.array]) -> tuple[mx.array, mx.array | None, mx.array]:
        return draft_token(sampler, head.logits(g)[:, -1, :], before)

    def plan_next(committed: list[int]) -> list[int]:
        if loops is not None:
            loops.extend(committed)
        if finder is None:
            return []
        finder.extend(committed)
        return [] if loops is not None and loops.armed else finder.propose()

    def head_drafts(k: int, first: tuple) -> tuple:
        """d1 (``first``: first_draft()'s tuple), then d2..dk from the head's own outputs.
        The stopper may end the chain early; it reads each draft's confidence (a sync)."""
        committed_slots, g, d, ql, conf = first
        drafts, logq = [d], [ql]
        prefix_conf, stopped_early = 1.0, False
        for i in range(1, k):
            if stopper is not None and i >= stopper.cfg.base:
                prefix_conf *= conf.item()
                if not stopper.more(i, prefix_conf):
                    stopped_early = True
                    break
            g = head(g, drafts[-1][None], hist.cache)
            if con is not None:
                # The head's next step runs while the matcher takes the last draft and
                # computes the mask the next draft is drawn under.
                mx.async_eval(g)
                con.advance([drafts[-1].item()])
            d, ql, conf = draft_from(g, drafts)
            drafts.append(d)
            logq.append(ql)
        return committed_slots, drafts, logq, stopped_early

    def build_verify(first_token: mx.array, drafts: list[mx.array], logq: list, source: str,
                     committed_slots: int, stopped_early: bool) -> _Cycle:
        """Steps 2 and 3 as a graph: verify [first_token, d1..dk] in one base forward and
        decide acceptance on the device, down to one small int array the host reads."""
        nonlocal jitter_key
        k = len(drafts)
        verify_in = mx.concatenate([first_token] + drafts)[None]  # [1, k+1]
        hid = rb.forward(verify_in)
        if con is not None and source == "head":
            # The verify forward runs while the matcher takes the last head draft (the
            # others it took while drafting; a lookup block it took whole) for row k's mask.
            mx.async_eval(hid)
            con.advance([drafts[-1].item()])
        d_all = mx.concatenate(drafts)
        logits = sampler.process(lm.logits(hid)[0], d_all)  # [k+1, V]; row i sees d1..di
        lp = _logprobs(logits)
        if logit_jitter > 0.0:
            jitter_key, sub = mx.random.split(jitter_key)
            lp = lp.astype(mx.float32) + mx.random.uniform(-logit_jitter, logit_jitter, lp.shape, key=sub)
        cyc = _Cycle(k, source, stopped_early, committed_slots, verify_in, d_all, hid, lp)
        if greedy:
            cyc.picks = mx.argmax(lp, axis=-1)  # the base model's token at every position
            host = [cyc.picks, d_all]
            if exact and guard_margin is not None:
                host.append(near_tie(lp, logits, guard_margin))
        else:
            cyc.picks, accept = rejection_sample(sampler, lp, d_all, None if source == "lookup" else logq)
            host = [cyc.picks, d_all, accept]
        cyc.bonus = cyc.picks[k:].astype(mx.uint32)  # the token after a full accept
        cyc.host = mx.concatenate([x.reshape(-1).astype(mx.int32) for x in host])
        return cyc

    def decide(cyc: _Cycle) -> tuple[int, bool, list[int], list[int]]:
        """The cycle's one host sync: (accepted a, guard stop at position a, the base model's
        picks by position, the drafts). Greedy: accept while the draft equals the argmax,
        stopping at a guarded position; sampled: accept while the coin says so."""
        k = cyc.k
        vals = cyc.host.tolist()
        picks, d_l, flags = vals[: k + 1], vals[k + 1 : 2 * k + 1], vals[2 * k + 1 :]
        if greedy:
            a = greedy_accepted(picks, d_l, flags)
            return a, bool(flags and flags[a]), picks, d_l
        return sampled_accepted(flags), False, picks, d_l

    def optimistic_next(cyc: _Cycle) -> tuple | None:
        """Build, without running it, the cycle that follows ``cyc`` if ``cyc`` accepts all
        its drafts: commit the full block lazily, draft, build the verify. The caller runs
        it when the host reads a full accept, else undoes it (``undo``). Returns (cycle,
        mark, rollback record) or None where no such cycle is built."""
        if not pipeline or cyc.source != "head" or full_rate < PIPELINE_MIN_FULL:
            return None
        if not steady_s or min(steady_s) < PIPELINE_MIN_CYCLE_S:
            return None
        if head is None or getattr(head, "unloaded", False) or (loops is not None and loops.armed):
            return None
        k2 = max(0, int(depth_fn()))  # the next cycle's depth, read at this cycle boundary
        if k2 == 0 or (stopper is not None and k2 > stopper.cfg.base):
            return None  # nothing to draft, or the stopper would read a draft's confidence
        mark = (CacheMark(cache + hist.cache), (list(hist.h), list(hist.t), hist.n),
                (sampler._key, sampler._counts, list(sampler._pending)))
        record = rb.detach()
        full = mx.concatenate([cyc.d_all, cyc.bonus])
        sampler.commit(full)
        hist.trim(hist.offset - cyc.committed_slots)
        hist.add(cyc.hid, full)
        committed_slots, drafts, logq, stopped = head_drafts(k2, first_draft())
        return build_verify(cyc.bonus, drafts, logq, "head", committed_slots, stopped), mark, record

    def undo(spec: tuple) -> None:
        _, (cache_mark, (h, t, n), (key, counts, pend)), record = spec
        cache_mark.restore()
        hist.h, hist.t, hist.n = h, t, n
        sampler._key, sampler._counts, sampler._pending = key, counts, pend
        rb.attach(record)

    # A cycle built and running ahead (its predecessor accepted everything), and the share
    # of cycles that accept everything (when it is low, building ahead wastes host time).
    pending: _Cycle | None = None
    full_rate = 1.0
    steady_s: deque = deque(maxlen=PIPELINE_WINDOW)  # the last steady head cycles' wall times
    prev_k: int | None = None  # the last cycle's depth: a cycle at another one is a transition

    def head_cycle_done(cycle_s: float, transition: bool) -> None:
        # A transition cycle (the first at its depth: a catch-up feed, first-use costs on a
        # GPU) is not the depth's cost (PIPELINE_WINDOW).
        if not transition:
            steady_s.append(cycle_s)

    while True:
        if handoff is not None and pending is None and handoff():
            if ahead is not None:
                ahead[3].restore()
            mx.eval([c.state for c in cache] + hist.state())
            return cache, int(primary.reshape(-1)[0].item()), hist
        t0 = time.perf_counter()
        n_cycles += 1
        if n_cycles % 256 == 0:
            mx.clear_cache()
        if pending is not None:
            cyc, pending = pending, None
            k = cyc.k
        else:
            k = max(0, int(depth_fn()))
            head_ok = head is not None and not getattr(head, "unloaded", False)
            if not head_ok or (hist.n == 0 and draft_ahead is None):
                k = 0
            block, plan = plan, []
            armed = loops is not None and loops.armed
            if armed:  # in a loop: serial steps under the penalty, nothing drafted
                k, block = 0, []
            if block and con is not None:  # the block up to its first token the grammar forbids
                block = block[: con.advance_allowed(block)]

            if k == 0 and not block:
                draft_ahead = None  # its pairs are in the head's history; d1 is not needed
                if ahead is not None:
                    nxt, h, lps, _ = ahead
                else:
                    nxt, h, lps = serial_step(primary, penalty=loops.penalty() if armed else None)
                sampler.commit(nxt)
                if con is not None:  # the next step's mask follows this token
                    con.settle([nxt.item()])
                if head_ok:  # without a head there is no history to keep (and nothing to grow)
                    hist.add(h, nxt)
                    if hist.n >= FLUSH_PENDING:
                        hist.feed(keep_last=True)
                if finder is not None or loops is not None:  # the next cycle may verify a block,
                    mx.eval(nxt)  # or need a penalty that depends on this token
                    plan = plan_next([nxt.item()])
                # Issue the next serial step now; a cycle at depth > 0 discards it (restore).
                if head_ok and not plan and not (loops is not None and loops.armed):
                    snap = Snapshot.take(cache)
                    nxt2, h2, lps2 = serial_step(nxt)
                    mx.async_eval(nxt2, h2, hist.state())
                    ahead = (nxt2, h2, lps2, snap)
                else:
                    mx.eval(nxt, h, hist.state())
                    ahead = None
                primary = nxt
                transition, prev_k = prev_k != 0, 0
                yield DecodeStep(tokens=[nxt.item()], depth=0, cycle_s=time.perf_counter() - t0,
                                 logprobs=logprob_entries(lps), penalised=armed, transition=transition)
                continue
            if ahead is not None:  # depth rose: undo the step issued ahead
                ahead[3].restore()
                ahead = None

            # 1. draft: the lookup block, or d1..dk from the head (d1 usually issued ahead).
            if block:
                # A head draft issued ahead has fed the committed pairs (they stay); its d1 is
                # not used. Nothing speculative sits in the head's cache.
                draft_ahead = None
                drafts = [mx.array([t], dtype=mx.uint32) for t in block]
                cyc = build_verify(primary, drafts, [] if greedy else [None] * len(block), "lookup", hist.offset, False)
            else:
                first, draft_ahead = draft_ahead if draft_ahead is not None else first_draft(), None
                committed_slots, drafts, logq, stopped = head_drafts(k, first)
                # 2.-3. verify in one base forward, acceptance on the device
                cyc = build_verify(primary, drafts, logq, "head", committed_slots, stopped)
            k = cyc.k
        transition, prev_k = prev_k != k, k

        # Run this cycle; while the device works, build the next as if this one accepts all.
        spec = None
        if pipeline and cyc.source == "head":
            mx.async_eval(cyc.host)
            spec = optimistic_next(cyc)
        a, stop_guard, picks, d_l = decide(cyc)
        full = a == k and not stop_guard
        full_rate += FULL_RATE_ALPHA * (float(full) - full_rate)
        guarded = int(stop_guard)
        judged = a if guarded else k  # positions past a guarded one were not judged
        if cyc.source == "lookup":
            finder.record(judged, a)
        elif stopper is not None:
            stopper.record(judged, a)

        if spec is not None and full:
            committed = d_l + [picks[k]]
            plan = plan_next(committed)
            if not plan and not (loops is not None and loops.armed):
                # 4. already done lazily by optimistic_next; run the next cycle now.
                pending, spec = spec[0], None  # the mark goes: the next verify writes in place
                logprobs = None
                if sampler.wants_logprobs:
                    logprobs = logprob_entries(sampler.logprob_arrays(cyc.lp, mx.array(committed, dtype=mx.uint32)))
                mx.async_eval([pending.host] + [c.state for c in cache] + hist.state())
                primary = cyc.bonus
                dt = time.perf_counter() - t0
                head_cycle_done(dt, transition)
                yield cyc.step(a, committed, 0, dt, logprobs, transition)
                continue
            undo(spec)  # a lookup block or the loop guard takes the next cycle
        else:
            if spec is not None:
                undo(spec)
            committed = None
        spec = None

        logprobs = None
        if stop_guard:
            # Keep the verify's first `a` tokens; decide position a with serial numerics.
            rb.commit(a)
            nxt, h_last, lps_last = serial_step(cyc.verify_in[:, a], cyc.d_all, a)
            hidden_pairs = mx.concatenate([cyc.hid[:, :a], h_last], axis=1) if a else h_last
            committed_arr = mx.concatenate([cyc.d_all[:a], nxt]) if a else nxt
            committed = committed_arr.tolist()  # a second sync, in a guarded cycle only
            if sampler.wants_logprobs:
                head_rows = logprob_entries(sampler.logprob_arrays(cyc.lp[:a], cyc.d_all[:a])) if a else []
                logprobs = head_rows + logprob_entries(lps_last)
            plan = plan_next(committed)
        else:
            rb.commit(a + 1)
            hidden_pairs = cyc.hid[:, : a + 1]
            nxt = cyc.picks[a : a + 1].astype(mx.uint32)
            if committed is None:
                committed = d_l[:a] + [picks[a]]
                plan = plan_next(committed)
            if sampler.wants_logprobs:
                logprobs = logprob_entries(sampler.logprob_arrays(cyc.lp[: a + 1], mx.array(committed, dtype=mx.uint32)))

        # 4. head history: drop speculative slots, queue the committed pairs.
        committed_ids = mx.array(committed, dtype=mx.uint32)
        if con is not None:  # the matcher keeps the accepted drafts, rolls back the rest
            con.settle(committed)
        sampler.commit(committed_ids)  # before the next first draft, which must see them
        head_ok = head is not None and not getattr(head, "unloaded", False)
        if head_ok:
            hist.trim(hist.offset - cyc.committed_slots)
            hist.add(hidden_pairs, committed_ids)
            if cyc.source == "lookup" and hist.n >= FLUSH_PENDING:
                hist.feed(keep_last=True)
        primary = nxt
        go_on = not plan and not (loops is not None and loops.armed)
        draft_ahead = first_draft() if head_ok and k > 0 and go_on and depth_fn() > 0 else None
        mx.async_eval([primary, hidden_pairs] + [c.state for c in cache] + hist.state()
                      + ([draft_ahead[2]] if draft_ahead else []))
        dt = time.perf_counter() - t0
        if cyc.source == "head":
            head_cycle_done(dt, transition)
        yield cyc.step(a, committed, guarded, dt, logprobs, transition)
