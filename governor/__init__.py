"""councild's governor: how much memory speculation may use and how deep it may draft.

Pure where it matters: ``policy.decide`` is a function of (state, observation, now, config);
probes and the clock are injected; nothing here imports zmq, mlx or ``daemon``.
"""

from .config import GovernorConfig, LinuxThresholds, load_config
from .cost_model import CostModel
from .policy import apply_override, decide
from .probes import LinuxMemoryProbe, LoadTracker, MacMemoryProbe, MlxMemoryProbe, default_memory_probes
from .runtime import Governor
from .types import (
    Action,
    ClearCache,
    CycleTelemetry,
    DepthEstimate,
    EvictHead,
    LimitPromptCache,
    LoadHead,
    Observation,
    SetDepth,
    SetHeightDepth,
    SetMaxActive,
    ShedAdmissions,
    State,
)

__all__ = [
    "Action",
    "ClearCache",
    "CostModel",
    "CycleTelemetry",
    "DepthEstimate",
    "EvictHead",
    "Governor",
    "GovernorConfig",
    "LimitPromptCache",
    "LinuxMemoryProbe",
    "LinuxThresholds",
    "LoadHead",
    "LoadTracker",
    "MacMemoryProbe",
    "MlxMemoryProbe",
    "Observation",
    "SetDepth",
    "SetHeightDepth",
    "SetMaxActive",
    "ShedAdmissions",
    "State",
    "apply_override",
    "decide",
    "default_memory_probes",
    "load_config",
]
