"""The lockstep channel: rank 0's tick out to every rank, every rank's report back, in one
``mx.distributed`` collective per engine-loop iteration (no transport of our own).

Each rank contributes a fixed-size slot to one all_gather: rank 0's slot holds the tick,
the others' hold their latest memory report. A tick larger than a slot (a request with a
long prompt) follows in a second collective, an all_sum to which only rank 0 contributes
(the others add zeros), sized by the length rank 0 put in its slot.

Frames are msgpack (msgspec) of the Structs below: typed, no pickle. The group's links
carry the model's activations too, so they must be a private network either way
(docs/OPERATIONS.md, Several machines).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgspec
import numpy as np
from msgspec import Struct

SLOT_BYTES = 4096
# magic, exchange number, payload length, CRC of the payload, 1 when the payload follows in
# an overflow all_sum. A collective whose peer died can return without raising and hand back
# whatever its buffer held: every slot is checked against these before it is trusted.
_HEADER = struct.Struct("<IQIIB")
_MAGIC = 0xC0C1D0D0
_ROOM = SLOT_BYTES - _HEADER.size


class LinkBroken(RuntimeError):
    """An exchange returned a frame that is not what a live peer sends: the peer connection
    was lost mid-collective."""


# ---------------------------------------------------------------------- wire structs
class JobWire(Struct, tag="submit", array_like=True):
    """A request as the other ranks need it: the Generate message, the tokenized prompt
    and what the socket loop decided (seat, class, weight, deadline, times)."""
    msg: bytes  # protocol.encode(m.Generate)
    identity: bytes
    seat: str
    priority: str
    weight: float
    deadline: float | None
    received_at: float
    enqueued_at: float
    prompt: list[int]
    segment_ends: list[int]


class CancelWire(Struct, tag="cancel", array_like=True):
    seat: str
    request_id: str
    reason: str


class CancelAllWire(Struct, tag="cancel_all", array_like=True):
    code: str
    message: str


class SchedulerWire(Struct, tag="scheduler", array_like=True):
    cfg: dict


class StopWire(Struct, tag="stop", array_like=True):
    pass


CommandWire = JobWire | CancelWire | CancelAllWire | SchedulerWire | StopWire


class Settings(Struct, array_like=True):
    """What the governor and the operator decide on rank 0, as it stands after the drain."""
    depth: int
    head: bool  # the MTP head resident
    pinned: bool  # an operator pinned the depth (drafts the pinned depth in full)
    prompt_cache_limit: int | None


class Tick(Struct, array_like=True):
    now: float  # rank 0's monotonic clock for this iteration (deadlines, scheduler aging)
    commands: list[CommandWire]
    settings: Settings


class Hello(Struct, array_like=True):
    """After every rank has loaded: rank 0's start-up decisions, which the others adopt."""
    verify_exact: bool
    batch_exact: bool | None
    compiled: bool
    tuned_profile: dict | None
    fingerprint: str = ""
    # The start-up warm-up's mode as rank 0 resolved it ("full", "light", "off"): every rank
    # runs the same warm-up forwards (their collectives must line up), after this hello.
    warmup: str = "off"
    # Whether batched steps run compiled on rank 0 (its batch self-check, engine/model/compiled.py):
    # a rank whose own check passed where rank 0's failed runs batches eager too.
    compiled_batch: bool = False


class Report(Struct, array_like=True):
    """A rank's own state, sent back with every exchange."""
    rank: int
    host: str
    pid: int
    level: str  # the worst memory pressure level its probes read
    available_bytes: int | None
    detail: str
    active_bytes: int
    cache_bytes: int
    peak_bytes: int
    total_bytes: int | None
    # A running CRC of every token this rank's engine committed, as of its previous
    # iteration: rank 0 compares it with its own to catch a rank that drew another token.
    digest: int = 0
    # What must be equal on every rank for lockstep (lockstep.fingerprint); sent with the hello.
    fingerprint: str = ""


_enc = msgspec.msgpack.Encoder()
_tick_dec = msgspec.msgpack.Decoder(Tick)
_hello_dec = msgspec.msgpack.Decoder(Hello)
_report_dec = msgspec.msgpack.Decoder(Report)


def _slot(payload: bytes, seq: int) -> np.ndarray:
    buf = np.zeros(SLOT_BYTES, dtype=np.uint8)
    overflow = len(payload) > _ROOM
    header = _HEADER.pack(_MAGIC, seq, len(payload), zlib.crc32(payload), int(overflow))
    buf[: _HEADER.size] = np.frombuffer(header, dtype=np.uint8)
    if not overflow:
        buf[_HEADER.size: _HEADER.size + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    return buf


def _unslot(buf: np.ndarray, seq: int, rank: int) -> tuple[int, int, bool, bytes]:
    """(length, crc, overflow, payload) of a slot; LinkBroken when it is not a live peer's."""
    magic, got_seq, n, crc, overflow = _HEADER.unpack(buf[: _HEADER.size].tobytes())
    if magic != _MAGIC or got_seq != seq or overflow not in (0, 1) or (not overflow and n > _ROOM):
        raise LinkBroken(f"exchange {seq}: rank {rank}'s frame is malformed (magic {magic:#x}, exchange {got_seq}): "
                         f"the connection to a peer was lost mid-collective")
    payload = b"" if overflow else buf[_HEADER.size: _HEADER.size + n].tobytes()
    if not overflow and zlib.crc32(payload) != crc:
        raise LinkBroken(f"exchange {seq}: rank {rank}'s frame fails its CRC: the connection to a peer was lost")
    return n, crc, bool(overflow), payload


class LockstepChannel:
    """``exchange(payload_or_report)``: one round. Rank 0 passes the encoded tick and gets
    every rank's report; the others pass their encoded report and get the tick's bytes."""

    def __init__(self, group: Any, on_exchange=None):
        import mlx.core as mx

        self.mx = mx
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.on_exchange = on_exchange
        self.exchanges = 0
        self.overflows = 0

    def _round(self, mine: bytes) -> tuple[bytes, list[bytes]]:
        mx = self.mx
        seq = self.exchanges
        gathered = mx.distributed.all_gather(mx.array(_slot(mine, seq)), group=self.group)
        slots = np.array(gathered, copy=False).reshape(self.size, SLOT_BYTES)
        n, crc, overflow, lead = _unslot(slots[0], seq, 0)
        if overflow:
            self.overflows += 1
            own = np.frombuffer(mine, dtype=np.uint8) if self.rank == 0 else np.zeros(n, dtype=np.uint8)
            summed = mx.distributed.all_sum(mx.array(own), group=self.group)
            lead = np.array(summed, copy=False).astype(np.uint8).tobytes()
            if len(lead) != n or zlib.crc32(lead) != crc:
                raise LinkBroken(f"exchange {seq}: the overflow frame fails its CRC: the connection to a peer was lost")
        others = [_unslot(slots[r], seq, r)[3] for r in range(1, self.size)]
        self.exchanges += 1
        if self.on_exchange is not None:
            self.on_exchange()
        return lead, others

    # rank 0 ----------------------------------------------------------------------
    def send(self, msg: Tick | Hello) -> list[Report]:
        _, others = self._round(_enc.encode(msg))
        return [_decode(_report_dec, b) for b in others if b]

    # other ranks ------------------------------------------------------------------
    def receive_tick(self, report: Report | None) -> Tick:
        lead, _ = self._round(_enc.encode(report) if report is not None else b"")
        return _decode(_tick_dec, lead)

    def receive_hello(self, report: Report | None) -> Hello:
        lead, _ = self._round(_enc.encode(report) if report is not None else b"")
        return _decode(_hello_dec, lead)


def _decode(decoder, frame: bytes):
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:  # checked frames that still do not decode: versions differ
        raise LinkBroken(f"a peer's frame does not decode ({exc}); are all ranks the same councild version?") from None
