"""Run under `mpirun -n 2`: rank 0 serves through a started Scheduler that stays idle for several collective
timeouts before a request arrives; rank 1 follows. Prints the output ids on rank 0."""

import json
import sys
import time

from trt_redrafter.config import SamplingConfig
from trt_redrafter.runtime.distributed import COLLECTIVE_TIMEOUT_S, init_dist, shutdown_dist
from trt_redrafter.runtime.engine import Engine
from trt_redrafter.runtime.scheduler import Request, Scheduler, follow
from trt_redrafter.runtime.sequence import RequestSpec

engine_dir, prompt = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
dist = init_dist(2, "cpu")
engine = Engine.load(engine_dir, dist)
if dist.is_driver:
    sched = Scheduler(engine).start()
    time.sleep(3 * COLLECTIVE_TIMEOUT_S)  # idle: only heartbeats reach the follower
    req = sched.submit(Request("r", RequestSpec(prompt, SamplingConfig(max_tokens=12))))
    assert req.done.wait(120), "the request did not finish"
    sched.stop()
    print(json.dumps(req.seq.output), flush=True)
else:
    follow(engine)
shutdown_dist()
