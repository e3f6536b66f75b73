"""protocol.readiness: waiting for a freshly started daemon (no daemon needed for these)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import zmq

from protocol import Pong, decode_client, encode
from protocol.readiness import DaemonNotReady, wait_until_answering

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def test_a_process_that_dies_is_reported_with_its_log(tmp_path):
    log = tmp_path / "d.log"
    log.write_text("councild: no model at /nowhere\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(78)"])
    proc.wait()
    with pytest.raises(DaemonNotReady, match=r"exited with code 78(.|\n)*no model at /nowhere"):
        wait_until_answering(f"ipc://{tmp_path}/none.sock", proc, timeout_s=5, log_path=log)


def test_silence_times_out(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DaemonNotReady, match="did not answer .* within 1 s"):
        wait_until_answering(f"ipc://{tmp_path}/none.sock", timeout_s=1.0)
    assert time.monotonic() - t0 < 3


def test_returns_once_something_answers_a_ping(tmp_path):
    endpoint = f"ipc://{tmp_path}/r.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)

    def answer_one() -> None:
        ident, frame = router.recv_multipart()
        ping = decode_client(frame)
        router.send_multipart([ident, encode(Pong(nonce=ping.nonce))])

    t = threading.Thread(target=answer_one)
    t.start()
    try:
        wait_until_answering(endpoint, timeout_s=10)
    finally:
        t.join(5)
        router.close()
