"""The AsyncClient against the fake ROUTER peer (asyncio.run per test; no plugin needed)."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from proto_helpers import done, stream_script
from protocol import messages as m
from protocol.client import AsyncClient, DaemonUnavailable, InvalidRequest, Overloaded

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def run(coro, limit: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, limit))


def test_async_streaming(fake_daemon, endpoint):
    fake = fake_daemon(stream_script(["Hel", "lo", "!"]), interval=0.3)

    async def main():
        async with AsyncClient(endpoint, seat="critic", timeout_s=5) as client:
            assert client.welcome.seat == "critic"
            stream = client.generate("hi", request_id="a-1")
            got = [c async for c in stream]
            assert got == ["Hel", "lo", "!"]
            assert stream.done.finish_reason == "stop" and stream.text == "Hello!"
            assert stream.accepted.request_id == "a-1" and stream.token_ids == [100, 101, 102]
            # awaiting a stream sends it now
            s2 = await client.generate("again")
            assert (await s2.result()).text == "Hello!"
            d = await client.complete("whole")
            assert d.text == "Hello!"
            assert (await client.status()).model == "fake-model"
            assert 0 <= await client.ping() < 1
            assert (await client.governor("auto")).ok

    run(main())
    assert fake.of_type(m.Hello)[0].seat == "critic"
    assert [g.stream for g in fake.of_type(m.Generate)] == [True, True, False]


def _interleaved(fake, identity, msg):
    if isinstance(msg, m.Generate):
        ids = fake.state.setdefault("ids", [])
        ids.append(msg.request_id)
        if len(ids) == 3:
            for i in range(4):
                for rid in ids:
                    fake.send(identity, m.Tokens(request_id=rid, seq=i, text=f"{rid}{i}", token_ids=[i]))
            for rid in reversed(ids):
                fake.send(identity, done(rid, "".join(f"{rid}{i}" for i in range(4))))


def test_async_interleaved_streams(fake_daemon, endpoint):
    fake_daemon(_interleaved)

    async def consume(stream, pause):
        out = []
        async for chunk in stream:
            out.append(chunk)
            await asyncio.sleep(pause)
        return out

    async def main():
        async with AsyncClient(endpoint, timeout_s=5) as client:
            streams = [client.generate("p", request_id=r) for r in ("x", "y", "z")]
            results = await asyncio.gather(*(consume(s, p) for s, p in zip(streams, (0.0, 0.01, 0.0))))
            for rid, out, s in zip("xyz", results, streams):
                assert out == [f"{rid}{i}" for i in range(4)]
                assert s.done.text == "".join(out)

    run(main())


def test_async_error_and_cancel(fake_daemon, endpoint):
    def handler(fake, identity, msg):
        if isinstance(msg, m.Generate):
            if msg.prompt == "busy":
                fake.send(identity, m.Error(code="overloaded", message="busy", request_id=msg.request_id, retry_after_s=2.0))
            else:
                fake.send(identity, m.Accepted(request_id=msg.request_id, queue_position=0, prompt_tokens=1))
                fake.send(identity, m.Tokens(request_id=msg.request_id, seq=0, text="t0", token_ids=[0]))
        elif isinstance(msg, m.Cancel):
            fake.send(identity, done(msg.request_id, "t0", "cancelled", 1))

    fake = fake_daemon(handler)

    async def main():
        async with AsyncClient(endpoint, timeout_s=5) as client:
            with pytest.raises(Overloaded) as info:
                async for _ in client.generate("busy"):
                    pass
            assert info.value.retry_after_s == 2.0
            stream = await client.generate("long", request_id="cx")
            assert await stream.__anext__() == "t0"
            await stream.cancel()
            assert (await stream.result()).finish_reason == "cancelled"
            with pytest.raises(InvalidRequest):
                client.generate("a", prompt_tokens=[1])

    run(main())
    assert [c.request_id for c in fake.of_type(m.Cancel)] == ["cx"]


def test_async_heartbeats_while_waiting(fake_daemon, endpoint):
    def slow(fake, identity, msg):
        if isinstance(msg, m.Generate):
            fake.send(identity, done(msg.request_id, "late"), delay=0.5)

    fake = fake_daemon(slow, interval=0.05)

    async def main():
        async with AsyncClient(endpoint, timeout_s=0.3) as client:
            return (await client.generate("x").result()).text

    assert run(main()) == "late"
    assert len(fake.of_type(m.Ping)) >= 5


def test_async_daemon_silent_raises_unavailable(fake_daemon, endpoint):
    fake_daemon(lambda *a: None, answer_pings=False, interval=0.05)

    async def main():
        async with AsyncClient(endpoint, timeout_s=0.3) as client:
            stream = client.generate("x")
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable) as info:
                async for _ in stream:
                    pass
            assert time.monotonic() - t0 < 2.0
            assert endpoint in str(info.value)

    run(main())


def test_async_no_daemon(endpoint):
    async def main():
        client = AsyncClient(endpoint, timeout_s=0.2)
        with pytest.raises(DaemonUnavailable):
            await client.status()
        await client.close()

    run(main())


def test_async_curve(fake_daemon, endpoint):
    public, secret = zmq.curve_keypair()
    fake_daemon(stream_script(["c"]), curve_secret=(public, secret))

    async def main():
        async with AsyncClient(endpoint, timeout_s=5, curve_server_key=public) as client:
            return [c async for c in client.generate("x")]

    assert run(main()) == ["c"]


def test_async_daemon_restart_fails_streams_in_flight(fake_daemon, endpoint):
    first = fake_daemon(lambda fake, identity, msg: isinstance(msg, m.Generate) and fake.send(
        identity, m.Accepted(request_id=msg.request_id, queue_position=0, prompt_tokens=1)))

    async def main():
        async with AsyncClient(endpoint, timeout_s=5) as client:
            stream = await client.generate("x")
            while not first.of_type(m.Generate):
                await asyncio.sleep(0.01)
            first.stop()
            fake_daemon(stream_script(["fresh"]))
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable, match="lost the connection"):
                async for _ in stream:
                    pass
            assert time.monotonic() - t0 < 2.0
            assert stream.accepted is not None
            return [c async for c in client.generate("y")]

    assert run(main()) == ["fresh"]


def test_async_stream_that_failed_to_start_stays_failed(fake_daemon, endpoint):
    async def main():
        client = AsyncClient(endpoint, timeout_s=0.2)
        stream = client.generate("x")
        with pytest.raises(DaemonUnavailable):
            async for _ in stream:
                pass
        with pytest.raises(DaemonUnavailable):  # raises again, never hangs
            await stream.__anext__()
        fake_daemon(stream_script(["ok"]), max_frame_bytes=2048)
        assert [c async for c in client.generate("y")] == ["ok"]  # the client reconnects
        with pytest.raises(InvalidRequest, match="frame_too_large"):
            await client.generate("z" * 4096)
        with pytest.raises(InvalidRequest, match="max_tokens"):
            await client.generate("z", max_tokens=5000)
        s1 = await client.generate("a", request_id="dup")
        with pytest.raises(InvalidRequest, match="duplicate_request"):
            await client.generate("b", request_id="dup")
        assert [c async for c in s1] == ["ok"]
        await client.close()

    run(main())
