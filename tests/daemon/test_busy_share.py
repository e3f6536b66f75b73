"""warming.BusyShare: the start-up parts' share of a busy engine, on a fake clock."""

from __future__ import annotations

import pytest

from daemon.engine_thread import worker as worker_mod
from daemon.engine_thread.warming import BusyShare

pytestmark = pytest.mark.quick


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _serve(share: BusyShare, clock: Clock, steps: list[float], piece: float) -> tuple[list[int], float]:
    """The worker's loop: a step of each length, then the pieces the credit allows."""
    per_step, warm = [], 0.0
    for step in steps:
        clock.t += step
        n = 0
        while share.earn() > 0:
            clock.t += piece
            share.charge(piece)
            warm += piece
            n += 1
        per_step.append(n)
    return per_step, warm


def test_long_steps_earn_several_short_pieces_and_the_share_holds():
    """A prompt's 0.6 s prefill steps, 20 ms pieces: about 8 pieces a step (not one), and the
    parts take a fifth of the time in all."""
    clock = Clock()
    share = BusyShare(0.2, 0.25, clock)
    steps = [0.6] * 50
    per_step, warm = _serve(share, clock, steps, 0.02)
    assert per_step[0] == 0  # nothing earned before the first step
    assert all(7 <= n <= 9 for n in per_step[1:])
    assert warm / (warm + sum(steps)) == pytest.approx(0.2, abs=0.01)


def test_short_steps_wait_for_a_long_piece_to_be_repaid():
    """10 ms decode steps, 300 ms pieces: a piece, then the debt it left is served off
    (about 1.2 s of steps) before the next."""
    clock = Clock()
    share = BusyShare(0.2, 0.25, clock)
    per_step, warm = _serve(share, clock, [0.01] * 2000, 0.3)
    runs = [i for i, n in enumerate(per_step) if n]
    assert all(per_step[i] == 1 for i in runs)
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    assert gaps and all(115 <= g <= 125 for g in gaps)
    assert warm / (warm + 20.0) == pytest.approx(0.2, abs=0.01)


def test_the_credit_is_capped_and_an_idle_piece_owes_nothing():
    clock = Clock()
    share = BusyShare(0.2, 0.25, clock)
    share.earn()
    clock.t += 60.0  # a minute of serving with nothing to warm earns at most the burst
    assert share.earn() == pytest.approx(0.25)
    share.charge(1.0)
    assert share.credit < 0
    share.idle()  # the engine idled: the part ran freely
    assert share.credit == 0.0
    clock.t += 0.4
    assert share.earn() == 0.0  # the first look after idling only starts the count
    clock.t += 0.4
    assert share.earn() == pytest.approx(0.1)


def test_a_lower_share_earns_less_from_then_on():
    """While no exact greedy request waits for a part's verdict the worker lowers the share
    (WARM_SHARE_NONE_WAITING): a twentieth of the time, not a fifth."""
    clock = Clock()
    share = BusyShare(0.2, 0.25, clock)
    share.set_share(0.05)
    _, warm = _serve(share, clock, [0.6] * 200, 0.02)
    assert warm / (warm + 120.0) == pytest.approx(0.05, abs=0.005)
    share.set_share(0.2)
    clock.t += 0.6
    assert share.earn() == pytest.approx(0.15, abs=0.02)


def test_each_part_is_paced_by_who_waits_for_it(tmp_path):
    """A fresh start's parts (the bundled model, an empty cache folder, the worker's own
    start-up in a process of its own: it freezes the collector and starts the disk tier's
    thread): those whose verdicts only exact greedy requests wait for (verify, batch, splits)
    are marked "exact", the cost probes of optional speed-ups "none", the compiled step and
    the warm-up "every"; and the busy share the worker gives the part under way follows."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, zmq\n"
            "from daemon.config import Config\n"
            "from daemon.engine_thread.worker import EngineWorker\n"
            "from daemon.paths import BUNDLED_MODEL\n"
            "w = EngineWorker(Config(warm_prefill_lengths='on'), zmq.Context.instance(), str(BUNDLED_MODEL))\n"
            "w._load()\n"
            "from protocol import messages as m\n"
            "from daemon.request_text.requests import Job\n"
            "def job(i, **kw):\n"
            "    return Job(msg=m.Generate(request_id=f'r{i}', prompt='x', **kw), identity=b'c', seat='s',\n"
            "               priority='normal', weight=1.0, deadline=None, received_at=0.0)\n"
            "fast, exact = job(0, speculation='fast'), job(1)\n"
            "shares = {}\n"
            "every_part = list(w.warming.parts)\n"
            "while w.warming.parts:\n"
            "    row = []\n"
            "    for active in ([], [fast], [fast, exact]):\n"
            "        w.scheduler.active[:] = active\n"
            "        row.append(w._busy_warm_share())\n"
            "    shares[w.warming.parts[0].name] = row\n"
            "    w.warming.parts.pop(0)\n"
            "w.scheduler.active[:] = []\n"
            "after_all = w.warming.waited_by\n"
            "# The idle part under load, with credit a part before it left over: no piece runs.\n"
            "w.warming.parts[:] = [p for p in every_part if p.name == 'prefill_lengths']\n"
            "pieces = []\n"
            "w.warming.step = lambda: pieces.append(1) or True\n"
            "w._warm_share.credit, w._warm_share._mark = 0.25, None\n"
            "w.scheduler.active[:] = [fast]\n"
            "w._warm_piece(idle=False)\n"
            "w.scheduler.active[:] = []\n"
            "print(json.dumps([[p, shares[p]] for p in shares] + [after_all, len(pieces)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, COUNCILD_CACHE_DIR=str(tmp_path)), check=True)
    *parts, after_all, idle_pieces_under_load = json.loads(out.stdout.strip().splitlines()[-1])
    names = [name for name, _ in parts]
    share = dict(parts)
    assert names[0] == "compiled_step"  # the other verdicts are keyed by the decode path it decides
    assert {"verify", "batch", "splits", "warmup", "prefill_together", "mixed_steps"} <= set(names)
    every, exact, none = (worker_mod.WARM_SHARE_WHEN_BUSY, worker_mod.WARM_SHARE_EXACT_WAITING,
                          worker_mod.WARM_SHARE_NONE_WAITING)
    assert none < every < exact
    # By the engine's requests: none, a fast one, a fast and an exact greedy one.
    assert share["compiled_step"] == share["warmup"] == [every] * 3
    for name in ("verify", "batch", "splits"):
        assert share[name] == [none, none, exact], name
    for name in ("prefill_together", "mixed_steps"):
        assert share[name] == [none] * 3, name
    assert names[-1] == "prefill_lengths" and share["prefill_lengths"] == [0.0] * 3  # only while idle
    assert idle_pieces_under_load == 0
    assert after_all == "none"

