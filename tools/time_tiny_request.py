"""Median wall time of a tiny-model request (64x64, 8 steps, CFG, one thread, paged): python tools/time_tiny_request.py"""
import time, torch
from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
torch.set_num_threads(1)
e = Engine(EngineConfig(device="cpu", diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, block_size=16, num_kv_blocks=256, profile_memory=False))
r = lambda i: GenerationRequest(prompt="a large blue square", height=64, width=64, steps=8, seed=i)
e.generate(r(0))
ts=[]
for i in range(5):
    t=time.perf_counter(); e.generate(r(i)); ts.append(time.perf_counter()-t)
print(sorted(ts)[2])
