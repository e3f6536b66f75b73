"""engine.slow_iteration: an engine-loop iteration over ``log_slow_iteration_s`` says where its
time went and what the step was. With the threshold near zero every iteration qualifies, so a
request's prefill and decode iterations must each be described."""

from __future__ import annotations

from e2e_harness import start_daemon

from protocol.client import Client


def test_every_iteration_over_the_threshold_is_logged_with_its_phases_and_shape(tmp_path, e2e_model):
    d = start_daemon(tmp_path, e2e_model, config="log_slow_iteration_s = 0.000001\nwarmup = \"off\"\n")
    try:
        with Client(d.endpoint, seat="slow", timeout_s=120) as c:
            c.complete("def slow_iterations(engine):\n" * 8, max_tokens=6, speculation="off")
        events = [e for e in d.events() if e["event"] == "engine.slow_iteration"]
    finally:
        assert d.stop() == 0
    assert events
    assert all(e["seconds"] >= 0 and {"decode", "prefill"} <= set(e["phases"]) and "start" in e["phases"] for e in events)
    assert any(e["prefilled"] > 0 for e in events)  # the prompt's iterations
    # MLX's allocator after the iteration: the model's weights are in use, whatever the pool holds
    assert all(e["active_bytes"] > 0 and e["cache_bytes"] >= 0 for e in events)
    decoding = [e for e in events if e["decode"] is not None]
    assert decoding and all(e["rows"] >= 1 and e["positions"] >= 1 for e in decoding)
