"""Print this rank's torchrun contract as one JSON line: ``ENV {...}`` (no torch import)."""

import json
import os

KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)

print("ENV " + json.dumps({"pid": os.getpid(), **{k: os.environ.get(k) for k in KEYS}}))
