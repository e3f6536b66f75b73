"""Does an MTP head fit its base? Greedy depth-1 speculation over the first few fixed prompts.

`councild model pull --head` runs it before it keeps a head (models/pull.py), and the
measurement wing reads the same prompt suite (measure/fidelity.py). It sits beside both,
below either, so neither reaches up into the other. The prompts are data
(measure/fidelity_prompts.json, shipped as package data), read here, not imported.
"""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "measure" / "fidelity_prompts.json"
MIN_ACCEPTANCE = 0.1  # well-paired heads measure 0.6-0.98 at depth 1; a foreign trunk ~0
CHECK_PROMPTS = 4
CHECK_TOKENS = 32


def load_prompts(path: str | Path | None = None) -> list[str]:
    """The fixed prompt suite (or another file of the same shape: a list, or {"prompts": [...]})."""
    data = json.loads(Path(path or PROMPTS_FILE).read_text())
    return list(data["prompts"] if isinstance(data, dict) else data)


def acceptance_check(folder: Path, head_dir: Path, prompts: int = CHECK_PROMPTS,
                     tokens: int = CHECK_TOKENS) -> tuple[float, int, int]:
    """Greedy depth-1 speculation with the base in ``folder`` and the head in ``head_dir``
    over the first few fixed prompts. Returns (acceptance, accepted, drafted)."""
    # The engine (and mlx) load only when a check runs: `councild model pull` without one,
    # and the CLI's start, stay light.
    from daemon.engine.model.loading import load_model
    from daemon.engine.model.mtp_head import load_mtp_head
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.speculative import speculative_decode
    from daemon.engine.types import SamplingParams

    lm = load_model(folder, compile_decode=False)
    head = load_mtp_head(lm, head_dir)
    drafted = accepted = 0
    for text in load_prompts()[:prompts]:
        gen = speculative_decode(lm, head, lm.encode_prompt(text, None, None), Sampler(SamplingParams()), 1)
        got = 0
        for step in gen:
            drafted += step.drafted
            accepted += step.accepted
            got += len(step.tokens)
            if got >= tokens:
                break
        gen.close()
    return (accepted / drafted if drafted else 0.0), accepted, drafted
