"""GPU tests (skipped without CUDA): whole-model Triton vs torch backend, CUDA graph replay."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _bundle(dtype):
    from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec

    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).to("cuda", dtype).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def _engine(bundle, backend, bs=64):
    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine

    cfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, block_size=bs,
                       num_kv_blocks=64, attention_backend=backend, device="cuda", profile_memory=False)
    return Engine(cfg, model_bundle=bundle)


def _admit(e, prompt="a large blue square", size=64):
    from ditkv.engine.types import GenerationRequest

    rid = e.add_request(GenerationRequest(prompt=prompt, height=size, width=size, steps=3, guidance_scale=4.0))
    req = e.scheduler.schedule().admitted[0]
    e.worker.install(req.metadata)
    return rid, req.payload[0]


@pytest.mark.parametrize("bs", [16, 64])
def test_whole_model_triton_equals_torch_backend_bf16(bs):
    bundle = _bundle(torch.bfloat16)
    outs = {}
    for backend in ("triton", "torch"):
        e = _engine(bundle, backend, bs)
        rid, layout = _admit(e)
        x, _ = e.worker.runner.generate(rid, layout, 3, 4.0, seed=3)
        outs[backend] = x
    diff = (outs["triton"] - outs["torch"]).abs().max().item()
    assert diff < 0.1 * outs["torch"].abs().max().item(), diff


def test_cuda_graph_replay_equals_eager():
    from ditkv.worker.cuda_graph import DenoiseStepGraph, graph_safe_moe
    from ditkv.worker.rows import DENOISE, PREFILL

    bundle = _bundle(torch.float32)
    e = _engine(bundle, "triton")
    rid, layout = _admit(e)
    runner = e.worker.runner
    cfg = bundle[0].config
    gen = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(1, cfg.latent_channels, layout.h, layout.w, device="cuda", generator=gen)
    with torch.inference_mode():
        runner.forward_step(rid, layout, x0, torch.tensor([900.0], device="cuda"), PREFILL, True)
    g = DenoiseStepGraph(runner, rid, layout)
    for t in (700.0, 300.0):  # changed inputs between replays
        x = torch.randn(x0.shape, device="cuda", generator=gen)
        tt = torch.tensor([t], device="cuda")
        got = g.replay(x, tt).clone()
        with torch.inference_mode(), graph_safe_moe(bundle[0]):
            g.x.copy_(x)
            g.t.copy_(tt)
            same_path = g.forward()
        with torch.inference_mode():
            eager, _ = runner.forward_step(rid, layout, x, tt, DENOISE, False)
        torch.testing.assert_close(got, same_path, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, eager, atol=2e-3, rtol=2e-3)
