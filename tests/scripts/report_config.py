"""Print the config of a Communicator built without one, as a user's script builds it under
``commfuse launch`` or torchrun: one line ``CONFIG {...}`` per rank."""

import dataclasses
import json

import torch.distributed as dist

from commfuse.comm import Communicator

dist.init_process_group("gloo")
comm = Communicator()
print("CONFIG " + json.dumps({"rank": comm.rank, **dataclasses.asdict(comm.config)}), flush=True)
dist.destroy_process_group()
