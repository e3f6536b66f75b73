"""The fidelity gate: speculative decode against serial decode.

Temperature 0, for each depth and mode over a fixed prompt set:
- exact must be token-identical to serial on every prompt (else the gate fails, exit 1,
  and the first divergence is printed);
- fast is reported as flips per 1000 tokens (a flip: the first token where the
  speculative sequence leaves the serial one; the comparison of that prompt stops there).

Logit processors (repetition / presence / frequency penalties, logit_bias) change the
distribution at temperature 0 too and depend on the output so far, so speculation must give
every draft and verify row the history serial decode would have. The gate runs the exact
arms again with PROCESSORS on both sides (the same token-identity requirement), and the
temperature > 0 test once more with them (``--no-processors`` skips both).

Constrained decoding (engine/decoders/constraint.py) masks every draft and verify row with the
grammar's state at its position; ``--constraints`` runs the exact and fast arms again under
each named constraint (CONSTRAINTS), against constrained serial decode (the same
token-identity requirement for exact).

Temperature > 0: a statistical test that speculation samples from the base model's own
distribution. At a fixed context, many independent draws (a fresh request per draw, its own
seed) give the first output token (one cycle) and the second (which may come from a later
draft position, the bonus token, or a second cycle after a rollback); a chi-square
goodness-of-fit test compares each histogram with the base model's distribution for that
token under the same sampler transforms: p at the context for the first, the mixture
sum_y p(y) p(. | context + y) for the second, computed with serial (M=1) steps. Bins: every token with expected count
>= 5, the rest pooled. p-value by the Wilson-Hilferty normal approximation of the
chi-square tail (scipy is not a dependency); fails when p < alpha (default 0.001).

Prefix-cache arms (fidelity_prefix.py, ``--prefix-chunk 32``): exact requests that resume
from an off-grid snapshot (a prompt's exact end, a finished turn's continuation) against
serial decode of the whole prompt, where the split probe says such snapshots are exact.

Batched arms (fidelity_batch.py, ``--batched 2,4,8``): the same token identity for rows
speculating together in the continuous batch, 2-8 rows of mixed prompts and depths joining
and leaving mid-stream, every third with the processors; and their "pieces riding" twins
(``--no-riding`` leaves them out), where prompts are prefilled in pieces the batch's depth-0
forwards carry (scheduler.mixed_steps) and each rider's decode is compared too.

CLI: ``councild gate fidelity [--model PATH] [--depths 1,2,3,4] [--tokens N] [--batched 2,4,8]
[--batched-only] [--no-riding] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from ..engine.decoders.constraint import compile_constraint
from ..engine.decoders.lookup import DraftStopConfig, LookupConfig
from ..engine.model.model import LoadedModel
from ..engine.decoders.sampling import Sampler
from ..engine.decoders.serial import serial_decode
from ..engine.decoders.speculative import DEFAULT_GUARD, DEFAULT_ROLLBACK, resolve_rollback, speculative_decode
from ..engine.types import SamplingParams
from ..head_acceptance import PROMPTS_FILE, load_prompts  # the fixed suite, shared with the pull check
from ..engine_thread.kernel_choice import choose_kernels
from .fidelity_batch import run_batched_arms
from .progress import Progress, Quiet

# The processor configuration the gate checks: every processor on, strong enough to change
# the greedy output (penalised repeats, one token banned, one pushed up).
PROCESSORS = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                  logit_bias={11: 4.0, 13: -100.0, 220: 2.0})

# The constraints the gate's constrained arms decode under (one of each kind).
CONSTRAINTS = {
    "json_schema": json.dumps({"type": "object",
                               "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                              "color": {"enum": ["red", "green", "blue"]}},
                               "required": ["name", "age", "color"], "additionalProperties": False}),
    "json_object": "",
    "regex": r"((def|class) [a-z_]+\(\)\n){1,3}",
    "lark": 'start: line+\nline: "x = " NUM "\\n"\nNUM: /[0-9]{1,4}/',
}

# Prompts that quote their context (edit a given function, continue a listed table), where
# prompt-lookup drafts fire; the gate's lookup arms run them beside the fixed prompts.
QUOTING_FILE = Path(__file__).with_name("quoting_prompts.json")

# How each arm drafts: the MTP head alone; the head plus prompt-lookup blocks; and both with
# the per-request early stop below the depth ceiling.
DRAFTING = {
    "mtp": {},
    "lookup": {"lookup": LookupConfig()},
    "adaptive": {"lookup": LookupConfig(), "draft_stop": DraftStopConfig()},
}


def load_quoting_prompts(path: str | Path | None = None) -> list[str]:
    return load_prompts(path or QUOTING_FILE)


@dataclass
class ArmResult:
    mode: str
    depth: int
    processors: bool = False
    drafting: str = "mtp"
    prompts: int = 0
    identical: int = 0
    tokens_compared: int = 0
    flips: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    guarded: int = 0
    first_divergence: dict | None = None
    seconds: float = 0.0
    lookup_cycles: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    batch_rows: int = 0  # the batched arms' height (fidelity_batch.py); 0: one request alone
    constraint: str = ""  # the constraint kind both sides decoded under ("": none)
    resumed_at: list[int] = field(default_factory=list)  # prefix-cache arms: tokens each hit reused

    @property
    def flips_per_1000(self) -> float:
        return 1000.0 * self.flips / max(1, self.tokens_compared)

    @property
    def acceptance(self) -> float:
        return self.accepted / max(1, self.drafted)

    def compare(self, serial: list[int], got: list[int], max_tokens: int, **where) -> None:
        """Count one prompt's tokens against serial decode's: identical, or a flip at the
        first token that differs (tokens compared up to it). The arm's first flip is kept
        with ``where`` it happened (its prompt, a batched row) and the serial context."""
        self.prompts += 1
        diverge = next((i for i, (a, b) in enumerate(zip(serial, got)) if a != b), None)
        if diverge is None:
            self.identical += 1
            self.tokens_compared += max_tokens
            return
        self.flips += 1
        self.tokens_compared += diverge + 1
        if self.first_divergence is None:
            self.first_divergence = {**where, "token": diverge, "serial": serial[diverge],
                                     "speculative": got[diverge], "context": serial[max(0, diverge - 8) : diverge]}


@dataclass
class DistributionResult:
    depth: int
    position: int  # which output token is tested (0: first, 1: second)
    draws: int
    bins: int
    chi2: float
    df: int
    p_value: float
    alpha: float
    passed: bool
    accepted_fraction: float
    processors: bool = False
    observed: dict = field(default_factory=dict)
    expected: dict = field(default_factory=dict)
    drafting: str = "mtp"


@dataclass
class DeviationResult:
    """Verify (M = k+1) logits vs serial (M = 1) logits over the same tokens."""

    depth: int
    positions: int
    max_abs: float
    max_rel: float  # max |dlogit| / max(1, |top1 logit|): comparable with the guard
    argmax_flips: int  # positions where the two argmaxes differ

    def headroom(self, guard: float) -> float:
        """guard / (2 * max_rel): > 1 means no observed deviation could cross the guard."""
        return float("inf") if self.max_rel == 0 else guard / (2 * self.max_rel)


@dataclass
class FidelityReport:
    model: str
    rollback: str
    guard_margin: float | None  # None: exact mode ran without the guard (verify bit-identical)
    max_tokens: int
    arms: list[ArmResult] = field(default_factory=list)
    distribution: list[DistributionResult] = field(default_factory=list)
    deviation: list[DeviationResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        exact_ok = all(a.identical == a.prompts for a in self.arms if a.mode == "exact")
        return exact_ok and all(d.passed for d in self.distribution)

    def to_json(self) -> dict:
        out = asdict(self)
        for arm, d in zip(self.arms, out["arms"]):
            d["flips_per_1000"] = arm.flips_per_1000
            d["acceptance"] = arm.acceptance
        for dev, d in zip(self.deviation, out["deviation"]):
            h = dev.headroom(self.guard_margin or DEFAULT_GUARD)
            d["guard_headroom"] = None if math.isinf(h) else h  # None: no deviation at all
        out["passed"] = self.passed
        return out


def _sampler(lm: LoadedModel, params: SamplingParams, prompt: list[int], constraint: str = "") -> Sampler:
    """A request's sampler; under ``constraint`` (a CONSTRAINTS kind) a fresh matcher."""
    c = compile_constraint(lm, constraint, CONSTRAINTS[constraint]) if constraint else None
    return Sampler(params, prompt=prompt, constraint=c)


def _serial_tokens(lm: LoadedModel, prompt: list[int], n: int, params: SamplingParams = SamplingParams(),
                   constraint: str = "", cache: list | None = None, context: list[int] | None = None) -> list[int]:
    """Serial decode's first ``n`` tokens after ``prompt`` (one forward of it), or, with
    ``cache`` holding ``context`` but its last token, after that token."""
    gen = serial_decode(lm, prompt, _sampler(lm, params, context or prompt, constraint), cache=cache)
    return [t for s in itertools.islice(gen, n) for t in s.tokens]


def run_fidelity_gate(
    lm: LoadedModel,
    head,
    prompts: list[str] | list[list[int]],
    depths=(1, 2, 3, 4),
    max_tokens: int = 48,
    modes=("exact", "fast"),
    rollback: str = DEFAULT_ROLLBACK,
    guard_margin: float | None = DEFAULT_GUARD,
    logit_jitter: float = 0.0,
    params: SamplingParams = SamplingParams(),
    report: FidelityReport | None = None,
    drafting=("mtp",),
    quoting: list[str] | list[list[int]] = (),
    pipeline: bool | None = None,
    progress: Progress | None = None,
    constraint: str = "",
) -> FidelityReport:
    """Serial vs speculative at temperature 0, for each drafting variant, mode and depth,
    both decoding with ``params`` (temperature 0 plus any logit processors) and, when
    ``constraint`` names one of CONSTRAINTS, under that constraint. Arms that use
    prompt lookup also run the ``quoting`` prompts (where lookup fires). Arms are appended to
    ``report``; ``progress`` hears of every prompt each arm (and the serial reference) decodes."""
    if params.temperature != 0.0:
        raise ValueError("the token-identity gate runs at temperature 0")
    rollback = resolve_rollback(rollback)
    if report is None:
        report = FidelityReport(model=str(lm.path), rollback=rollback, guard_margin=guard_margin, max_tokens=max_tokens)
    encoded = [p if isinstance(p, list) else lm.encode_prompt(p, None, None) for p in prompts]
    encoded_q = [p if isinstance(p, list) else lm.encode_prompt(p, None, None) for p in quoting]
    progress = progress or Quiet()
    processors = params.processes_logits
    arms = list(itertools.product(drafting, modes, depths))
    with_lookup = sum(1 for variant, _, _ in arms if "lookup" in DRAFTING[variant])
    need_q = with_lookup > 0
    progress.add(len(encoded) + (len(encoded_q) if need_q else 0)
                 + len(arms) * len(encoded) + with_lookup * len(encoded_q))
    tag = " +processors" if processors else ""
    refs, refs_q = [], []
    for group, out in ((encoded, refs), (encoded_q if need_q else [], refs_q)):
        for i, p in enumerate(group):
            progress.step(f"serial reference{tag}, prompt {i + 1}/{len(group)}")
            out.append(_serial_tokens(lm, p, max_tokens, params, constraint))
    for variant, mode, depth in arms:
        options = DRAFTING[variant]
        pairs = list(zip(encoded, refs)) + (list(zip(encoded_q, refs_q)) if "lookup" in options else [])
        arm = ArmResult(mode=mode, depth=depth, drafting=variant, processors=processors, constraint=constraint)
        t0 = time.perf_counter()
        for pi, (prompt, ref) in enumerate(pairs):
            progress.step(f"arm {variant} {mode} depth {depth}{tag}, prompt {pi + 1}/{len(pairs)}")
            got: list[int] = []
            gen = speculative_decode(
                lm, head, prompt, _sampler(lm, params, prompt, constraint), depth, exact=(mode == "exact"),
                guard_margin=guard_margin, rollback=rollback, logit_jitter=logit_jitter, pipeline=pipeline, **options,
            )
            for step in gen:
                got += step.tokens
                arm.cycles += 1
                arm.drafted += step.drafted
                arm.accepted += step.accepted
                arm.guarded += step.guarded
                if step.draft_source == "lookup":
                    arm.lookup_cycles += 1
                    arm.lookup_drafted += step.drafted
                    arm.lookup_accepted += step.accepted
                if len(got) >= max_tokens:
                    break
            gen.close()
            arm.compare(ref, got[:max_tokens], max_tokens, prompt=pi)
        arm.seconds = time.perf_counter() - t0
        report.arms.append(arm)
    return report


def batch_deviation(lm: LoadedModel, prompts: list[list[int]], depths=(1, 2, 3, 4), max_tokens: int = 48) -> list[DeviationResult]:
    """How far the verify's numerics stray from serial's: replay each prompt's serial
    continuation once with one-token steps and once in verify-sized chunks of k+1 tokens
    (every draft accepted, so the batched cache drift accumulates as in speculation), and
    compare the logits at every position. On CPU both are usually bit-identical; on a GPU
    this is the number the exact guard must cover (headroom > 1)."""
    from ..engine.prefill.prefill import prefill

    def logits_of(prompt, cont, chunk):
        cache = lm.make_cache()
        seq = mx.array([prompt[-1]] + cont[:-1], dtype=mx.uint32)
        prefill(lm, prompt, cache)
        outs = []
        for i in range(0, seq.size, chunk):
            lg = lm.logits(lm.hidden(seq[None, i : i + chunk], cache))[0].astype(mx.float32)
            mx.eval(lg)
            outs.append(lg)
        return mx.concatenate(outs, axis=0)

    conts = [_serial_tokens(lm, p, max_tokens) for p in prompts]
    serial_logits = [logits_of(p, c, 1) for p, c in zip(prompts, conts)]
    results = []
    for k in depths:
        max_abs = max_rel = 0.0
        flips = n = 0
        for p, c, ref in zip(prompts, conts, serial_logits):
            got = logits_of(p, c, k + 1)
            diff = mx.abs(got - ref).max(axis=-1)
            scale = mx.maximum(mx.abs(ref.max(axis=-1)), 1.0)
            max_abs = max(max_abs, diff.max().item())
            max_rel = max(max_rel, (diff / scale).max().item())
            flips += (mx.argmax(got, axis=-1) != mx.argmax(ref, axis=-1)).sum().item()
            n += ref.shape[0]
        results.append(DeviationResult(depth=k, positions=n, max_abs=max_abs, max_rel=max_rel, argmax_flips=flips))
    return results


# -- temperature > 0 ---------------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """Upper tail of the chi-square distribution, Wilson-Hilferty approximation."""
    if df <= 0:
        return 1.0
    if x <= 0:
        return 1.0
    c = 2.0 / (9.0 * df)
    z = ((x / df) ** (1.0 / 3.0) - (1.0 - c)) / math.sqrt(c)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def base_distribution(lm: LoadedModel, prompt: list[int], params: SamplingParams, output: list[int] = ()) -> list[float]:
    """p after ``prompt`` + ``output`` (output tokens count for the processors): serial step
    numerics, the request's processors and sampler transforms."""
    gen_sampler = Sampler(params, prompt=prompt)
    gen_sampler.commit(list(output))
    cache = lm.make_cache()
    from ..engine.prefill.prefill import prefill

    last = prefill(lm, list(prompt) + list(output), cache)
    logits = gen_sampler.process(lm.logits(lm.hidden(last[None], cache))[:, -1, :])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.exp(gen_sampler.log_distribution(logprobs).astype(mx.float32))[0]
    return p.tolist()


def second_token_distribution(lm: LoadedModel, prompt: list[int], params: SamplingParams, max_branches: int = 64) -> list[float]:
    """The marginal of the second sampled token: sum over y of p(y) p(. | prompt + y)."""
    p1 = base_distribution(lm, prompt, params)
    branches = [(y, py) for y, py in enumerate(p1) if py > 1e-6]
    if len(branches) > max_branches:
        raise ValueError(f"{len(branches)} first tokens carry mass; use top-k <= {max_branches} to test position 1")
    out = [0.0] * len(p1)
    for y, py in branches:
        for x, px in enumerate(base_distribution(lm, prompt, params, output=[y])):
            out[x] += py * px
    total = sum(out)
    return [v / total for v in out]


def lookup_context(lm: LoadedModel, prompt: list[int], params: SamplingParams, ngram: int | None = None) -> list[int]:
    """A context on which prompt lookup proposes a block at once: ``prompt + [b, c] + tail``,
    where ``tail`` is the prompt's last ``ngram`` tokens, so the lookup proposes ``b, c, ...``.
    b is the token among the base's top candidates that the base gives the most probability
    after the whole context, so the test sees both branches: the point-mass draft accepted
    (probability p(b)) and rejected (a sample from p without b)."""
    n = ngram or LookupConfig().max_ngram
    tail = prompt[-n:]
    p0 = base_distribution(lm, prompt, params)
    candidates = sorted(range(len(p0)), key=lambda i: -p0[i])[:6]
    scored = []
    for b in candidates:
        ctx = prompt + [b, candidates[0]] + tail
        scored.append((abs(base_distribution(lm, ctx, params)[b] - 0.5), ctx))
    return min(scored)[1]


def chi_square_bins(counts: dict[int, int], p: list[float], draws: int, min_expected: float = 5.0):
    order = sorted(range(len(p)), key=lambda i: -p[i])
    bins = [i for i in order if p[i] * draws >= min_expected]
    rest_p = 1.0 - sum(p[i] for i in bins)
    rest_obs = draws - sum(counts.get(i, 0) for i in bins)
    obs = [counts.get(i, 0) for i in bins]
    exp = [p[i] * draws for i in bins]
    if rest_p * draws >= min_expected:
        obs.append(rest_obs)
        exp.append(rest_p * draws)
    elif bins:  # too little mass for its own bin: pool it into the smallest
        obs[-1] += rest_obs
        exp[-1] += rest_p * draws
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return bins, obs, exp, chi2, len(obs) - 1


def distribution_test(
    lm: LoadedModel,
    head,
    prompt: list[int],
    params: SamplingParams,
    depth: int,
    draws: int = 2000,
    alpha: float = 1e-3,
    seed: int = 0,
    rollback: str = DEFAULT_ROLLBACK,
    position: int = 0,
    drafting: str = "mtp",
) -> DistributionResult:
    """Output token ``position`` (0 or 1) of a fresh speculative request, ``draws`` times,
    vs the base model's distribution for it (chi-square). Position 0 tests the accept /
    residual rule at the first draft; position 1 also covers later draft positions, the
    bonus token and a second cycle after a rollback. ``drafting`` "lookup" verifies prompt-lookup
    blocks (point-mass proposals) where the context offers one (``lookup_context`` builds
    such a context)."""
    p = base_distribution(lm, prompt, params) if position == 0 else second_token_distribution(lm, prompt, params)
    counts: dict[int, int] = {}
    accepted = 0
    for i in range(draws):
        sampler = Sampler(replace(params, seed=seed * 1_000_003 + i), prompt=prompt)
        gen = speculative_decode(lm, head, prompt, sampler, depth, rollback=rollback, **DRAFTING[drafting])
        out: list[int] = []
        first = None
        while len(out) <= position:
            step = next(gen)
            if first is None:
                first = step
            out += step.tokens
        gen.close()
        counts[out[position]] = counts.get(out[position], 0) + 1
        accepted += first.accepted > 0
    bins, obs, exp, chi2, df = chi_square_bins(counts, p, draws)
    pv = chi2_sf(chi2, df)
    labels = [str(b) for b in bins] + (["rest"] if len(obs) > len(bins) else [])
    return DistributionResult(
        depth=depth, drafting=drafting, position=position, draws=draws, bins=len(obs), chi2=chi2, df=df, p_value=pv,
        alpha=alpha, passed=pv >= alpha, accepted_fraction=accepted / draws, processors=params.processes_logits,
        observed=dict(zip(labels, obs)), expected={k: round(v, 2) for k, v in zip(labels, exp)},
    )


# -- CLI --------------------------------------------------------------------------------------------


def format_report(report: FidelityReport) -> str:
    lines = [
        f"fidelity gate: {report.model}  (rollback={report.rollback}, guard="
        f"{'off (verify bit-identical)' if report.guard_margin is None else f'{report.guard_margin:g}'}, "
        f"{report.max_tokens} tokens/prompt)",
        "",
        "| drafting | mode | processors | constraint | depth | identical | tokens | flips/1000 | acceptance | guarded | lookup cycles (accepted/drafted) | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in report.arms:
        lk = f"{a.lookup_cycles} ({a.lookup_accepted}/{a.lookup_drafted})" if a.lookup_cycles else "-"
        lines.append(
            f"| {a.drafting} | {a.mode} | {'on' if a.processors else 'off'} | {a.constraint or '-'} | {a.depth} | {a.identical}/{a.prompts} | {a.tokens_compared} | "
            f"{a.flips_per_1000:.2f} | {a.acceptance:.3f} | {a.guarded} | {lk} | {a.seconds:.1f} |"
        )
    for a in report.arms:
        if a.first_divergence and a.mode == "exact":
            d = a.first_divergence
            lines.append(
                f"FAIL exact {a.drafting}{' with processors' if a.processors else ''}"
                f"{f' under {a.constraint}' if a.constraint else ''} depth {a.depth}: prompt {d['prompt']} token {d['token']}: serial {d['serial']} "
                f"!= speculative {d['speculative']} (after {d['context']})"
            )
    if report.deviation:
        lines += ["", "| verify vs serial logits, depth | positions | max abs | max rel | argmax flips | guard headroom |",
                  "|---|---|---|---|---|---|"]
        for d in report.deviation:
            lines.append(f"| {d.depth} | {d.positions} | {d.max_abs:.4g} | {d.max_rel:.4g} | {d.argmax_flips} | "
                         f"{d.headroom(report.guard_margin or DEFAULT_GUARD):.3g} |")
    if report.distribution:
        lines += ["", "| temperature>0 drafting | depth | processors | output token | draws | bins | chi2 | df | p-value | alpha | first-position accepts | result |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in report.distribution:
            lines.append(
                f"| {d.drafting} | {d.depth} | {'on' if d.processors else 'off'} | {d.position + 1} | {d.draws} | {d.bins} | {d.chi2:.2f} | {d.df} | {d.p_value:.4f} | {d.alpha:g} | "
                f"{d.accepted_fraction:.3f} | {'pass' if d.passed else 'FAIL'} |"
            )
    lines.append("")
    lines.append("PASS" if report.passed else "FAIL")
    return "\n".join(lines)


def default_model_path() -> Path:
    from ..paths import resolve_model

    return Path(resolve_model(None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild gate fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the bundled model, else the random one)")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--prompts", help=f"prompt file (default {PROMPTS_FILE.name})")
    ap.add_argument("--drafting", default="mtp,lookup,adaptive",
                    help="drafting variants: mtp (head only), lookup (+ prompt lookup), adaptive (+ per-request depth)")
    ap.add_argument("--quoting", help=f"prompts that quote their context, for the lookup arms (default {QUOTING_FILE.name})")
    ap.add_argument("--rollback", default=DEFAULT_ROLLBACK, choices=("auto", "capture", "snapshot"))
    ap.add_argument("--guard", default="probe",
                    help="exact-mode guard (relative top-2 margin), or 'probe' (default): as the daemon runs it, "
                         f"off where the start-up probe finds verify bit-identical to serial steps, else {DEFAULT_GUARD:g}")
    ap.add_argument("--draws", type=int, default=1000, help="temperature>0 draws per depth (0: skip)")
    ap.add_argument("--sample-depths", default="1,2")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--alpha", type=float, default=1e-3)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--no-processors", dest="processors", action="store_false",
                    help="skip the arms with logit processors (penalties, logit_bias)")
    ap.add_argument("--constraints", default="",
                    help=f"also run the exact and fast arms under these constraints ({','.join(CONSTRAINTS)}), "
                         "against constrained serial decode")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="decode eagerly (no compiled one-token forward), to tell the two paths apart")
    ap.add_argument("--no-deviation", dest="deviation", action="store_false",
                    help="skip measuring verify-vs-serial logit deviation (informs the guard)")
    ap.add_argument("--logit-jitter", type=float, default=0.0,
                    help="fault injection: noise on the verify's logprobs, to prove the gate can fail")
    ap.add_argument("--pipeline", choices=("auto", "on", "off"), default="auto",
                    help="speculation builds each cycle ahead (on), not (off), or as the daemon does (auto: on a GPU)")
    ap.add_argument("--batched", default="2,4,8",
                    help="batch heights of the batched arms (rows speculating together in the continuous batch); "
                         "'' skips them")
    ap.add_argument("--kernels", choices=("auto", "mlx", "invariant"), default="auto",
                    help="the forward's kernels, chosen as the daemon chooses them (engine_thread/kernel_choice.py): "
                         "auto keeps MLX's where the probes prove them invariant, else tries the invariant ones")
    ap.add_argument("--prefix-chunk", type=int, default=32,
                    help="the prefix-cache arms' prefill chunk (fidelity_prefix.py: exact requests resumed off the "
                         "chunk grid, where the split probe allows it); 0 skips them")
    ap.add_argument("--no-riding", action="store_true",
                    help="leave out the batched arms' 'pieces riding' twins (prompts prefilled in pieces carried by the "
                         "batch's depth-0 forwards, scheduler.mixed_steps)")
    ap.add_argument("--batched-only", action="store_true",
                    help="run only the batched arms (no solo arms, deviation or temperature>0 tests)")
    args = ap.parse_args(argv)
    pipeline = {"auto": None, "on": True, "off": False}[args.pipeline]

    from ..engine.model.loading import load_model
    from ..engine.model.mtp_head import NoMTPHead, load_mtp_head

    path = Path(args.model) if args.model else default_model_path()
    lm = load_model(path, compile_decode=args.compile)
    choice = choose_kernels(lm, args.kernels, rollback=resolve_rollback(args.rollback),
                            rows=max([1] + [int(b) for b in args.batched.split(",") if b]), ragged=bool(args.batched),
                            compile_decode=args.compile)
    print(f"kernels: {choice.kernels} ({choice.reason})", file=sys.stderr)
    print(f"decode path: {lm.decode_path}; GatedDeltaNet recurrence: {lm.recurrence}; projections: {lm.linears}",
          file=sys.stderr)
    try:
        head = load_mtp_head(lm)
    except NoMTPHead as exc:
        print(f"councild gate fidelity: {exc}", file=sys.stderr)
        return 1
    prompts = load_prompts(args.prompts)
    if args.guard == "probe":
        from ..engine.decoders.exactness import exact_guard

        guard = exact_guard(lm, args.rollback, DEFAULT_GUARD)
        print(f"exact-mode guard: {'off (the probe finds verify bit-identical to serial steps)' if guard is None else guard}",
              file=sys.stderr)
    else:
        guard = float(args.guard)
    modes = tuple(args.modes.split(","))
    report = FidelityReport(model=str(lm.path), rollback=resolve_rollback(args.rollback), guard_margin=guard,
                            max_tokens=args.tokens)
    if args.batched:
        report.arms += run_batched_arms(
            lm, head, prompts, ArmResult, _serial_tokens, PROCESSORS if args.processors else None,
            heights=[int(b) for b in args.batched.split(",")], max_tokens=args.tokens, modes=modes,
            depth=max(int(d) for d in args.depths.split(",")), riding=not args.no_riding,
            lookup=LookupConfig(max_draft=8))
    if args.batched_only:
        print(format_report(report))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
        return 0 if report.passed else 1
    # One line per prompt decoded on stderr (the report stays on stdout). The token-identity
    # arms count their own steps; the deviation and sampling phases are counted here.
    progress = Progress("fidelity", 0)
    report = run_fidelity_gate(
        lm, head, prompts, depths=[int(d) for d in args.depths.split(",")], max_tokens=args.tokens,
        modes=modes, rollback=args.rollback, guard_margin=guard,
        logit_jitter=args.logit_jitter, drafting=tuple(args.drafting.split(",")),
        quoting=load_quoting_prompts(args.quoting), pipeline=pipeline, report=report, progress=progress,
    )
    if args.processors and "exact" in args.modes.split(","):
        run_fidelity_gate(
            lm, head, prompts, depths=[int(d) for d in args.depths.split(",")], max_tokens=args.tokens,
            modes=("exact",), rollback=args.rollback, guard_margin=guard, logit_jitter=args.logit_jitter,
            params=SamplingParams(**PROCESSORS), report=report, drafting=tuple(args.drafting.split(",")),
            quoting=load_quoting_prompts(args.quoting), pipeline=pipeline, progress=progress,
        )
    for kind in [k for k in args.constraints.split(",") if k]:
        if kind not in CONSTRAINTS:
            ap.error(f"unknown constraint {kind!r} (known: {', '.join(CONSTRAINTS)})")
        run_fidelity_gate(
            lm, head, prompts, depths=[int(d) for d in args.depths.split(",")], max_tokens=args.tokens,
            modes=tuple(args.modes.split(",")), rollback=args.rollback, guard_margin=guard,
            logit_jitter=args.logit_jitter, report=report, drafting=tuple(args.drafting.split(",")),
            quoting=load_quoting_prompts(args.quoting), pipeline=pipeline, constraint=kind,
        )
    if args.prefix_chunk and "exact" in modes:
        from .fidelity_prefix import run_prefix_arms

        arms, exact_here = run_prefix_arms(lm, head, prompts, ArmResult, _serial_tokens, chunk=args.prefix_chunk,
                                           max_tokens=args.tokens, depth=max(int(d) for d in args.depths.split(",")),
                                           rollback=args.rollback, guard_margin=guard)
        report.arms += arms
        if not exact_here:
            print(f"prefix-cache arms: not run: splits at {args.prefix_chunk}-token chunks are not bit-identical "
                  "here, so exact requests reuse on the chunk grid only", file=sys.stderr)
    if args.deviation:
        progress.step(f"verify-vs-serial logit deviation, {min(3, len(prompts))} prompts")
        report.deviation = batch_deviation(
            lm, [lm.encode_prompt(p, None, None) for p in prompts[:3]], [int(d) for d in args.depths.split(",")], args.tokens
        )
    if args.draws > 0:
        variants = args.drafting.split(",")
        progress.add(2 * (len(args.sample_depths.split(",")) + bool(args.processors)
                          + ("lookup" in variants) + ("adaptive" in variants)))
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k)
        ctx = lm.encode_prompt(prompts[0], None, None)
        runs = [(params, d) for d in (int(x) for x in args.sample_depths.split(","))]
        if args.processors:  # once more, with the processors, at the first sample depth
            runs.append((replace(params, **PROCESSORS), runs[0][1]))
        for run_params, d in runs:
            for pos in (0, 1):
                progress.step(f"sampling distribution depth {d}, position {pos}, {args.draws} draws")
                report.distribution.append(distribution_test(
                    lm, head, ctx, run_params, d, draws=args.draws, alpha=args.alpha, rollback=args.rollback, position=pos,
                ))
        if "lookup" in variants:
            # A context whose tail recurs, so the first cycles verify point-mass lookup blocks.
            lctx = lookup_context(lm, ctx, params)
            for pos in (0, 1):
                progress.step(f"sampling distribution, lookup drafts, position {pos}, {args.draws} draws")
                report.distribution.append(distribution_test(
                    lm, head, lctx, params, 1, draws=args.draws, alpha=args.alpha, rollback=args.rollback,
                    position=pos, drafting="lookup",
                ))
        if "adaptive" in variants:
            # Head cycles under a ceiling of 3 that may stop early (and lookup where it fires).
            for pos in (0, 1):
                progress.step(f"sampling distribution, adaptive drafts, position {pos}, {args.draws} draws")
                report.distribution.append(distribution_test(
                    lm, head, ctx, params, 3, draws=args.draws, alpha=args.alpha, rollback=args.rollback,
                    position=pos, drafting="adaptive",
                ))
    progress.finish(f"{sum(a.prompts for a in report.arms)} speculative decodes, "
                    f"{sum(a.flips for a in report.arms)} flips, {'PASS' if report.passed else 'FAIL'}")
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
