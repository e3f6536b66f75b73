"""A fresh start's first exact requests against the verify verdict (decode_paths.py): the
worker's own start-up, in a process of its own, on the bundled model and an empty cache folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_an_exact_request_whose_verify_verdict_came_during_its_prefill_decodes_exact(tmp_path):
    """A fresh start (empty cache folder, the worker's own start-up in a process of its own):
    an exact greedy request started before the verify verdict gets the serial mode and a
    prefill that primes the head's history; where the verdict (bit-identical: speculate) comes
    before its prefill ends, it decodes as the exact request it is, from that history; one
    whose prefill ends first decodes serially, keeping the history for its continuation."""
    code = ("import json, zmq\n"
            "from protocol import messages as m\n"
            "from daemon.config import Config\n"
            "from daemon.engine_thread.worker import EngineWorker\n"
            "from daemon.paths import BUNDLED_MODEL\n"
            "from daemon.request_text.requests import Job\n"
            "w = EngineWorker(Config(), zmq.Context.instance(), str(BUNDLED_MODEL))\n"
            "w._load()\n"
            "assert w.engine.verify_exact is None\n"
            "out = []\n"
            "for verdict_first in (True, False):\n"
            "    job = Job(msg=m.Generate(request_id=f'r{verdict_first}', prompt='def f(x):\\n' * 20,\\\n"
            "              speculation='exact'), identity=b'c', seat='s', priority='normal', weight=1.0,\\\n"
            "              deadline=None, received_at=0.0)\n"
            "    job.prompt = w.engine.lm.tokenizer.encode(job.msg.prompt)\n"
            "    w.engine.verify_exact = None\n"
            "    w.paths.start(job)\n"
            "    row = [job.mode, job.prefill_head, job.prefill.history is not None]\n"
            "    while job.prefill.step():\n"
            "        pass\n"
            "    w.engine.verify_exact = True if verdict_first else None\n"
            "    w.paths.begin_decode(job)\n"
            "    out.append(row + [job.mode, job.decode_history is not None or job.batched])\n"
            "print(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, COUNCILD_CACHE_DIR=str(tmp_path)))
    assert res.returncode == 0, res.stderr[-3000:]
    verdict_first, verdict_after = json.loads(res.stdout.strip().splitlines()[-1])
    assert verdict_first == ["off", True, True, "exact", True]
    assert verdict_after == ["off", True, True, "off", True]
