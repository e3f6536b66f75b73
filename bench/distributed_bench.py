"""Tensor parallel on mx.distributed: 1 rank against N ranks, serial and speculative decode.

``python bench/distributed_bench.py [--ranks 2] [--backend ring] [--rounds 3] [--tokens 48]
    [--depths 1,2,3] [--shape bundled|tiny|27b] [--inproc] --json OUT.json --md OUT.md``

What it measures, per arm (A: the model whole in one process; B: split across ``--ranks``
processes by the engine's own sharding, daemon/engine/model/sharding.py), through the engine's
decode paths (daemon/engine/decoders/serial.py, speculative.py), greedy:
- serial: tokens per second over ``--tokens`` tokens and the median step time;
- speculation at each depth with ORACLE drafts: the MTP head runs (real cost), but its
  logits are biased to the token the serial run produced there (bench/gpu_bench.py's
  OracleHead, acceptance 1.0), so every draft is accepted: the ceiling of speculation,
  with the verify's real cost on each arm.
The two arms alternate A B, B A, ... over ``--rounds`` rounds (ABAB, order flipped each
round), and each figure is reported as the median over rounds with its spread, and B/A as
the median of the per-round ratios.

Two ways to run the arms:
- default (CPU): each arm is its own launch: A one process, B ``--ranks`` processes on
  loopback (MLX_RANK + MLX_HOSTFILE, as ``mlx.launch --backend ring`` sets them), so arm A
  runs with no idle rank beside it (a rank waiting in a ring collective polls a CPU).
- ``--inproc`` (GPUs): one ``mlx.launch -n N`` run; rank 0 holds the whole model as well
  as its share, and for arm A the other ranks wait at a barrier. For big models, where a
  launch per arm would rebuild tens of GB each time.

Shapes: ``bundled`` (the bundled tiny-qwen35, its trained MTP head), ``tiny`` and ``27b``
(gpu_bench.py's random decisive qwen3_5 in 4-bit; 27b: Qwen3.5-27B's shape, 15 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = "def fibonacci(n):\n    "


# ---------------------------------------------------------------------- one arm, one rank
def _load(shape: str, group):
    """(lm, head, prompt ids) with the model split across ``group`` (None: whole)."""
    import mlx.core as mx

    from daemon.engine.model.sharding import shard_model

    if shape == "bundled":
        from daemon.engine.model.loading import load_model
        from daemon.engine.model.mtp_head import load_mtp_head
        from daemon.paths import BUNDLED_MODEL

        lm = load_model(BUNDLED_MODEL, group=group)
        return lm, load_mtp_head(lm), list(lm.tokenizer.encode(PROMPT))
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_bench import QWEN35_27B, TINY, build_model, quantize_4bit

    text_cfg = QWEN35_27B if shape == "27b" else TINY
    lm, head, _ = build_model(text_cfg, seed=0)
    quantize_4bit(lm, head)
    if group is not None and group.size() > 1:
        shard_model(lm.model, lm.config, group)
        mx.eval(lm.model.parameters())
    mx.clear_cache()
    return lm, head, [int(t) for t in range(1, 17)]


def _serial(lm, prompt: list[int], tokens: int) -> tuple[dict, list[int]]:
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.types import SamplingParams

    out, steps = [], []
    gen = serial_decode(lm, prompt, Sampler(SamplingParams()))
    t0 = time.perf_counter()
    for step in gen:
        out += step.tokens
        steps.append(step.cycle_s)
        if len(out) >= tokens:
            break
    wall = time.perf_counter() - t0
    gen.close()
    # The first step includes the prompt's prefill: the step time is the median of the rest.
    return {"tokens": len(out), "seconds": wall, "tok_s": len(out) / wall,
            "step_ms": 1000 * statistics.median(steps[1:])}, out


def _speculate(lm, head, prompt: list[int], seq: list[int], depth: int, tokens: int) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_bench import OracleHead

    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.speculative import speculative_decode
    from daemon.engine.types import SamplingParams

    oracle = OracleHead(head, list(prompt) + seq, [1.0] * depth, lm.text_args.vocab_size, seed=1)
    gen = speculative_decode(lm, oracle, prompt, Sampler(SamplingParams()), depth=depth, exact=True,
                             guard_margin=None)
    out, cycles, accepted = [], [], 0
    t0 = time.perf_counter()
    for step in gen:
        out += step.tokens
        cycles.append(step.cycle_s)
        accepted += step.accepted
        if len(out) >= tokens:
            break
    wall = time.perf_counter() - t0
    gen.close()
    n = min(len(out), len(seq))
    return {"tokens": len(out), "seconds": wall, "tok_s": len(out) / wall,
            "cycle_ms": 1000 * statistics.median(cycles[1:]), "tokens_per_cycle": len(out) / len(cycles),
            "matches_serial": out[:n] == seq[:n]}


def _draft_ms(lm, head, reps: int = 20) -> float:
    """One head step (the head's layer + logits through the shared lm_head) on a short history."""
    import mlx.core as mx

    tok = mx.array([[1]])
    hidden = lm.embed(tok)  # any hidden of the activation dtype: the cost is what is timed
    cache = head.make_cache()
    mx.eval(head.logits(head(hidden, tok, cache)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(head.logits(head(hidden, tok, cache)))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _measure(lm, head, prompt, args, split_head=None) -> dict:
    import mlx.core as mx

    _serial(lm, prompt, 8)  # warm-up: kernels, first allocations
    serial, seq = _serial(lm, prompt, args.tokens)
    # The oracle needs the serial continuation beyond what speculation commits in its last cycle.
    _, seq = _serial(lm, prompt, args.tokens + max(args.depths) + 1)
    res = {"serial": serial, "depths": {}, "draft_ms": _draft_ms(lm, head)}
    for k in args.depths:
        res["depths"][str(k)] = _speculate(lm, head, prompt, seq, k, args.tokens)
    if split_head is not None:  # the same, with the head split across the ranks too
        res["split_head"] = {"draft_ms": _draft_ms(lm, split_head), "depths": {
            str(k): _speculate(lm, split_head, prompt, seq, k, args.tokens) for k in args.depths}}
    res["active_bytes"] = mx.get_active_memory()
    return res


def _split_head(head, group):
    """A copy of ``head`` split across ``group`` (engine/model/sharding.py: shard_head)."""
    import copy

    import mlx.core as mx

    from daemon.engine.model.sharding import shard_head

    lm = head._lm
    head._lm = None  # not copied: the split head drafts through the same base model
    twin = copy.deepcopy(head)
    head._lm = twin._lm = lm
    shard_head(twin, group)
    mx.eval(twin.parameters())
    return twin


def worker(args) -> int:
    """One rank of one launch: measure the arm(s) and (rank 0) write them to ``--out``."""
    import mlx.core as mx

    # Strict where a launcher described a group: a backend that fails must not quietly
    # measure one rank as if it were the split arm.
    group = mx.distributed.init(strict="MLX_RANK" in os.environ, backend=args.backend)
    rank, size = group.rank(), group.size()
    runs: list[dict] = []
    if args.inproc:
        whole = _load(args.shape, None) if rank == 0 else None
        split = _load(args.shape, group)
        twin = _split_head(split[1], group)
        barrier = lambda: mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))  # noqa: E731
        for r in range(args.rounds):
            for arm in ("A", "B") if r % 2 == 0 else ("B", "A"):
                barrier()
                if arm == "A":
                    if rank == 0:
                        runs.append({"round": r, "arm": "A", "ranks": 1, **_measure(*whole, args)})
                else:
                    res = _measure(*split, args, split_head=twin)
                    runs.append({"round": r, "arm": "B", "ranks": size, **res})
                barrier()
    else:
        lm, head, prompt = _load(args.shape, group if size > 1 else None)
        twin = _split_head(head, group) if size > 1 else None
        runs.append({"round": args.round, "arm": "B" if size > 1 else "A", "ranks": size,
                     **_measure(lm, head, prompt, args, split_head=twin)})
    if rank == 0:
        Path(args.out).write_text(json.dumps({"runs": runs, "device": str(mx.default_device()),
                                              "mlx": mx.__version__}))
    return 0


# ---------------------------------------------------------------------- driver
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _worker_cmd(args, out: Path, round_: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out), "--round", str(round_),
            "--shape", args.shape, "--tokens", str(args.tokens), "--depths", ",".join(map(str, args.depths)),
            "--backend", args.backend, "--rounds", str(args.rounds)] + (["--inproc"] if args.inproc else [])


def _launch(args, ranks: int, out: Path, round_: int, tmp: Path) -> None:
    cmd = _worker_cmd(args, out, round_)
    if ranks == 1:
        subprocess.run(cmd, check=True, cwd=ROOT)
        return
    # What mlx.launch sets on one host (launch_ring / launch_nccl), with the processes ours.
    if args.backend in ("ring", "nccl"):
        if args.backend == "ring":
            hosts = tmp / "hosts.json"
            hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(ranks)]))
            env = [dict(MLX_RANK=str(r), MLX_HOSTFILE=str(hosts)) for r in range(ranks)]
        else:  # one GPU per rank; NVLink multicast stays off (shared hosts: device/KINDS.md)
            port = str(_free_ports(1)[0])
            env = [dict(MLX_RANK=str(r), MLX_WORLD_SIZE=str(ranks), NCCL_HOST_IP="127.0.0.1", NCCL_PORT=port,
                        CUDA_VISIBLE_DEVICES=str(r), NCCL_NVLS_ENABLE="0") for r in range(ranks)]
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, **e)) for e in env]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return
    launcher = [sys.executable, "-m", "mlx.launch", "--backend", args.backend, "-n", str(ranks), "--"]
    subprocess.run(launcher + cmd[1:], check=True, cwd=ROOT)


def _spread(values: list[float]) -> dict:
    from daemon.measure.bench_io import spread

    return spread(values)


def summarise(runs: list[dict], depths: list[int]) -> dict:
    """Per arm: median and spread over rounds; B/A: median of the per-round ratios."""
    by = {arm: {r["round"]: r for r in runs if r["arm"] == arm} for arm in ("A", "B")}
    rounds = sorted(set(by["A"]) & set(by["B"]))
    metrics = [("serial tok/s", lambda r: r["serial"]["tok_s"]), ("serial step ms", lambda r: r["serial"]["step_ms"])]
    for k in depths:
        metrics += [(f"depth {k} tok/s", lambda r, k=k: r["depths"][str(k)]["tok_s"]),
                    (f"depth {k} cycle ms", lambda r, k=k: r["depths"][str(k)]["cycle_ms"])]
    out = {}
    for name, get in metrics:
        a = [get(by["A"][i]) for i in rounds]
        b = [get(by["B"][i]) for i in rounds]
        out[name] = {"A": _spread(a), "B": _spread(b), "B_over_A": _spread([y / x for x, y in zip(a, b)])}
    exact = all(d["matches_serial"] for r in runs for d in r["depths"].values())
    exact = exact and all(d["matches_serial"] for r in runs if "split_head" in r
                          for d in r["split_head"]["depths"].values())
    # The MTP head on the split arm: replicated (what the daemon does) vs split too.
    head = {}
    b = [by["B"][i] for i in rounds if "split_head" in by["B"][i]]
    if b:
        pairs = [("draft step ms", lambda r: r["draft_ms"], lambda r: r["split_head"]["draft_ms"])]
        for k in depths:
            pairs.append((f"depth {k} tok/s", lambda r, k=k: r["depths"][str(k)]["tok_s"],
                          lambda r, k=k: r["split_head"]["depths"][str(k)]["tok_s"]))
        for name, rep_, spl in pairs:
            x, y = [rep_(r) for r in b], [spl(r) for r in b]
            head[name] = {"replicated": _spread(x), "split": _spread(y),
                          "split_over_replicated": _spread([q / p for p, q in zip(x, y)])}
    return {"rounds": rounds, "metrics": out, "head": head, "oracle_speculation_matches_serial": exact}


def format_table(result: dict) -> str:
    s = result["summary"]
    ranks = result["config"]["ranks"]
    lines = [f"Tensor parallel, {result['config']['shape']} model, {result['device']}, backend "
             f"{result['config']['backend']}: A = 1 rank (whole model), B = {ranks} ranks (split); "
             f"{len(s['rounds'])} rounds ABAB, median (min-max) over rounds", "",
             "| figure | A: 1 rank | B: %d ranks | B / A |" % ranks, "|---|---|---|---|"]
    def cell(d):
        return f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})"

    for name, m in s["metrics"].items():
        lines.append(f"| {name} | {cell(m['A'])} | {cell(m['B'])} | {cell(m['B_over_A'])} |")
    if s["head"]:
        lines += ["", f"The MTP head on the {ranks}-rank arm: replicated on every rank (the daemon's choice) vs "
                      f"split like the base's attention layers (one all_sum more per layer and draft):", "",
                  "| figure | replicated | split | split / replicated |", "|---|---|---|---|"]
        for name, m in s["head"].items():
            lines.append(f"| {name} | {cell(m['replicated'])} | {cell(m['split'])} | "
                         f"{cell(m['split_over_replicated'])} |")
    lines += ["", f"Oracle speculation committed the serial tokens on every arm: "
                  f"{s['oracle_speculation_matches_serial']}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", default="ring", choices=["ring", "nccl", "jaccl", "mpi", "any"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--shape", default="bundled", choices=["bundled", "tiny", "27b"])
    ap.add_argument("--inproc", action="store_true", help="one launch; rank 0 also holds the whole model (GPUs)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.depths = [int(x) for x in args.depths.split(",") if x]
    if args.worker:
        return worker(args)
    runs: list[dict] = []
    device = mlx_version = ""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        plan = [("inproc", 0)] if args.inproc else [
            (arm, r) for r in range(args.rounds) for arm in (("A", "B") if r % 2 == 0 else ("B", "A"))]
        for arm, r in plan:
            out = tmp / f"{arm}{r}.json"
            print(f"[{time.strftime('%H:%M:%S')}] round {r} arm {arm}", file=sys.stderr, flush=True)
            _launch(args, 1 if arm == "A" else args.ranks, out, r, tmp)
            got = json.loads(out.read_text())
            runs += got["runs"]
            device, mlx_version = got["device"], got["mlx"]
    result = {"command": ["python", "bench/distributed_bench.py", *(argv if argv is not None else sys.argv[1:])],
              "config": {"ranks": args.ranks, "backend": args.backend, "rounds": args.rounds, "tokens": args.tokens,
                         "depths": args.depths, "shape": args.shape, "inproc": args.inproc},
              "device": device, "mlx": mlx_version, "host": platform.node(), "cpu_count": os.cpu_count(),
              "load_avg_at_end": os.getloadavg(), "runs": runs, "summary": summarise(runs, args.depths)}
    table = format_table(result)
    print(table)
    from daemon.measure.bench_io import write_results

    write_results(result, table, args.json, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
