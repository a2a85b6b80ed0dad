"""kv_connector `cuda`: the same-host GPU transport.

CPU tests (always run): config validation, the transport's in-process path on CPU tensors
(registry lookup, descriptors, notices, failures), the IPC handle's unpickling guard, and the
orchestrator wired through the cuda transport. GPU tests (`-m gpu`, skipped without CUDA):
legacy vs native bit-identity over real device-to-device copies (cuda:0 -> cuda:1 when there
are two GPUs), a 2-rank consumer, a peer process reached through CUDA IPC, the example YAML.
"""

import copy
import multiprocessing as mp
import os
import pickle
import time

import numpy as np
import pytest
import torch

from ditkv.stages.graph import load_stage_graph
from ditkv.errors import ConfigError
from ditkv.transfer.config import TransferConfig
from ditkv.transfer.connector import KVConsumer, KVProducer
from ditkv.transfer.cuda_transport import open_ipc
from ditkv.transfer.ticket import DestEndpoint, RowDest, TransferTicket
from ditkv.transfer.transport import RegionInfo, TransferFailed, make_transport
from ditkv.worker.page_pool import PagePool

HAS_CUDA = torch.cuda.is_available()
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def stage_graph(mode="native", kind="cuda", ar_dev="cuda:0", dit_dev="cuda:0", backend="auto", dtype="auto"):
    key = "kv_transfer_config" if mode == "native" else "legacy_kv_transfer"
    dit = {"model": "tiny", "device": dit_dev, "block_size": 16, "diffusion_kv_mode": "dense_legacy",
           "attention_backend": backend, "dtype": dtype}
    if mode == "native":
        dit.update(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, num_kv_blocks=256)
    extra = {} if mode == "native" else {"legacy_slots": 4, "legacy_max_tokens": 256}
    return {"stages": [
        {"stage_id": 0, "kind": "ar", "engine": {"model": "tiny", "device": ar_dev, "block_size": 16,
                                                 "num_kv_blocks": 64, "attention_backend": backend, "dtype": dtype},
         key: {"kv_connector": kind, "engine_id": "ar", "kv_role": "kv_producer", **extra}},
        {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": dit,
         key: {"kv_connector": kind, "engine_id": "dit", "kv_role": "kv_consumer", **extra}}]}


# ---- configuration ------------------------------------------------------------------------------
def test_cuda_is_a_kv_connector_choice():
    assert TransferConfig("native", engine_id="a", kv_role="kv_producer", kv_connector="cuda").kv_connector == "cuda"
    with pytest.raises(ConfigError, match="'cuda' \\(same host, GPU pools\\)"):
        TransferConfig("native", engine_id="a", kv_role="kv_producer", kv_connector="nvlink")


def test_cuda_connector_with_cpu_stage_is_rejected():
    with pytest.raises(ConfigError, match=r"stages\[0\].engine.device.*moves GPU pools.*cuda:N"):
        load_stage_graph(stage_graph(ar_dev="cpu"))
    with pytest.raises(ConfigError, match=r"stages\[1\].engine.device"):
        load_stage_graph(stage_graph(dit_dev="cpu", mode="legacy"))


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA message")
def test_cuda_connector_with_auto_device_and_no_gpu_is_rejected():
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        load_stage_graph(stage_graph(ar_dev="auto", dit_dev="auto"))


def test_shm_connector_with_gpu_stage_is_rejected():
    with pytest.raises(ConfigError, match="'shm' moves CPU pools: use kv_connector: cuda"):
        load_stage_graph(stage_graph(kind="shm", dit_dev="cuda:1"))


def test_example_gpu_yaml_parses_with_per_stage_devices():
    g = load_stage_graph(os.path.join(EXAMPLES, "stages-native-gpu.yaml"))
    assert (g.ar.engine.device, g.dit.engine.device) == ("cuda:0", "cuda:1")
    assert g.mode == "native" and g.ar.transfer.kv_connector == g.dit.transfer.kv_connector == "cuda"


# ---- the transport's in-process path (CPU tensors) ------------------------------------------------
def wait_notices(tp, n=1, timeout=5.0):
    got, end = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        got += tp.poll_notifies()
        time.sleep(0.001)
    return got


def test_in_process_write_copies_descriptors_then_notifies():
    a, b = make_transport("cuda"), make_transport("cuda")
    try:
        src = torch.arange(64, dtype=torch.uint8)
        dst = torch.zeros(64, dtype=torch.uint8)
        a.register("pool", src)
        region = b.register("pool", dst)
        assert region.transport == "cuda" and region.nbytes == 64
        a.write("pool", region, [(0, 32, 8), (40, 0, 4)], notify="t|0|0")
        assert wait_notices(b) == ["t|0|0"]
        assert torch.equal(dst[32:40], src[:8]) and torch.equal(dst[:4], src[40:44])
        assert dst[4:32].sum() == 0 and dst[40:].sum() == 0
        with pytest.raises(TransferFailed, match="outside the registered regions"):
            a.write("pool", region, [(60, 0, 8)])
        assert a.poll_notifies() == []  # notices go to the destination's transport only
    finally:
        a.close()
        b.close()


def test_write_to_a_closed_or_foreign_cpu_region_fails():
    a, b = make_transport("cuda"), make_transport("cuda")
    a.register("pool", torch.ones(8, dtype=torch.uint8))
    region = b.register("pool", torch.zeros(8, dtype=torch.uint8))
    b.close()
    try:
        with pytest.raises(TransferFailed, match="is gone"):
            a.write("pool", region, [(0, 0, 8)])
        foreign = RegionInfo("cuda", region.endpoint, "pool", f"{os.getpid() + 1}:abc:", 8)
        with pytest.raises(TransferFailed, match="only GPU regions"):
            a.write("pool", foreign, [(0, 0, 8)])
        with pytest.raises(TransferFailed, match="malformed"):
            a.write("pool", RegionInfo("cuda", region.endpoint, "pool", "nonsense", 8), [(0, 0, 8)])
    finally:
        a.close()


def test_ipc_handle_may_only_name_torch_rebuild_functions():
    import base64

    evil = base64.b64encode(pickle.dumps((os.system, ("true",)))).decode()
    with pytest.raises(pickle.UnpicklingError, match="may not reference"):
        open_ipc(evil)


def test_reshape_to_two_rank_consumer_over_cuda_transport():
    """One producer holding both KV heads -> two consumer ranks holding one head each (on GPU:
    cuda:0 -> cuda:1 when there are two)."""
    src_dev, dst_dev = _devices() if HAS_CUDA else ("cpu", "cpu")
    cfg = dict(kv_connector="cuda", legacy_max_tokens=256, legacy_slots=2)
    src = PagePool(32, 3, 2, 16, 8, torch.float32, src_dev)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(0)))
    tps = [make_transport("cuda") for _ in range(3)]
    prod = KVProducer(TransferConfig("native", engine_id="ar", kv_role="kv_producer", **cfg), tps[0], src)
    cc = TransferConfig("native", engine_id="dit", kv_role="kv_consumer", **cfg)
    cons = [KVConsumer(cc, tps[r + 1], r, PagePool(32, 3, 1, 16, 8, torch.float32, dst_dev), r, r + 1)
            for r in range(2)]
    try:
        t = TransferTicket("r", "native")
        t.bind_source(prod.source([3, 4, 5], 40))
        t.bind_dest(DestEndpoint("dit", "kv_consumer", 0, tuple(c.rank_dest() for c in cons),
                                 (RowDest(0, 40, (7, 8, 9)), RowDest(1, 1, (20,)))))
        for c in cons:
            c.register(t)
        t.mark_dispatched(10)
        prod.dispatch(t, lambda _: None)
        end = time.monotonic() + 10
        while not t.all_received() and time.monotonic() < end:
            for c in cons:
                for _, rank, rows, sr in c.poll():
                    t.report_received(rank, rows, sr)
            time.sleep(0.001)
        assert t.all_received() and t.sent == {0: None, 1: None}
        for r, c in enumerate(cons):
            ref = src.kv.to(c.pool.device)
            assert torch.equal(c.pool.kv[[7, 8, 9]], ref[[3, 4, 5]][:, :, :, r:r + 1])
            assert torch.equal(c.pool.kv[20], ref[3][:, :, r:r + 1])
            assert c.pool.kv[[0, 1, 10]].abs().sum() == 0
    finally:
        prod.close()
        for x in tps:
            x.close()


# ---- the orchestrator over the cuda transport -------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_bundle():
    from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec

    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def run_both(graphs, bundle, n=3):
    """legacy and native over the same requests -> (images per mode, pools full after)."""
    from ditkv.stages.orchestrator import Orchestrator
    from ditkv.engine.types import GenerationRequest

    reqs = [GenerationRequest(prompt=p, height=32, width=32, steps=2, guidance_scale=2.0, seed=i)
            for i, p in enumerate(["a large red circle", "a small blue square in the top left corner", "x"][:n])]
    imgs, full = {}, True
    for mode, g in graphs.items():
        orch = Orchestrator(g, bundle).start()
        try:
            outs = orch.run([copy.copy(r) for r in reqs], concurrency=2)
        finally:
            orch.shutdown()
        assert all(o.ok for o in outs), [o.error for o in outs]
        imgs[mode] = [o.image for o in outs]
        full = full and orch.pools_full() and all(not d.num_quarantined for d in orch.dit)
    return imgs, full


def test_orchestrator_legacy_and_native_over_cuda_transport_on_cpu(cpu_bundle):
    """The wiring (both paths, buffers, notices) through the transport's in-process path; stage
    configs refuse `cuda` on CPU devices, so the parsed graphs are switched after validation."""
    graphs = {}
    for mode in ("legacy", "native"):
        g = load_stage_graph(stage_graph(mode, kind="shm", ar_dev="cpu", dit_dev="cpu"))
        g.ar.transfer.kv_connector = g.dit.transfer.kv_connector = "cuda"
        graphs[mode] = g
    imgs, full = run_both(graphs, cpu_bundle)
    assert all(np.array_equal(a, b) for a, b in zip(imgs["legacy"], imgs["native"]))
    assert full


# ---- GPU ---------------------------------------------------------------------------------------------
def _devices():
    return "cuda:0", ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_transferred_prefix_and_attention_bit_identical(dtype):
    from ditkv.bench.transfer_exact import kv_attention_exact

    src, dst = _devices()
    r = kv_attention_exact("cuda", src, dst, dtype, block_size=64)
    assert r["kv_exact"] and r["attention_exact"], r
    assert r["dst_device"] == dst


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices: a dense (legacy) DiT never shares the AR stage's GPU (stages/placement.py)")
def test_gpu_orchestrator_legacy_and_native_bit_identical_pools_full():
    ar, dit = _devices()
    graphs = {m: load_stage_graph(stage_graph(m, ar_dev=ar, dit_dev=dit, backend="torch"))
              for m in ("legacy", "native")}
    imgs, full = run_both(graphs, None)
    assert all(np.array_equal(a, b) for a, b in zip(imgs["legacy"], imgs["native"]))
    assert full


def _ipc_peer(conn, device):
    """A consumer in another process: owns a GPU pool, exports it, reports what landed."""
    tp = make_transport("cuda")
    pool = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    conn.send(tp.register("pool", pool))
    notes = wait_notices(tp, 1, timeout=20)
    conn.send((notes, pool[: 1 << 16].cpu(), int(pool[1 << 16:].sum())))
    conn.poll(30)  # stay alive until the writer let go of the mapping
    tp.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_cross_process_write_through_cuda_ipc():
    src_dev, dst_dev = _devices()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_ipc_peer, args=(b, dst_dev), daemon=True)
    proc.start()
    tp = make_transport("cuda")
    try:
        assert a.poll(60), "the peer process did not start"
        region = a.recv()
        assert int(region.handle.split(":")[0]) == proc.pid
        src = torch.randint(0, 255, (1 << 16,), dtype=torch.uint8, device=src_dev)
        tp.register("src", src)
        tp.write("src", region, [(0, 0, 1 << 15), (1 << 15, 1 << 15, 1 << 15)], notify="t|0|0")
        assert a.poll(30), "the peer process did not report"
        notes, head, rest = a.recv()
        assert notes == ["t|0|0"] and torch.equal(head, src.cpu()) and rest == 0
    finally:
        tp.close()
        a.send("done")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_example_yaml_generates(tmp_path):
    from ditkv.entrypoints.cli import main

    out = tmp_path / "gpu.png"
    assert main(["generate", "--config", os.path.join(EXAMPLES, "stages-native-gpu.yaml"), "--prompt",
                 "a red circle", "--steps", "2", "--height", "64", "--width", "64", "--out", str(out),
                 "--no-progress"]) == 0
    assert out.stat().st_size > 0


def test_batched_copy_bounds_its_temporary(monkeypatch):
    """A write gathers its pages through a temporary, in chunks of at most _MAX_TEMP_BYTES (native
    needs no staging copy of the whole prefix); the result equals copying descriptor by descriptor."""
    from ditkv.transfer import cuda_transport as ct

    src = torch.arange(64 * 1024, dtype=torch.uint8).reshape(-1).clone()
    descs = [(s * 1024, d * 1024, 1024) for s, d in zip(range(0, 48, 3), [7, 2, 40, 11, 5, 63, 30, 18, 1,
                                                                            50, 22, 9, 35, 44, 13, 27])]
    want = torch.zeros_like(src)
    for s, d, n in descs:
        want[d:d + n] = src[s:s + n]
    seen = []
    real = torch.Tensor.index_select

    def spy(self, dim, index):
        seen.append(index.numel())
        return real(self, dim, index)
    monkeypatch.setattr(ct, "_MAX_TEMP_BYTES", 3 * 1024)
    monkeypatch.setattr(torch.Tensor, "index_select", spy)
    got = torch.zeros_like(src)
    ct.batched_copy(src, got, descs)
    assert torch.equal(got, want)
    assert seen and max(seen) == 3 and sum(seen) == 16  # 1 KiB rows, 3 per chunk
