"""Print the config of a Communicator built without one, as a user's script builds it under
``commfuse launch`` or torchrun: one line ``CONFIG {...}`` per rank."""

import dataclasses
import json
import sys

import torch.distributed as dist

from commfuse.comm import Communicator

dist.init_process_group("gloo")
comm = Communicator()
# One write per line: print() writes the text and its newline apart when the launcher runs
# Python unbuffered, and two ranks' lines on one pipe could then interleave.
sys.stdout.write(
    "CONFIG " + json.dumps({"rank": comm.rank, **dataclasses.asdict(comm.config)}) + "\n"
)
sys.stdout.flush()
dist.destroy_process_group()
