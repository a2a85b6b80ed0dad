import os

import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.engine.profiling import Envelope, default_envelope, profile_max_shape, residual_reserve
from ditkv.engine.sizing import CPU_MEMORY_ANALOGUE_BYTES, resolve_num_blocks
from ditkv.errors import AdmissionError, ConfigError
from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model
from ditkv.worker.dit_runner import DiTRunner
from ditkv.worker.page_pool import PagePool, bytes_per_block

CPU = torch.device("cpu")


def paged(**kw):
    return EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, **kw)


def test_bytes_per_block_release_geometry():
    # 32 layers x 2 x 8 heads x 64 tokens x 128 dims x 2 bytes = 8 MiB per block
    assert bytes_per_block(32, 8, 64, 128, torch.bfloat16) == 8 << 20


def test_sizing_from_each_knob():
    bpb = 1000
    assert resolve_num_blocks(paged(num_kv_blocks=7), bpb, CPU, 0)[0] == 7
    assert resolve_num_blocks(paged(kv_cache_memory_bytes=10_500), bpb, CPU, 10**9)[0] == 10  # bytes win
    n, why = resolve_num_blocks(paged(gpu_memory_utilization=0.5), bpb, CPU, 1000)
    assert n == (int(CPU_MEMORY_ANALOGUE_BYTES * 0.5) - 1000) // bpb and "gpu_memory_utilization" in why


def test_sizing_errors_give_the_numbers():
    with pytest.raises(ConfigError, match="no memory remains for the KV cache.*non-KV"):
        resolve_num_blocks(paged(gpu_memory_utilization=0.1), 1000, CPU, CPU_MEMORY_ANALOGUE_BYTES)
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes.*1000 bytes"):
        resolve_num_blocks(paged(kv_cache_memory_bytes=999), 1000, CPU, 0)


def test_envelope_defaults_and_rejection():
    tiny = HunyuanImage3Config.tiny()
    env = default_envelope(EngineConfig(), tiny)
    assert (env.max_height, env.max_width, env.max_prompt_tokens) == (128, 128, 256)
    assert default_envelope(EngineConfig(max_image_height=64), tiny).max_height == 64
    rel = default_envelope(EngineConfig(), HunyuanImage3Config.release())
    assert (rel.max_height, rel.max_prompt_tokens) == (1024, 1024)
    env.check(128, 64, 256)
    with pytest.raises(AdmissionError, match="envelope"):
        env.check(192, 64, 10)
    with pytest.raises(AdmissionError, match="max_prompt_tokens"):
        Envelope(64, 64, 10).check(64, 64, 11)


def test_profile_measures_non_kv_above_weights():
    m = HunyuanImage3Model.from_config(HunyuanImage3Config.tiny()).eval()
    res = profile_max_shape(DiTRunner(m, paged=False), m, ByteTokenizer(), Envelope(64, 64, 32))
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    assert res.non_kv_bytes >= weights and res.profile_kv_bytes > 0 and res.tokens == 2 * (32 + 6 + 256)


def test_the_startup_profile_is_auto_on_cuda_only_and_runs_on_cpu_when_asked(monkeypatch):
    """profile_memory unset = auto: a CUDA pool is sized after the max-shape profile; a CPU pool (sized
    against the fixed analogue) skips that prefill unless profile_memory=true."""
    from ditkv.engine import rank_setup
    from ditkv.models.loader import param_bytes

    cuda = torch.device("cuda")
    assert rank_setup.profiles_memory(EngineConfig(), cuda) and not rank_setup.profiles_memory(EngineConfig(), CPU)
    assert rank_setup.profiles_memory(EngineConfig(profile_memory=True), CPU)
    assert not rank_setup.profiles_memory(EngineConfig(profile_memory=False), cuda)
    with pytest.raises(ConfigError, match="auto, on CUDA only"):
        EngineConfig(profile_memory="auto")
    calls = []
    monkeypatch.setattr(rank_setup, "profile_non_kv_bytes", lambda *a, **k: calls.append(1) or 0)
    m = HunyuanImage3Model.from_config(HunyuanImage3Config.tiny()).eval()
    cfg = EngineConfig(device="cpu", block_size=16)
    n = rank_setup.plan_num_blocks(cfg, m, ByteTokenizer())
    per_block = rank_setup.kv_bytes_per_block(cfg, m.config, m.dtype)
    reserve = residual_reserve(cfg, m.config, ByteTokenizer(), m.dtype).total  # the step cache's residuals
    assert calls == [] and n == (int(CPU_MEMORY_ANALOGUE_BYTES * 0.9) - param_bytes(m) - reserve) // per_block
    rank_setup.plan_num_blocks(cfg.replace(profile_memory=True), m, ByteTokenizer())
    assert calls == [1]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc/self/statm")
def test_a_cpu_pool_reads_zero_and_takes_memory_only_where_written():
    """A CPU pool is sized to the analogue budget (~230 MB for the tiny model) while a request writes a
    few blocks of it: only written pages become resident (torch.zeros made all of them so)."""
    before = _resident_bytes()
    pool = PagePool(2048, 4, 2, 64, 32)  # 256 MiB of fp32
    pool.page(5).fill_(1.0)
    assert _resident_bytes() - before < 16 << 20
    assert pool.nbytes == 256 << 20 and pool.kv.is_contiguous() and pool.kv.data_ptr() % 64 == 0
    assert pool.kv[5].eq(1).all() and pool.kv[:5].count_nonzero() == 0 and pool.kv[6:].count_nonzero() == 0
    pid = os.fork()  # a forked child writes its own copy of the pages, as with torch's own allocations
    if pid == 0:
        pool.kv[0].fill_(7.0)
        os._exit(0)
    os.waitpid(pid, 0)
    assert pool.kv[0].count_nonzero() == 0


def _engine(**kw):
    from ditkv.engine.engine import Engine
    from ditkv.models.hunyuan import PixelCodec

    cfg = HunyuanImage3Config.tiny()
    bundle = (HunyuanImage3Model.from_config(cfg).eval(), ByteTokenizer(), PixelCodec(cfg.image_token_downsample))
    return Engine(paged(**kw), model_bundle=bundle), bundle[0]


def test_engine_sizes_pool_from_bytes_and_from_utilization():
    e, m = _engine(kv_cache_memory_bytes=10 * bytes_per_block(4, 2, 64, 32, torch.float32) + 5)
    assert e.num_blocks == 10
    e2, _ = _engine(gpu_memory_utilization=0.5, max_image_height=64, max_image_width=64)
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    bpb = bytes_per_block(4, 2, 64, 32, torch.float32)
    assert 0 < e2.num_blocks <= (int(CPU_MEMORY_ANALOGUE_BYTES * 0.5) - weights) // bpb
    assert e2.manager.max_model_len == e2.num_blocks * 64  # max_model_len=-1 fits the pool


def test_engine_rejects_requests_outside_the_profiled_envelope():
    from ditkv.engine.types import GenerationRequest

    e, _ = _engine(num_kv_blocks=200, max_image_height=64, max_image_width=64, max_prompt_tokens=20)
    with pytest.raises(AdmissionError, match="envelope"):
        e.add_request(GenerationRequest(prompt="a red circle", height=128, width=64))
    with pytest.raises(AdmissionError, match="max_prompt_tokens"):
        e.add_request(GenerationRequest(prompt="a" * 21, height=64, width=64))
    e.add_request(GenerationRequest(prompt="a red circle", height=64, width=64, steps=1))
    assert e.run_until_complete()[0].ok and e.manager.pool.num_free == 200


def test_cuda_utilization_is_capped_by_what_the_gpu_has_free(monkeypatch):
    """On CUDA the gpu_memory_utilization rule never takes more than the GPU has free minus the
    (1 - utilization) share (another stage's pool on the same GPU keeps its memory); the GPU is faked."""
    from ditkv.engine import sizing

    gib = 1 << 30
    free = {"bytes": 100 * gib}
    monkeypatch.setattr(sizing, "device_memory_bytes", lambda device: 100 * gib)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 100 * gib))
    cfg, cuda = EngineConfig(gpu_memory_utilization=0.5), torch.device("cuda")
    n, why = resolve_num_blocks(cfg, gib, cuda, 10 * gib)  # an empty GPU: the rule alone, 50 - 10
    assert n == 40 and "capped" not in why
    free["bytes"] = 70 * gib  # 30 GiB held elsewhere (an AR stage's pool): 70 - 50 left
    n, why = resolve_num_blocks(cfg, gib, cuda, 10 * gib)
    assert n == 20 and "capped by the" in why
    free["bytes"] = 50 * gib
    with pytest.raises(ConfigError, match="the GPU has .* free now") as e:
        resolve_num_blocks(cfg, gib, cuda, 10 * gib)
    assert e.value.field == "gpu_memory_utilization"


def test_a_step_queue_sends_joins_and_drops_with_the_next_step():
    from ditkv.engine.messages import NewRequest, SamplingParams
    from ditkv.engine.step_queue import StepQueue

    def new(rid):
        return NewRequest(request_id=rid, metadata=None, layout=b"", params=SamplingParams(steps=1, guidance=1.0,
                                                                                            seed=0))
    q = StepQueue()
    q.start(new("a"))
    q.start(new("b"))
    q.drop("a")  # queued, never started: it leaves the starts, no rank hears of it
    q.drop("r")  # running: every rank drops it before the step's starts
    msg = q.take()
    assert [m.request_id for m in msg.starts] == ["b"] and msg.drops == ["r"] and msg.request_id == "batch-0"
    nxt = q.take()
    assert nxt.starts == [] and nxt.drops == [] and nxt.request_id == "batch-1"
