"""Every CPU tensor that a bit-identity claim feeds to BLAS starts on a 64-byte boundary, whatever
loaded it (ditkv/alignment.py). Host-independent: these check addresses, not bits, so they fail on
any CPU when a loader leaves a mapped (8-byte aligned) safetensors tensor in the model. The bits
themselves are checked per ISA setting in tests/test_bit_identity_matrix.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ditkv.alignment import CPU_ALIGNMENT, align_module, aligned, aligned_rows, is_aligned, misaligned
from ditkv.config import EngineConfig
from ditkv.entrypoints.quantize import quantize_folder
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, load_checkpoint, save_checkpoint
from ditkv.models.hunyuan.checkpoint import load_vae, load_model_config
from ditkv.models.hunyuan.codec import PixelCodec
from ditkv.models.hunyuan.sharded_load import load_checkpoint_shard
from ditkv.models.hunyuan.tokenizer import ByteTokenizer
from ditkv.models.loader import load_model, module_copy
from ditkv.worker.worker import DiTWorker

from bit_identity_probe import offset_copy, offset_model
from release_folders import official, shrunk, write_folder

CFG = HunyuanImage3Config.tiny().replace(num_hidden_layers=2)


def _tensors(model):
    return list(model.named_parameters()) + list(model.named_buffers())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    save_checkpoint(HunyuanImage3Model.from_config(CFG, seed=3), folder, max_shard_bytes=64 << 10)
    return folder


@pytest.mark.parametrize("name", ["tiny", "tiny-edit"])
def test_every_parameter_of_a_bundled_model_is_aligned(name):
    model = load_model(name, torch.device("cpu"), torch.float32)[0]
    assert misaligned(model) == []
    assert all(t.data_ptr() % CPU_ALIGNMENT == 0 for _, t in _tensors(model) if t.numel())


def test_a_sharded_checkpoint_loads_aligned_whole_and_per_rank(saved):
    assert misaligned(load_checkpoint(saved)) == []
    assert misaligned(load_checkpoint(saved, dtype=torch.bfloat16)) == []  # cast and kept-fp32 router alike
    for rank in range(2):  # a TP rank's row slices start anywhere in the mapped tensor
        spec = SimpleNamespace(tp_rank=rank, tp_size=2, tp_group=None, ep_rank=0, ep_size=1, ep_group=None)
        assert misaligned(load_checkpoint_shard(saved, spec)) == [], rank


def test_a_prequantized_folder_loads_aligned(saved, tmp_path):
    quantize_folder(str(saved), tmp_path / "fp8", log=lambda line: None)
    model = load_checkpoint(tmp_path / "fp8")
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    assert misaligned(model) == []


def test_the_release_vae_loads_aligned(tmp_path):
    folder = write_folder(tmp_path / "release", shrunk(official("base")))
    vae = load_vae(folder, load_model_config(folder))
    assert vae is not None and misaligned(vae) == []


def test_a_workers_model_is_aligned_whatever_bundle_it_was_given():
    """A caller's model whose weights sit at every offset: the worker realigns it in place."""
    model = offset_model(HunyuanImage3Model.from_config(CFG, seed=1).eval())
    before = misaligned(model)
    assert len(before) > 10
    worker = DiTWorker(EngineConfig(device="cpu", dtype="float32", diffusion_kv_mode="paged_scheduler",
                                    diffusion_kv_max_rows_per_request=2, num_kv_blocks=16),
                       num_blocks=16, model_bundle=(model, ByteTokenizer(), PixelCodec(CFG.image_token_downsample)))
    assert misaligned(worker.model) == [] and misaligned(model) == []


def test_align_module_keeps_tied_and_shared_tensors_shared():
    lin = torch.nn.Linear(12, 6)
    lin.weight.data = offset_copy(lin.weight.data, 8)
    seq = torch.nn.Sequential(lin, torch.nn.Linear(12, 6))
    seq[1].weight = lin.weight  # tied: one parameter in two modules
    seq.add_module("again", lin)  # the same module twice
    copy = module_copy(seq)
    values = lin.weight.detach().clone()
    assert not is_aligned(lin.weight)
    assert align_module(seq) == 1  # one storage copied, however often it is reachable
    assert is_aligned(lin.weight) and copy[0].weight is lin.weight and seq[1].weight is lin.weight
    assert torch.equal(lin.weight, values)
    assert align_module(seq) == 0  # nothing left to do


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 9), k=st.integers(1, 70), pad=st.integers(0, 20), offset=st.sampled_from([0, 4, 8, 16, 32, 48]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_aligned_rows_starts_every_row_on_a_boundary_and_keeps_the_values(n, k, pad, offset, dtype):
    es = torch.empty(0, dtype=dtype).element_size()
    base = offset_copy(torch.randn(n * (k + pad) + 1).to(dtype), offset - offset % es)
    x = base[:n * (k + pad)].view(n, k + pad)[:, :k]  # rows at an arbitrary stride and start
    y = aligned_rows(x)
    assert torch.equal(y, x)
    assert all(y[i].data_ptr() % CPU_ALIGNMENT == 0 for i in range(n))
    if x.data_ptr() % CPU_ALIGNMENT == 0 and (k + pad) * es % CPU_ALIGNMENT == 0:
        assert y.data_ptr() == x.data_ptr()  # nothing copied when every row is aligned already


def test_aligned_copies_only_what_is_off_and_leaves_meta_alone():
    t = torch.randn(33)
    assert aligned(t) is t
    off = offset_copy(t, 16)
    assert aligned(off) is not off and torch.equal(aligned(off), t) and is_aligned(aligned(off))
    assert is_aligned(torch.empty(0)) and is_aligned(torch.empty(3, device="meta"))
