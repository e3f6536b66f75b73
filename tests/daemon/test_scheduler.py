"""The scheduler's policy on a fake clock: classes, weighted fairness, starvation, parking."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from daemon.config import SchedulerConfig
from daemon.engine_thread.scheduler import Scheduler
import pytest
from scheduler_helpers import FakeJob

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(max_active=4, bound=30.0):
    clock = Clock()
    return Scheduler(SchedulerConfig(max_active=max_active, starvation_bound_s=bound), clock=clock), clock


def run(s: Scheduler, steps: int, tokens_per_step: int = 1) -> dict[str, int]:
    served: dict[str, int] = {}
    for _ in range(steps):
        s.admit()
        job = s.pick()
        if job is None:
            break
        s.charge(job, tokens_per_step)
        served[job.seat] = served.get(job.seat, 0) + tokens_per_step
    return served


def test_weighted_fairness_under_saturation():
    s, _ = make()
    for i in range(2):
        s.submit(FakeJob("heavy", weight=3.0, name=f"h{i}"))
        s.submit(FakeJob("light", weight=1.0, name=f"l{i}"))
    served = run(s, 4000)
    assert abs(served["heavy"] / served["light"] - 3.0) < 0.05


def test_interactive_goes_first_and_parks_background():
    s, clock = make(max_active=2)
    bg = [FakeJob("batch", "background", name=f"b{i}") for i in range(10)]
    for j in bg:
        s.submit(j)
    run(s, 5)
    assert len(s.active) == 2
    clock.t = 1.0
    urgent = FakeJob("chat", "interactive", enqueued_at=1.0, name="urgent")
    s.submit(urgent)
    admitted = s.admit()
    assert urgent in admitted and urgent in s.active
    assert len(s.parked) == 1 and s.parked[0] in bg  # kept, not dropped: it resumes later
    assert s.pick() is urgent
    s.remove(urgent)
    s.admit()
    assert len(s.active) == 2 and not s.parked  # the parked job came back first


def test_background_never_starves():
    s, clock = make(max_active=1, bound=30.0)
    starving = FakeJob("batch", "background", enqueued_at=0.0, name="bg")
    s.submit(starving)
    # A stream of interactive work that would otherwise always win.
    t = 0.0
    picked_at = None
    while t < 200.0:
        clock.t = t
        s.submit(FakeJob("chat", "interactive", enqueued_at=t))
        s.admit()
        job = s.pick()
        s.charge(job, 1)
        if job is starving:
            picked_at = t
            break
        s.remove(job)
        t += 1.0
    # Background rises one class per bound waited: interactive rank after 2 bounds.
    assert picked_at is not None and picked_at <= 2 * 30.0 + 1.0


def test_idle_seat_earns_no_credit():
    s, _ = make()
    s.submit(FakeJob("a", name="a1"))
    run(s, 1000)
    s.remove(s.active[0])
    s.submit(FakeJob("a", name="a2"))
    s.submit(FakeJob("b", name="b1"))  # b was idle the whole time
    served = run(s, 200)
    # b joined at a's virtual time, so they share evenly rather than b taking 1000 turns.
    assert abs(served["a"] - served["b"]) <= 2


def test_remove_from_anywhere_and_positions():
    s, _ = make(max_active=1)
    jobs = [FakeJob("a", name=str(i)) for i in range(3)]
    for j in jobs:
        s.submit(j)
    s.admit()
    assert s.position(jobs[2]) == 1
    assert s.remove(jobs[1]) and not s.remove(jobs[1])
    assert s.queued_count("a") == 1 and s.queued_count() == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["s1", "s2", "s3"]), st.sampled_from(["interactive", "normal", "background"]),
                          st.integers(0, 5)), min_size=1, max_size=40),
       st.integers(1, 4))
def test_every_submitted_job_is_eventually_served_once(ops, max_active):
    s, clock = make(max_active=max_active, bound=5.0)
    jobs = []
    for i, (seat, prio, work) in enumerate(ops):
        j = FakeJob(seat, prio, enqueued_at=float(i), name=str(i))
        j.tokens = work + 1
        jobs.append(j)
        clock.t = float(i)
        s.submit(j)
    finished = []
    for step in range(10000):
        clock.t = len(ops) + step * 0.1
        s.admit()
        assert len(s.active) <= max_active
        job = s.pick()
        if job is None:
            break
        s.charge(job, 1)
        job.tokens -= 1
        if job.tokens == 0:
            assert s.remove(job)
            finished.append(job)
    assert sorted(finished, key=lambda j: j.name) == sorted(jobs, key=lambda j: j.name)
    assert not s.has_work()


# ---------------------------------------------------------------------- fairness under saturation
RANK = {"interactive": 0, "normal": 1, "background": 2}


def test_a_seat_holding_every_slot_gives_one_up_at_once():
    """The issue-13 case on the pure scheduler: seat A fills max_active with long work,
    seat B's request is admitted at the next admit, not when A's work ends."""
    s, clock = make(max_active=4, bound=30.0)
    hogs = [FakeJob("a", name=f"a{i}") for i in range(4)]
    for j in hogs:
        s.submit(j)
    run(s, 400)  # A's requests have run (and, in the old code, aged) for a while
    clock.t = 100.0
    short = FakeJob("b", enqueued_at=100.0, name="b")
    s.submit(short)
    assert short in s.admit()
    assert len(s.parked) == 1 and s.parked[0] in hogs  # kept, resumes later
    # The split is now fair (3:1 is as close to 2:2 as B's one request allows) and stable.
    assert s.admit() == []


def test_slots_split_by_weight_and_no_ping_pong():
    s, _ = make(max_active=4)
    for i in range(6):
        s.submit(FakeJob("heavy", weight=3.0, name=f"h{i}"))
    s.admit()
    for i in range(6):
        s.submit(FakeJob("light", weight=1.0, name=f"l{i}"))
    s.admit()
    n = s.running_counts()
    assert n == {"heavy": 3, "light": 1}
    for _ in range(50):
        assert s.admit() == []


def _over_share(s: Scheduler, weights: dict[str, float], max_active: int, seat: str, rank: int,
                run_rank: dict[str, int]) -> list:
    """Running jobs of seats other than ``seat`` whose seat holds more than its weighted
    share of the slots and whose class is no higher than ``rank`` (computed afresh here)."""
    busy = {j.seat for j in s.active} | {j.seat for j in s.waiting()}
    total = sum(weights[b] for b in busy)
    n: dict[str, int] = {}
    for j in s.active:
        n[j.seat] = n.get(j.seat, 0) + 1
    return [v for v in s.active if v.seat != seat and run_rank[v.name] >= rank
            and n[v.seat] > max_active * weights[v.seat] / total + 1e-9]


@settings(max_examples=80, deadline=None)
# Found by hypothesis: a request parked and re-admitted within one admit must count as
# admitted in that cycle.
@example([("s1", "interactive", 11, 0.0), ("s1", "interactive", 1, 0.0), ("s1", "interactive", 1, 0.0),
          ("s3", "interactive", 11, 0.0), ("s2", "interactive", 2, 0.0)], 2,
         {"s1": 0.5, "s2": 0.5, "s3": 0.5, "s4": 0.5}, False)
@given(st.lists(st.tuples(st.sampled_from(["s1", "s2", "s3", "s4"]),
                          st.sampled_from(["interactive", "normal", "background"]),
                          st.integers(1, 40),        # tokens the job decodes
                          st.floats(0.0, 20.0)),     # arrival time
                min_size=1, max_size=30),
       st.integers(1, 4),
       st.fixed_dictionaries({s: st.sampled_from([0.5, 1.0, 2.0, 3.0]) for s in ["s1", "s2", "s3", "s4"]}),
       st.booleans())
def test_no_request_waits_past_the_bound_while_another_seat_is_over_its_share(ops, max_active, weights, one_class):
    """The guarantee of docs/OPERATIONS.md (Fairness), with random arrivals, lengths,
    weights and classes. Cycles are 0.1 s of fake time; the bound is 2 s.

    After every admit (so within one cycle), for every waiting request R of seat S whose
    aged class is c (its class, one higher per bound waited since it last started waiting):
    - no running request of another seat has a lower class than c;
    - if R has waited the bound, no other seat holds more than its weighted share of the
      slots with a running request of class c or lower, other than requests admitted in
      this same admit (each admitted request runs at least one cycle).
    In one class (the council case) that reads: no request waits more than the bound plus
    one cycle while another seat holds more than its share (plus one cycle per other
    request that got in on the same grounds just before it)."""
    bound, cycle = 2.0, 0.1
    s, clock = make(max_active=max_active, bound=bound)
    pending = sorted(
        (FakeJob(seat, "normal" if one_class else prio, weight=weights[seat], enqueued_at=t, name=str(i), tokens=n)
         for i, (seat, prio, n, t) in enumerate(ops)), key=lambda j: j.enqueued_at)
    total = len(pending)
    wait_start: dict[str, float] = {}
    run_rank: dict[str, int] = {}  # the aged class each job was admitted at

    def aged(j) -> int:
        return max(0, RANK[j.priority] - int((clock.t - wait_start[j.name]) // bound))

    finished = []
    for step in range(20000):
        now = step * cycle
        clock.t = now
        while pending and pending[0].enqueued_at <= now:
            j = pending.pop(0)
            j.enqueued_at = now
            wait_start[j.name] = now
            s.submit(j)
        before = set(map(id, s.active))
        just_admitted: set[str] = set()
        waiting_before = {j.name: aged(j) for j in s.waiting()}
        moves_before = len(s.displaced)
        s.admit()
        # Admitted in this admit: new to the active set, or parked and re-admitted in it.
        readmitted = {id(v) for v, *_ in s.displaced}
        s.displaced.clear()
        for j in s.active:
            if id(j) not in before or id(j) in readmitted:
                # (one parked and re-admitted at once had waited 0 s: its own class)
                run_rank[j.name] = waiting_before.get(j.name, RANK[j.priority])
                just_admitted.add(j.name)
        # A running request parked and admitted again within this same admit (a starved
        # request took its slot, then the fair split gave it one back) was admitted in this
        # cycle too: the scheduler protects it for one cycle, as any other admission.
        for _victim, cand, _why, _waited in s.displaced[moves_before:]:
            if cand in s.active and cand.name not in just_admitted:
                run_rank[cand.name] = waiting_before.get(cand.name, RANK[cand.priority])
                just_admitted.add(cand.name)
        for j in s.parked:
            if id(j) in before:
                wait_start[j.name] = now  # parked just now: it waits afresh
        assert len(s.active) <= max_active
        waiting = list(s.waiting())
        if waiting:
            assert len(s.active) == max_active
        for r in waiting:
            waited = now - wait_start[r.name]
            c = aged(r)
            assert not [v for v in s.active if run_rank[v.name] > c], (now, r, s.active)
            if waited >= bound:
                assert not [v for v in _over_share(s, weights, max_active, r.seat, c, run_rank)
                            if v.name not in just_admitted], (now, r, waited, s.active)
        job = s.pick()
        if job is None:
            if not pending:
                break
            continue
        s.charge(job, 1)
        job.tokens -= 1
        if job.tokens == 0:
            assert s.remove(job)
            finished.append(job)
    assert len(finished) == total and not s.has_work()


# ---------------------------------------------------------------------- the engine step
@dataclass(eq=False)
class PromptJob:
    """A request as the engine step sees it: prompt tokens left to prefill (0: decoding)."""

    seat: str
    priority: str = "normal"
    weight: float = 1.0
    enqueued_at: float = 0.0
    name: str = ""
    prefill_left: int = 0
    prefill_chunk: int = 16


def make_step(budget: int, max_active: int = 8):
    clock = Clock()
    cfg = SchedulerConfig(max_active=max_active, starvation_bound_s=30.0, step_token_budget=budget)
    return Scheduler(cfg, clock=clock), clock


def iterate(s: Scheduler, rows: list[PromptJob], depth: int = 0) -> tuple[object, list[tuple[PromptJob, int]], int]:
    """One engine iteration as worker._step runs it, on the pure scheduler. ``rows``: the
    decoding jobs that form the continuous batch (one step advances them all), speculating
    at ``depth`` (its verify forwards rows x (depth + 1) positions: the batch decoders'
    ``last_positions``). Returns the decoder picked, the prefill plan, and the prompt tokens
    it forwarded."""
    s.admit()
    d = s.pick_decoder()
    spent = (len(rows) * (depth + 1) if d in rows else 1) if d is not None else 0
    plan = s.prefill_plan(spent)
    tokens = 0
    for job, chunks in plan:
        for _ in range(chunks):
            n = min(job.prefill_chunk, job.prefill_left)
            job.prefill_left -= n
            tokens += n
            s.charge(job, 1)
    return d, plan, tokens


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 600), st.sampled_from([1, 16, 32, 100, 256]), st.integers(1, 4), st.integers(200, 3000),
       st.integers(0, 3))
def test_a_decoding_row_waits_at_most_the_budget_per_step_while_a_long_prompt_prefills(budget, chunk, rows, long, depth):
    """While one seat's long prompt is prefilled, every batched row advances every step (its
    gap is one step, never a turn per chunk), and the prompt tokens prefilled between two of
    its steps are at most max(budget - the step's decode positions, one chunk), a speculating
    batch's step counting rows x (depth + 1). The prompt still finishes: at least one chunk a step."""
    s, _ = make_step(budget)
    batch = [PromptJob(f"seat{i}", name=f"row{i}") for i in range(rows)]
    for j in batch:
        s.submit(j)
    prompt = PromptJob("long", name="long", prefill_left=long, prefill_chunk=chunk)
    s.submit(prompt)
    steps = 0
    while prompt.prefill_left > 0:
        d, plan, tokens = iterate(s, batch, depth)
        steps += 1
        assert d in batch  # the batch's step ran: every row advanced
        assert plan and plan[0][0] is prompt
        assert tokens <= max(budget - rows * (depth + 1), chunk), (tokens, budget, rows, depth, chunk)
        assert steps <= long  # progress every step
    # And no slower than the budget allows: whole chunks fill what the decode step leaves.
    per_step = max(1, (budget - rows * (depth + 1)) // chunk) * chunk
    assert steps <= -(-long // min(per_step, long)) + 1


def test_cold_prompts_finish_first_come():
    """The issue-29 case: four cold 1,119-token prompts from four seats, a moment apart. The
    first to arrive finishes its prefill first, after about a quarter of the time all four
    take (chunks taking turns made them all finish together, at the end)."""
    s, clock = make_step(budget=256)
    prompts = []
    for i in range(4):
        clock.t = float(i)
        p = PromptJob(f"seat{i}", name=f"p{i}", enqueued_at=clock.t, prefill_left=1119, prefill_chunk=128)
        prompts.append(p)
        s.submit(p)
    finished_at: dict[str, int] = {}
    step = 0
    while len(finished_at) < 4:
        step += 1
        iterate(s, [])
        for p in prompts:
            if p.prefill_left == 0 and p.name not in finished_at:
                finished_at[p.name] = step
                s.remove(p)  # (its decode is not what this test is about)
    order = sorted(finished_at, key=finished_at.get)
    assert order == ["p0", "p1", "p2", "p3"], finished_at
    assert len(set(finished_at.values())) == 4  # one after another, not together
    assert finished_at["p0"] <= finished_at["p3"] / 4 + 1, finished_at


def test_a_hit_is_prefilled_ahead_of_cold_prompts_of_its_class():
    """A request whose remainder fits one chunk (a prefix-cache hit's tail) goes first in the
    prefill phase, ahead of a long cold prompt that arrived before it, and is done in one go;
    a hit of a lower class does not jump a higher class's prompt."""
    s, clock = make_step(budget=64)
    cold = PromptJob("a", name="cold", prefill_left=3000, prefill_chunk=32)
    s.submit(cold)
    iterate(s, [])
    clock.t = 1.0
    hit = PromptJob("b", name="hit", enqueued_at=1.0, prefill_left=20, prefill_chunk=32)
    bg_hit = PromptJob("c", "background", name="bg_hit", enqueued_at=1.0, prefill_left=5, prefill_chunk=32)
    s.submit(hit)
    s.submit(bg_hit)
    _, plan, _ = iterate(s, [])
    assert plan[0] == (hit, 1) and hit.prefill_left == 0
    assert all(job is not bg_hit for job, _ in plan)  # a lower class waits while normal work runs
    assert bg_hit.prefill_left == 5


def test_a_stream_of_hits_does_not_hold_a_long_prompt_back_past_the_bound():
    """Short remainders go first, but a prompt that has been prefilled for the starvation
    bound stops yielding to them: it then goes in arrival order, ahead of later hits."""
    s, clock = make_step(budget=0)  # one chunk per iteration
    cold = PromptJob("a", name="cold", prefill_left=3000, prefill_chunk=32)
    s.submit(cold)
    served_cold = []
    for t in range(40):  # a new hit from another seat every second, each done in one chunk
        clock.t = float(t)
        s.submit(PromptJob(f"hit{t}", name=f"hit{t}", enqueued_at=clock.t, prefill_left=10, prefill_chunk=32))
        _, plan, _ = iterate(s, [])
        served_cold.append(plan[0][0] is cold)
        for j in [j for j in s.active if j.prefill_left == 0]:
            s.remove(j)
    assert not any(served_cold[:30])  # the bound is 30 s: hits first until then
    assert all(served_cold[30:])  # then the long prompt's chunks go first


def test_each_seat_s_first_prompt_goes_before_any_seat_s_second():
    """Seat fairness among prompts: round by round, each seat's next prompt (a seat of weight
    2 has two in each round), and arrival order within a round."""
    for weight_a, expected in ((1.0, ["a1", "b1", "a2", "b2", "a3"]), (2.0, ["a1", "b1", "a2", "a3", "b2"])):
        s, clock = make_step(budget=32)
        jobs = [PromptJob(seat, name=name, weight=weight_a if seat == "a" else 1.0, enqueued_at=t,
                          prefill_left=500, prefill_chunk=32)
                for t, (seat, name) in enumerate([("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("b", "b2")])]
        for j in jobs:
            clock.t = j.enqueued_at
            s.submit(j)
        s.admit()
        assert [j.name for j in s.prefill_order()] == expected


def test_a_lower_class_prompt_waits_while_a_higher_class_decodes():
    """As with pick: the best class running has the engine; the interactive decoder runs
    every step and a normal prompt's chunks wait (it was admitted to a free slot)."""
    s, _ = make_step(budget=512)
    chat = PromptJob("chat", "interactive", name="chat")
    prompt = PromptJob("b", name="prompt", prefill_left=100, prefill_chunk=16)
    s.submit(chat)
    s.submit(prompt)
    for _ in range(5):
        d, plan, _ = iterate(s, [])
        assert d is chat and plan == []
    s.remove(chat)
    d, plan, _ = iterate(s, [])
    assert d is None and plan == [(prompt, 7)]
