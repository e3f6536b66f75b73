"""`councild model pull|inspect|list`."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Models on disk and on the Hugging Face Hub. A model reference is a folder, or a Hub repo id
org/name[@revision] resolved in the Hugging Face cache (HF_HOME / HF_HUB_CACHE; HF_TOKEN for
private or gated repos; HF_ENDPOINT for a mirror; HF_HUB_OFFLINE=1 to never touch the network).
`councild serve --model org/name` serves a pulled repo; the daemon itself never downloads.
"""

PULL_EPILOG = """\
mlx-community conversions drop the MTP head (mtp.*), which speculation needs. --mtp-from
names the checkpoint the conversion was made from (e.g. Qwen/Qwen3.5-27B): only the shard(s)
of it that hold the head are fetched, the head is checked against the base's shapes,
quantized like the base, tried at depth 1 on a few prompts (the acceptance is printed), and
written beside the model as mtp.safetensors with its provenance in the file's metadata. A head
accepted less than --min-acceptance of the time (one trained with another trunk) is refused.
exit codes: 0 ok, 1 the pull or the head failed (the message says why), 2 bad usage.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="councild model", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    pull = sub.add_parser("pull", help="download a Hub repo into the cache (and add an MTP head)",
                          description="Download REPO into the Hugging Face cache with progress, check every file "
                                      "against the Hub's checksums, and optionally add an MTP head.",
                          epilog=PULL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    pull.add_argument("repo", help="org/name[@revision]")
    pull.add_argument("--mtp-from", metavar="SOURCE", help="repo id or folder whose safetensors hold the head (mtp.*)")
    pull.add_argument("--no-check", action="store_true", help="skip the depth-1 acceptance check of the head")
    pull.add_argument("--min-acceptance", type=float, default=None,
                      help="refuse a head accepted less often than this at depth 1 (default 0.1)")
    pull.add_argument("--check-tokens", type=int, default=None,
                      help="tokens per prompt in the acceptance check (default 32, 4 prompts)")
    ins = sub.add_parser("inspect", help="architecture, size, quantization, MTP head and memory estimate",
                         description="What a model is and whether it fits this machine, read from its config and "
                                     "safetensors headers (nothing is loaded). A repo id not in the cache is read "
                                     "from the Hub (config and headers only).")
    ins.add_argument("model", help="folder or org/name[@revision]")
    ins.add_argument("--json", action="store_true")
    ls = sub.add_parser("list", help="models in the Hugging Face cache")
    ls.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .refs import ModelRefError

    try:
        if args.action == "pull":
            from .pull import CHECK_TOKENS, MIN_ACCEPTANCE, PullError, pull

            if args.check_tokens is not None and args.check_tokens < 1:
                print("councild: --check-tokens must be at least 1", file=sys.stderr)
                return 2
            try:
                pull(args.repo, mtp_from=args.mtp_from, check=not args.no_check,
                     min_acceptance=MIN_ACCEPTANCE if args.min_acceptance is None else args.min_acceptance,
                     check_tokens=args.check_tokens or CHECK_TOKENS)
            except PullError as exc:
                print(f"councild: {exc}", file=sys.stderr)
                return 1
            return 0
        if args.action == "inspect":
            from .inspect import format_inspect, inspect, machine_memory

            try:
                info = inspect(args.model)
            except ModelRefError:
                raise
            except Exception as exc:  # the Hub's errors, a damaged header: the message
                print(f"councild: cannot inspect {args.model}: {exc}", file=sys.stderr)
                return 1
            machine = machine_memory()
            print(json.dumps({**info, "machine": machine}, indent=2) if args.json else format_inspect(info, machine))
            return 0
        if args.action == "list":
            from .inspect import format_list, list_cached

            rows = list_cached()
            print(json.dumps(rows, indent=2) if args.json else format_list(rows))
            return 0
    except ModelRefError as exc:
        print(f"councild: {exc}", file=sys.stderr)
        return 1
    build_parser().print_help()
    return 2
