"""Typed configuration: defaults, then a TOML file, then COUNCILD_* environment, then flags.

Everything is decoded by msgspec into one Struct tree, so a bad value or an unknown key
fails at start-up with the key's path in the message (``$.scheduler.max_queued``).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .engine.types import DEFAULT_GUARD

PositiveFloat = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
# Every size and every duration has a ceiling, so a typo (max_active = 100000) is refused at
# start-up (exit 78) instead of running away. The ceilings are far above sane values.
MiB = 1 << 20
DAY_S = 86400.0
Seconds = Annotated[float, Meta(gt=0, le=DAY_S)]
# The protocol's own bounds (protocol/messages.py): a prompt of at most 2**20 token ids, and
# max_tokens at most 2**20.
WIRE_TOKENS = 1 << 20


class ConfigError(Exception):
    """A configuration the daemon refuses to start with (exit code 78, EX_CONFIG)."""


class SeatConfig(Struct, forbid_unknown_fields=True, frozen=True):
    priority: Literal["interactive", "normal", "background"] = "normal"
    weight: Annotated[float, Meta(gt=0, le=1000)] = 1.0


# With scheduler.max_active = "auto", the limit before the governor's first decision: the
# fixed default it replaces, so a council of 4 batches from its first round as it always did;
# above it the governor measures before it goes (a probe of the next bucket of heights).
AUTO_START_HEIGHT = 4


class SchedulerConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # Requests decoded at once (batched, or time-sliced, each keeping its cache). "auto": the
    # governor decides (governor/row_limit.py): it starts at AUTO_START_HEIGHT and admits
    # rows up to max_active_ceiling while the measured step cost by height says another row
    # pays and memory holds each row's cache at its context, and backs off under pressure.
    # An int pins it (1..256). "auto" is the default since a council of 8 on a quiet machine
    # did at least as well with it as pinned at 4 (1.02x and 1.03x the aggregate tok/s, TTFT
    # p50 0.78-0.99x: bench/results/row_limit_cpu_2026-12-05); the batch is built, probed for
    # exactness and warmed up at the ceiling, once per machine.
    max_active: Annotated[int, Meta(ge=1, le=256)] | Literal["auto"] = "auto"
    # With max_active = "auto": the most rows the governor may admit. The batch decoder is
    # built, probed and warmed up at this height at start-up (with an int max_active, at that).
    max_active_ceiling: Annotated[int, Meta(ge=1, le=256)] = 8
    # Accepted-but-unfinished requests, in total and per seat; past them, Overloaded.
    max_queued: Annotated[int, Meta(ge=1, le=65536)] = 64
    max_queued_per_seat: Annotated[int, Meta(ge=1, le=65536)] = 16
    # A queued request of a lower class is promoted one class after waiting this long, so
    # background work is delayed but never starved.
    starvation_bound_s: Seconds = 30.0
    # Decode several active streams in one batched forward (depth 0). Where the backend's
    # batched kernels round differently from one-token ones (Metal, CUDA), requests that
    # must be exact at temperature 0 still decode alone; "fast" and sampled ones batch.
    batching: bool = True
    # A prompt is prefilled this many tokens at a time, each chunk one unit of work between
    # other streams' decode cycles; cancel, deadlines and the drain are checked between
    # chunks. Smaller: others' streams stall less and a cancel lands sooner, at some
    # prefill throughput. The chunk size can be part of the numerics (where the chunked
    # GatedDeltaNet form runs, from each chunk's start; on CPU, sizes like 17 or 100 too), so
    # daemons with different chunks can differ at a near-tie; one daemon's runs agree,
    # prefix-cache hits included (OPERATIONS.md, Chunked prefill).
    prefill_chunk: Annotated[int, Meta(ge=1, le=1 << 16)] = 256
    # Tokens one engine iteration spends (a decode phase, then a prefill phase): the decode
    # cycle's tokens first (every batched row's one step), then whole prefill chunks while
    # they fit in what is left, short remainders (prefix-cache hits) first, then by arrival;
    # at least one chunk runs when a prompt waits. So the others' inter-token gap holds at
    # most max(what is left, one chunk) of prefill. Chunks are never split (their size is
    # part of the prefill's numerics). 0: one chunk per iteration, the stall chunks had when
    # they took turns with decode cycles. Higher: more prefill per iteration (a long
    # prompt's first token sooner), longer gaps for the others (on a CPU, where prefill is
    # compute-bound, about in proportion: bench/results/engine_step_cpu.md).
    step_token_budget: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    # While others decode, an iteration (their decode phase, then a prompt's prefill) takes
    # at most this many times an iteration that prefills nothing: the prefill phase gets the
    # tokens that fit, measured (engine_thread/prefill_pacer.py), at least 4 and at least a
    # forward's fixed part in tokens where it stands out of the fit's error. So the decoding
    # streams' gap during a long prompt stays near this multiple of their quiet gap, and the
    # long prompt's first token comes later (more iterations). Where off-grid splits change
    # the numbers, exact requests keep whole chunks (OPERATIONS.md, "The engine step").
    # 0: whole chunks (prefill_chunk / step_token_budget) whatever the decode phase costs.
    decode_gap_bound: Annotated[float, Meta(ge=0.0, le=1000.0)] = 3.0
    # Prompts whose remainder fits one chunk (prefix-cache hits' tails, short prompts)
    # prefilled together: one forward carries a piece of each (engine/prefill/batched_prefill.py).
    # "auto": where start-up measures that a forward of max_active rows costs less than
    # (max_active + 1) / 2 one-row forwards (so the prompts' first tokens come sooner on
    # average: a GPU, not this CPU); "on" / "off" whatever it costs. Exact greedy requests
    # join only where the start-up probe finds it bit-identical to prefilling each alone.
    # Not in a tensor-parallel group.
    prefill_together: Literal["auto", "on", "off"] = "auto"
    # The batch's decode forwards carry the paced piece of the prompt being prefilled (one
    # forward instead of two an iteration: engine/prefill/mixed_forward.py). "auto": where start-up
    # measures that such a forward costs under 0.8 of the two it replaces (launch-bound
    # devices; this CPU measures 0.91-1.04, so off here); "on" / "off" whatever it costs. Exact
    # greedy rows and prompts take part only where the start-up probe finds every group's
    # numbers bit-identical to its own forward's. Only while the pacer cuts pieces
    # (decode_gap_bound > 0, a stream decoding). Not in a tensor-parallel group.
    mixed_steps: Literal["auto", "on", "off"] = "auto"
    seats: Annotated[dict[str, SeatConfig], Meta(max_length=1024)] = {}
    default_seat: SeatConfig = SeatConfig()

    @property
    def height_auto(self) -> bool:
        """Whether the governor decides how many requests decode at once."""
        return self.max_active == "auto"

    @property
    def batch_rows(self) -> int:
        """The height the batch decoder is built, probed and warmed up at: the ceiling the
        governor may reach with "auto", else the pinned max_active."""
        return self.max_active_ceiling if self.max_active == "auto" else self.max_active

    @property
    def start_height(self) -> int:
        """The live limit before the governor's first decision (the pinned value when pinned)."""
        return min(AUTO_START_HEIGHT, self.max_active_ceiling) if self.max_active == "auto" else self.max_active


class SpeculationConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # Default for requests that do not say: "exact" is token-identical to serial at
    # temperature 0; "fast" accepts rare near-tie flips; "off" is serial decode.
    mode: Literal["off", "exact", "fast"] = "exact"
    # Starting depth until the governor has measurements (0 = no speculation).
    depth: Annotated[int, Meta(ge=0, le=8)] = 1
    # Load the MTP head at start-up when the model has one.
    load_head: bool = True
    # Rollback of GatedDeltaNet state after a partial accept: "capture" keeps per-token
    # states from the verify (no re-forward; won every CPU measurement), "snapshot"
    # restores and re-forwards; "auto" picks capture off Metal and snapshot on it.
    rollback: Literal["auto", "capture", "snapshot"] = "auto"
    # Exact mode re-decides a verify position with serial numerics when its top-2 logit
    # margin is within this fraction of the top logit (engine/types.py says why 2**-5).
    # Wider is safer and slower.
    guard_margin: Annotated[float, Meta(ge=0.0, le=1.0)] = DEFAULT_GUARD
    # Exact temperature-0 requests where a verify does not compute serial's numerics bit for
    # bit (probed at start-up, engine/decoders/exactness.py: CPU does, MLX on CUDA does not): "serial"
    # decodes them serially, which keeps exact token-identical; "guarded" speculates with the
    # guard above, which bounds flips but cannot exclude them (H200: 1.6-1.7 per 1000 tokens).
    exact_on_inexact_backend: Literal["serial", "guarded"] = "serial"
    # Prompt-lookup drafts (engine/decoders/lookup.py): where the generated tail repeats an n-gram of
    # the prompt or output so far, verify the continuation as a draft block (no head
    # forward), backing off when blocks miss. Runs at depth 0 too. Up to this many tokens.
    prompt_lookup: bool = True
    lookup_max_draft: Annotated[int, Meta(ge=1, le=32)] = 8
    # Rows of the continuous batch draft lookup blocks too (greedy rows without a grammar;
    # engine/decoders/batch_spec.py), up to min(lookup_max_draft, 8) tokens: a cycle where any row
    # has one verifies every row's block (the others' head drafts) in one forward. "auto" (the
    # default): on CUDA, where a verify's cost is nearly flat in positions (an H100, four HTTP
    # streams of 256 tokens: 1.40x and 1.50x the batch without it, bench/results/h100_2026-12-07h);
    # not on the CPU, where four streams ran 0.59x with it (each position a row of work), nor on
    # Metal (not measured).
    batch_lookup: Literal["auto"] | bool = "auto"
    # Per-request depth: below the governor's depth, stop a cycle's head drafting once the
    # drafts' confidence times the request's running acceptance is below this (serial steps
    # one more position costs); 0 never stops early.
    draft_stop_threshold: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.35
    # Sampled requests on the speculative path: once the output loops (a unit repeated 3
    # times over 24+ tokens), decode serially under a DRY penalty until it stops looping
    # (engine/decoders/loop_guard.py). Never applies at temperature 0.
    loop_guard: bool = True
    # Build each head-drafted cycle's successor while the device runs it (engine/decoders/speculative.py,
    # "Pipeline"; the same tokens either way): "auto" does on CUDA, where it was measured
    # faster, and not on the CPU (measured slower) or Metal (not measured yet).
    build_ahead: Literal["auto"] | bool = "auto"
    # Rows of the continuous batch speculate too (engine/decoders/batch_spec.py): every row drafts
    # with the head, one verify forward scores all rows, each keeps its own accepted
    # prefix. false: the batch decodes at depth 0 (engine/decoders/batch.py) and only a request
    # running alone speculates.
    in_batch: bool = True


class PrefixCacheConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # Keep state snapshots (the prompt's last two prefill-chunk grid points, the grid point
    # below each message end looked for, and where splits are exact the prompt's and those
    # messages' exact ends: engine/caches/prefix_cache.py) and continue later prompts that start
    # with them.
    enabled: bool = True
    # LRU past this; the governor also sheds snapshots (oldest first) under memory pressure.
    max_bytes: Annotated[int, Meta(ge=1, le=1 << 42)] = 1 << 30
    # Where a backend's kernels make a split prefill differ from a chunked one in the last
    # ulp (checked at start-up; this CPU does), snapshots at a prompt's exact end and a
    # finished request's continuation (prompt + answer) are inexact: a hit can flip a
    # greedy token at a near-tie. "fast" requests use them anyway; true lets exact and
    # serial requests use them too (more reuse, weaker promise). Off: exact hits only.
    inexact_reuse: bool = False
    # The disk tier (engine/caches/prefix_disk.py): every snapshot is also written to a file, so
    # dropping it from RAM loses nothing and a restarted daemon finds it.
    disk: bool = True
    # Its folder; "" is "prefix" under the daemon's cache folder (COUNCILD_CACHE_DIR, else
    # the per-user cache, daemon/paths.py).
    disk_dir: str = ""
    # Its own byte budget, least recently used files go first.
    disk_max_bytes: Annotated[int, Meta(ge=1, le=1 << 46)] = 8 << 30
    # A write that would leave less free on that filesystem is skipped (a full disk is a
    # miss, never a crash, and the cache never fills the disk the logs live on).
    disk_min_free_bytes: Annotated[int, Meta(ge=0)] = 1 << 30
    # Files not used for this long are deleted when the daemon starts (0: never).
    disk_ttl_s: Annotated[float, Meta(ge=0)] = 7 * 86400.0


class ChatConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # Variables for the model's chat template on every chat request (a request's own
    # chat_template_kwargs override them), e.g. {enable_thinking = false} for Qwen3.5.
    template_kwargs: dict[str, str | bool | int | float] = {}
    # Where the template marks thinking (<think>...</think>), stream it in `reasoning`,
    # apart from the answer in `text` (daemon/request_text/reasoning.py). false: one text, markers kept.
    separate_reasoning: bool = True


class ConstraintConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # The most characters of a free string (no maxLength, enum, const or format of its own)
    # inside a forced tool call (tool_choice required or named) or a json_schema answer, for
    # requests that do not say (Generate.string_max_chars), lowered per request so the
    # strings fit in half of max_tokens (tool_grammar.budget_cap): a model that never ends a
    # string (the bundled one writes code forever) still closes the call before max_tokens.
    # A ceiling, not a target: a real model writing a file through a forced call ends its
    # string itself, and a small fixed cap would cut it (64 cut every such file). A schema's
    # own smaller maxLength stays. 0: no cap at all (a model's own judgement only).
    string_max_chars: Annotated[int, Meta(ge=0, le=1 << 16)] = 4096


class DistributedConfig(Struct, forbid_unknown_fields=True, frozen=True):
    # Serve one model tensor-parallel across the processes of an mx.distributed group
    # (several Macs over Thunderbolt or Ethernet, or GPUs): every rank runs `councild serve`
    # with this on (flag --distributed), started by mlx.launch or with MLX_RANK and
    # MLX_HOSTFILE set; rank 0 binds the endpoint, the others follow it in lockstep
    # (daemon/distributed/, docs/OPERATIONS.md "Several machines").
    enabled: bool = False
    # mx.distributed backend: "any" takes the first available (MLX's order), or name one.
    backend: Literal["any", "ring", "jaccl", "mpi", "nccl"] = "any"
    # A rank that completes no exchange with the group for this long exits non-zero
    # (group.peer_lost). Above the longest single engine action (a prefill chunk, a head
    # load); a rank that dies on the ring backend is noticed at once.
    peer_timeout_s: Seconds = 30.0
    # The same, until every rank has loaded the model (ranks load at different speeds).
    startup_timeout_s: Seconds = 900.0


class Config(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    endpoint: str | None = None
    # TCP endpoints need CURVE unless this is set (it logs a warning).
    insecure_tcp: bool = False
    curve_secret_key_file: str | None = None
    # At most the reference client's MAXMSGSIZE (64 MiB): a larger frame could not be answered.
    max_frame_bytes: Annotated[int, Meta(ge=1024, le=64 * MiB)] = 8 << 20
    max_tokens: Annotated[int, Meta(ge=1, le=WIRE_TOKENS)] = 4096
    # Longest prompt after tokenization. Unset: the model's context length
    # (max_position_embeddings). A value above the context is lowered to it (logged as
    # config.clamped) unless max_prompt_tokens_beyond_context is set.
    max_prompt_tokens: Annotated[int, Meta(ge=1, le=WIRE_TOKENS)] | None = None
    max_prompt_tokens_beyond_context: bool = False
    heartbeat_interval_s: Seconds = 2.0
    # A client that says nothing for this long while it has work in flight is gone.
    heartbeat_timeout_s: Seconds = 10.0
    # Below launchd's ExitTimeOut and systemd's TimeoutStopSec (45 s in our templates).
    drain_deadline_s: Seconds = 30.0
    # Per-client send queue: a consumer that stops reading is cut off here, not buffered.
    client_send_hwm: Annotated[int, Meta(ge=1, le=100_000)] = 1000
    # A client whose send queue is full is cut only when it stays full this long: its
    # messages wait in the daemon meanwhile (bounded), so a client that reads but was paused
    # on a starved machine (a GC, a swap-in, a busy core) is not cut. 0: cut at once.
    slow_consumer_grace_s: Annotated[float, Meta(ge=0, le=600)] = 5.0
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Run decode steps and verifies through mx.compile'd layers (daemon/engine/model/compiled.py); it is
    # used only where a start-up check finds it bit-identical to the eager forward, so it
    # changes speed, never tokens. false: always eager (for A/B measurements).
    compile_decode: bool = True
    # The kernels the model's forward runs through (daemon/engine_thread/kernel_choice.py). "auto": MLX's
    # where the start-up probes prove a row's logits independent of the rows and positions
    # beside it (CPU), else councild's invariant kernels (engine/kernels/invariant.py: fixed-order
    # matmul and attention, CUDA and Metal) where the probes prove those, so exact rows batch
    # and speculate; else MLX's, and exact rows decode alone. "mlx": never the invariant
    # kernels (they are slower: the price of the promise). "invariant": always try them.
    kernels: Literal["auto", "mlx", "invariant"] = "auto"
    # The GatedDeltaNet recurrence (gates, decay, delta rule, readout) as one kernel per layer
    # (daemon/engine/kernels/gdn_fused.py). "auto": on CUDA, where mlx-lm has no kernel for it and
    # runs ~20 plain ops per layer instead (a 27B step: 30 ms compiled against 37 on the H200);
    # Metal keeps mlx-lm's own kernel, the CPU its ops. "off": mlx-lm's path everywhere. Every
    # forward of the model takes the same one, so exactness holds either way.
    gdn_kernel: Literal["auto", "off"] = "auto"
    # The conv, SiLU and q/k normalisation in front of that recurrence folded into the same
    # kernel (gdn_fused.gated_delta_conv_fused): ~8 fewer kernels a layer, ~400 a 27B step.
    # "auto": with the fused recurrence, where its start-up self-check passes. "off": the conv
    # in MLX's ops before the fused recurrence (the bits differ, so every forward takes one).
    gdn_conv_fold: Literal["auto", "off"] = "auto"
    # Projections that read one input as one matmul (daemon/engine/kernels/merged_linears.py): each
    # GatedDeltaNet layer's four input projections and each MLP's gate and up, 208 fewer matmuls
    # in a 27B step, whose cost on CUDA is the host's per kernel. "auto": where the GatedDeltaNet
    # layers run the fused recurrence (CUDA), whose forward reads the merged matmul. "off": the
    # separate projections. The weights are held once either way.
    merge_linears: Literal["auto", "off"] = "auto"
    # MLX-on-CUDA sends attention of more than one query to cuDNN (head dims <= 128), which
    # builds a plan per new key length (37-57 ms each on the H200): every speculative cycle
    # and prompt remainder paid one. false: MLX's own attention kernels (vector kernel or
    # matmul path), whose cost does not depend on having seen a shape; true: cuDNN, with a
    # larger plan cache. Either way MLX's "cache thrashing" error is turned off
    # (engine/jit/backend_env.py). Read by nothing on CPU and Metal.
    cudnn_attention: bool = False
    # MLX-on-CUDA compiles each kernel module at its first use, one at a time (2.5-8 s each on
    # the H200: 30-52 s of a fresh start, and a slow first round). "auto": on CUDA, with 4
    # cores or more, worker processes compile the modules the first steps meet side by side
    # while the daemon imports and reads its weights (engine/jit/prebuild.py); the model's
    # first forward waits for them (at most 120 s). "on": on any backend and core count (for
    # tests and measurements; elsewhere the recipes compile nothing that lasts). "off": MLX
    # compiles each at first use.
    kernel_prebuild: Literal["auto", "on", "off"] = "auto"
    # MLX-on-CUDA compiles the daemon's own kernels (mx.fast.cuda_kernel) in every process and
    # keeps nothing on disk: 4.8 s of a start on an H100 and as much at the first request.
    # true: the daemon compiles each one the first time it meets it and writes it where MLX
    # looks first (engine/kernels/custom_kernel_cache.py), so later starts read it. false: MLX
    # compiles them in every process. Read by nothing on CPU and Metal.
    custom_kernel_cache: bool = True
    # Once, the last start-up part (after ready, between requests, unless warm_in_background is
    # false: then before ready), run the shapes the daemon serves: a prefill chunk
    # and a short remainder, decode steps, every speculative depth, every batch height.
    # The first council round after start-up then costs what the tenth does (on a GPU the
    # first use of a shape compiles kernels: 15.8 s TTFT measured on the H200 without it).
    # "auto": "full" on a GPU, "light" on the CPU (nothing is compiled per shape there; one
    # pass of each path, which also pays the one-time allocations); "off": none.
    warmup: Literal["auto", "full", "light", "off"] = "auto"
    # After the other start-up parts, only while the engine idles (serving warms the counts it
    # meets itself), forward a prompt piece of every token count 1..scheduler.prefill_chunk once, a
    # count a piece (engine_thread/warmup.py). On CUDA a forward of a count never run before
    # costs 1.71x the same count again (cuBLASLt picks each matmul's algorithm per size, a new
    # CUDA graph; bench/probes/prefill_length_first_use.py), and nearly every request's last
    # prompt piece has a count of its own. "auto": where warmup resolves to "full" (a GPU);
    # "on" / "off" whatever the device. Not in a tensor-parallel group.
    warm_prefill_lengths: Literal["auto", "on", "off"] = "auto"
    # After the other start-up parts, only while the engine idles: prefill one prompt of 16 whole
    # chunks (4,096 tokens at the default chunk), a chunk a piece, on a cache of its own
    # (engine_thread/warmup.prefill_depths): the other warm-ups forward at depth 0 only, and a
    # fresh H100's first council round ran a cold prompt's chunks at depths 256-1,024 at about
    # twice their later cost (what the part gains that round is not measured yet). "auto": where
    # warmup resolves to "full" (a GPU); "on" / "off" whatever the device. Not in a
    # tensor-parallel group.
    warm_prefill_depths: Literal["auto", "on", "off"] = "auto"
    # Serve first, improve after (daemon/engine_thread/warming.py): the daemon is ready once the
    # weights and head are loaded and one eager step ran; the compiled step's self-checks, the
    # exactness and cost probes and the warm-up then run on the engine thread between requests,
    # a piece at a time, each path switched in once its check passes (requests take the safe,
    # exact path until then). false: all of it before ready (a group always does so).
    warm_in_background: bool = True
    # Seconds between `stats` log events (counters, rates, memory: what /metrics shows, for
    # log-only shops); 0 turns them off.
    stats_interval_s: Annotated[float, Meta(ge=0)] = 60.0
    # An engine-loop iteration at least this long (every request waits through it) logs
    # `engine.slow_iteration` with where its time went (engine_thread/slow_iterations.py);
    # 0: never.
    log_slow_iteration_s: Annotated[float, Meta(ge=0, le=86400)] = 1.0
    scheduler: SchedulerConfig = SchedulerConfig()
    speculation: SpeculationConfig = SpeculationConfig()
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    chat: ChatConfig = ChatConfig()
    constraint: ConstraintConfig = ConstraintConfig()
    distributed: DistributedConfig = DistributedConfig()
    # The [http] table belongs to `councild http` (front/config.py checks it); the daemon
    # only lets it sit in the same file.
    http: dict[str, Any] = {}
    # The [governor] table is governor.GovernorConfig's (checked by it at start-up).
    governor: dict[str, Any] = {}
    governor_enabled: bool = True
    # Record the governor's observations and decisions as JSON lines (replayable).
    governor_trace: str | None = None
    # Fault injection for tests, OFF unless set: the decode of any request that has already
    # committed this many tokens raises (as a failing model would), so the request ends with
    # an `internal` Error and the daemon must serve on. Requests with max_tokens at or below
    # it are unaffected. Applied by wrapping the decode generator at request start, so an
    # unset value costs nothing per step. Also $COUNCILD_DEBUG_FAIL_AFTER_TOKENS.
    debug_fail_after_tokens: Annotated[int, Meta(ge=1, le=WIRE_TOKENS)] | None = None
    # Test-only, OFF unless set: treat this backend as one whose verify rounds unlike serial
    # steps (as MLX on CUDA does), so the CPU test suite can exercise
    # speculation.exact_on_inexact_backend through a real daemon.
    debug_inexact_verify: bool = False
    # Test-only, OFF unless set: treat this backend as one where resuming a prefill off the
    # chunk grid changes the numbers (splits_agree false, as on MLX on CUDA), so exact
    # requests reuse on the chunk grid only (engine/caches/prefix_cache.py).
    debug_inexact_splits: bool = False
    # Test-only, OFF unless set: the invariant kernels scale every multi-row matmul's output
    # by (1 + 2**-6), so their start-up probe must fail and refuse them (engine_thread/kernel_choice.py).
    debug_perturb_invariant_batch: bool = False
    # Test-only, empty unless set: start-up parts (warming.py: "compiled_step", "verify",
    # "splits", "batch", "prefill_together", "mixed_steps", "warmup", "prefill_depths", "prefill_lengths") whose
    # check is taken as failed, so its path is never switched in and its engine.warm event says why.
    debug_fail_warm: list[Literal["compiled_step", "verify", "splits", "batch", "prefill_together", "mixed_steps",
                                 "warmup", "prefill_depths", "prefill_lengths"]] = []

    def seat(self, name: str) -> SeatConfig:
        return self.scheduler.seats.get(name, self.scheduler.default_seat)


# Environment variables that map onto top-level keys; nested settings live in the file.
_ENV_KEYS = {
    "COUNCILD_MODEL": "model",
    "COUNCILD_ENDPOINT": "endpoint",
    "COUNCILD_LOG_FORMAT": "log_format",
    "COUNCILD_LOG_LEVEL": "log_level",
    "COUNCILD_MAX_TOKENS": "max_tokens",
    "COUNCILD_HEARTBEAT_TIMEOUT_S": "heartbeat_timeout_s",
    "COUNCILD_DRAIN_DEADLINE_S": "drain_deadline_s",
    "COUNCILD_DEBUG_FAIL_AFTER_TOKENS": "debug_fail_after_tokens",
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | os.PathLike | None = None, overrides: dict | None = None, env: dict | None = None) -> Config:
    """Build the Config; raise ConfigError naming the file and the key on any problem."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    env = os.environ if env is None else env
    env_data: dict = {}
    for var, key in _ENV_KEYS.items():
        if var in env and env[var] != "":
            env_data[key] = env[var]
    data = _merge(_merge(data, env_data), overrides or {})
    where = f" in {path}" if path else ""
    try:
        # strict=False lets "4096" from the environment become an int.
        cfg = msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.endswith("`$.scheduler.max_active`"):  # msgspec names the union's parts, not what to write
            message += ' (an int from 1 to 256, or "auto": the governor decides, up to max_active_ceiling)'
        for var, key in _ENV_KEYS.items():
            if key in env_data and key not in (overrides or {}) and message.endswith(f"`$.{key}`"):
                message += f" (from ${var}={env_data[key]!r})"
        raise ConfigError(f"invalid configuration{where}: {message}") from None
    try:
        from governor import load_config as load_governor_config

        load_governor_config(cfg.governor)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        # The governor validates its own table, so its paths start at the table: root them.
        message = str(exc).replace("`$", "`$.governor")
        if "`$.governor" not in message:
            message += " - at `$.governor`"
        raise ConfigError(f"invalid [governor] table{where}: {message}") from None
    _check_relations(cfg, where)
    return cfg


def _check_relations(cfg: Config, where: str) -> None:
    """Rules between keys, which no single key's type can say."""
    bound = cfg.scheduler.decode_gap_bound
    if 0 < bound <= 1:
        # An iteration is at least its decode phase: a bound of one phase or less leaves the
        # prefill nothing (0 is how to switch pacing off).
        raise ConfigError(
            f"invalid configuration{where}: decode_gap_bound ({bound}) must be 0 (off) or above 1 "
            f"(an iteration's time in quiet iterations) - at `$.scheduler.decode_gap_bound`")
    if cfg.heartbeat_interval_s >= cfg.heartbeat_timeout_s:
        # Clients ping every interval (the daemon tells them in Welcome); an interval at or
        # above the timeout would cut every idle client that is doing exactly as told.
        raise ConfigError(
            f"invalid configuration{where}: heartbeat_interval_s ({cfg.heartbeat_interval_s}) must be "
            f"below heartbeat_timeout_s ({cfg.heartbeat_timeout_s}) - at `$.heartbeat_interval_s`")
