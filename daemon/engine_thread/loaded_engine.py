"""The engine start-up built (startup.py), as the engine thread's parts share it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .head_slot import HeadSlot


@dataclass
class LoadedEngine:
    """What start-up built, shared by the engine thread's parts: the model, the head slot,
    the probes' answers, the continuous batch, the prefix cache and the governance. A
    tensor-parallel follower adopts rank 0's answers here (daemon/distributed/lockstep.py)."""

    lm: Any = None
    # The MTP head and the depth it drafts at (head_slot.py); governance changes it between
    # cycles, the engine thread reads it every cycle.
    slot: HeadSlot | None = None
    max_prompt_tokens: int = 0  # the model's context once loaded
    # One request's caches at that context (engine/caches/cache_size.py): the governor admits
    # another row only while the headroom holds it (governor/row_limit.py).
    row_cache_bytes: int = 0
    # Whether a verify reproduces serial steps bit for bit here; None until the start-up's
    # verdict is in (warming.py): exact greedy requests then decode serially.
    verify_exact: bool | None = True
    verdicts: Any = None
    batch: Any = None
    # Whether the continuous batch speculates (engine/decoders/batch_spec.py) or decodes at depth 0.
    batch_speculates: bool = False
    prefix_cache: Any = None  # reopened when SIGHUP changes the chunk (prefix_cache_use.py)
    # Prompts' pieces prefilled in one forward (engine/prefill/batched_prefill.py): None when off, else
    # whether exact greedy requests may join (the start-up probe's verdict).
    prefill_together_exact: bool | None = None
    # Decode forwards carrying a prompt's paced piece (engine/prefill/mixed_forward.py): None when off,
    # else whether exact greedy rows and prompts may (the start-up probe's verdict).
    mixed_exact: bool | None = None
    governance: Any = None
    # `councild tune`'s profile when the governor loaded one (governance.py): per sampling
    # setting, the best depth measured, which caps a request's depth.
    tuned_profile: dict | None = None
