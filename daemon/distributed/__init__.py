"""Serving one model across several processes (machines) in tensor parallel, on
``mx.distributed`` (ring over TCP, JACCL over Thunderbolt RDMA, MPI; NCCL on CUDA).

Every rank loads the model and keeps its share of the weights (mlx-lm's ``Model.shard``,
engine/model/sharding.py); each forward then all_sums partial results across the group, so every
rank must run the same forwards, with the same shapes, in the same order: lockstep.
Rank 0 alone owns the socket, the intake, the scheduler's inputs and the governor.

How lockstep is kept (replaying the loop's inputs, chosen over broadcasting each engine action):
every rank runs the same EngineWorker step loop (daemon/engine_thread/worker.py), which is deterministic
given its inputs. Rank 0 broadcasts, once per loop iteration and before the iteration does
any engine work, the inputs that are not deterministic: the worker commands it drained
(requests with their tokenized prompts and seeds, cancels, the scheduler reload, stop), the
clock the iteration reads (deadlines and the scheduler's aging use it), and the settings
the governor and the operator decide (depth, head resident, depth pinned, prompt-cache
cap). The other ranks apply exactly those and then run the same admit / start / advance /
finish code, so the prefill chunks, decode and verify forwards, batch composition, rollback
commits and parking line up by construction. Why not (a), broadcasting each action: the
decisions live in a dozen places inside the worker and the decode generators (draft stops,
prompt lookup, loop guard, accept/reject); replicating the few inputs keeps one engine
code path for one and many ranks, and a new engine feature is lockstep-safe as long as it
reads its inputs through the worker (the rule this package relies on).

What makes the replicated engine agree: (1) tokens: a sharded forward ends in an all_sum
whose result is the same on every rank (with two ranks a + b == b + a bit for bit; ring and
NCCL reduce each chunk on one rank and broadcast it), and the logits come from replicated
weights, so argmax and the sampler (same seed: rank 0 assigns one to every request that
has none) pick the same token everywhere; (2) start-up probes (verify exactness, batch
exactness, the compiled step) are decided on rank 0 and adopted by the others. Two checks
guard the assumption rather than trust it: at hello the ranks compare a fingerprint of their
engine settings and model (a difference refuses to serve, exit 78), and at every exchange
rank 0 compares a running digest of each rank's committed tokens with its own (a
difference ends the group: group.diverged).
The MTP head is replicated (every rank holds it whole and drafts locally): its drafts cost
no collective, and it is ~3% of a 27B model.

One channel call per iteration (channel.py) carries rank 0's tick out and every other
rank's memory report back (one all_gather), and feeds the liveness watchdog
(watchdog.py): a rank that dies makes the others' collectives fail (ring: "connection to a
peer was lost") or stall, and each rank exits non-zero within ``distributed.peer_timeout_s``
with one ``group.peer_lost`` log event; the service manager restarts the group. Any engine
exception on any rank ends the group the same way (group.engine_fault): a rank that skipped
or repeated a forward could never line up again.
"""
