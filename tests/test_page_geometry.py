"""Each attention backend's page geometry is checked at startup, not at its first kernel call."""

import pytest

from ditkv.attention.backend import check_page_geometry, select_backend
from ditkv.config import EngineConfig
from ditkv.errors import BackendError


@pytest.mark.parametrize("name", ["triton", "cudnn"])
@pytest.mark.parametrize("bs", [48, 80, 96, 112, 240])
def test_triton_and_cudnn_refuse_a_page_that_is_not_a_power_of_two(name, bs):
    with pytest.raises(BackendError, match=rf"block_size={bs} cannot run attention_backend='{name}'.*power of two"):
        check_page_geometry(name, bs)
    # before anything is built: the refusal comes first even where the backend could not run at all
    with pytest.raises(BackendError, match="power of two"):
        select_backend(name, "cpu", paged=True, block_size=bs)


@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
def test_powers_of_two_pass(bs):
    for name in ("triton", "cudnn", "torch", "torch-segments"):
        check_page_geometry(name, bs)


def test_an_engine_with_block_size_48_fails_at_startup_on_triton_and_runs_on_torch():
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest

    assert EngineConfig(block_size=48).block_size == 48  # the config itself knows only "a multiple of 16"
    with pytest.raises(BackendError, match="block_size=48"):
        Engine(EngineConfig(block_size=48, attention_backend="triton", diffusion_kv_mode="paged_scheduler",
                            diffusion_kv_max_rows_per_request=2, num_kv_blocks=64, device="cpu",
                            profile_memory=False))
    e = Engine(EngineConfig(block_size=48, attention_backend="torch", diffusion_kv_mode="paged_scheduler",
                            diffusion_kv_max_rows_per_request=2, num_kv_blocks=64, device="cpu", profile_memory=False))
    try:
        out = e.generate(GenerationRequest(prompt="a red square", height=32, width=32, steps=2, seed=0))
    finally:
        e.shutdown()
    assert out.ok, out.error
