"""The text head (ln_f + lm_head) of the tiny checkpoint: the shipped head completes captions through
the real AR runner; the trainer trains on the AR's own states, lowers the loss, and leaves every
other tensor alone."""

import pytest
import torch
from safetensors.torch import load_file

from ditkv.data import ShapesDataset, heldout_specs
from ditkv.models.hunyuan import load_checkpoint, load_tokenizer
from ditkv.models.loader import TINY_ASSET
from ditkv.train import text_head as th

SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def tiny():
    return load_checkpoint(TINY_ASSET, dtype=torch.float32), load_tokenizer(TINY_ASSET)


@pytest.mark.parametrize("prompt", ["a small red", "a medium green"])
def test_shipped_head_completes_a_partial_caption_through_the_ar_runner(tiny, prompt):
    model, tok = tiny
    (text, eos), = th.complete(model, tok, [prompt], max_new_tokens=40)
    assert eos and th.is_caption(text) and text.startswith(prompt + " "), text


def test_caption_distribution_is_the_train_split_of_shapes_dataset():
    dist = th.caption_distribution()
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    assert not {s.caption() for s in heldout_specs()} & set(dist)  # held-out captions stay held out
    ds = ShapesDataset(0, 40)
    assert {ds.sample(i)[0] for i in range(40)} <= set(dist)
    assert "a large blue square" in dist and "a circle" in dist  # partial captions (dropped attributes)


def test_trainer_uses_the_ar_states_lowers_the_loss_and_leaves_the_model_alone(tiny):
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dist = th.caption_distribution()
    caps = sorted(dist)[::24]
    rows = [th.text_row(model.config, tok, c) for c in caps]
    hidden = th.trunk_hidden(model, rows)
    assert th.check_against_ar(model, rows[:3], hidden[:3]) < 1e-4  # same states as prefill + decode
    states, targets = th.prefix_targets(rows, [dist[c] for c in caps], hidden, model.config.vocab_size)
    assert states.shape[0] == targets.shape[0] and torch.all(targets.sum(-1) > 0)
    head, losses = th.train_head(model, states, targets, steps=30, lr=0.02, seed=0, log_every=0)
    assert losses[-1] < 0.5 * losses[0]
    again, _ = th.train_head(model, states, targets, steps=30, lr=0.02, seed=0, log_every=0)
    assert all(torch.equal(head[k], again[k]) for k in th.HEAD_KEYS)  # deterministic
    assert set(head) == set(th.HEAD_KEYS)
    for k, v in model.state_dict().items():  # the trunk (and the model's own head) is untouched
        assert torch.equal(v, before[k]), k


def test_write_head_replaces_only_the_head_tensors(tmp_path):
    src = load_file(str(TINY_ASSET / SHARD))
    head = {"model.ln_f.weight": torch.full((128,), 0.5), "lm_head.weight": torch.randn(320, 128)}
    th.write_head(TINY_ASSET, tmp_path, head)
    out = load_file(str(tmp_path / SHARD))
    assert set(out) == set(src) and (tmp_path / "config.json").is_file()
    for k, v in src.items():
        if k in th.HEAD_KEYS:
            assert out[k].dtype == v.dtype and torch.equal(out[k], head[k].to(v.dtype))
        else:
            assert out[k].dtype == v.dtype and torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k
    load_checkpoint(tmp_path)  # still a valid checkpoint


def test_stage_graph_reports_the_ar_text_as_revised_prompt():
    """With `max_new_tokens`, the AR stage completes a partial caption; the output says what the DiT
    drew (`revised_prompt`, OpenAI's field); without generation there is nothing to report."""
    from ditkv.stages.orchestrator import Orchestrator
    from ditkv.stages.graph import load_stage_graph
    from ditkv.engine.types import GenerationRequest

    def graph(max_new):
        t = {"kv_connector": "shm", "kv_role": "kv_producer", "engine_id": "ar"}
        return load_stage_graph({"stages": [
            {"stage_id": 0, "kind": "ar", "max_new_tokens": max_new,
             "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64},
             "kv_transfer_config": t},
            {"stage_id": 1, "kind": "dit", "inputs": [0],
             "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 256,
                        "diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2},
             "kv_transfer_config": {**t, "kv_role": "kv_consumer", "engine_id": "dit"}}]})

    r = GenerationRequest(prompt="a small red", height=32, width=32, steps=1, seed=0)
    for max_new in (32, 0):
        orch = Orchestrator(graph(max_new))
        try:
            out = orch.generate(r, timeout=60)
        finally:
            orch.shutdown()
        assert out.ok, out.error
        if max_new:
            assert th.is_caption(out.revised_prompt) and out.revised_prompt.startswith("a small red "), out
        else:
            assert out.revised_prompt is None


@pytest.mark.parametrize("engine", ["stage-graph", "single"])
def test_generate_prints_the_ar_text(tmp_path, capsys, engine):
    """The trained text head's caption completion, from a stage graph's AR stage or from the single
    engine's AR phase (`--max-new-tokens`): the same text, printed before the image line."""
    import ast

    import yaml

    from ditkv.entrypoints.cli import main

    root = TINY_ASSET.parent.parent.parent
    out = tmp_path / "gen.png"
    args = ["generate", "--prompt", "a small red", "--steps", "1", "--no-progress", "--out", str(out)]
    if engine == "stage-graph":
        data = yaml.safe_load((root / "examples" / "stages-native.yaml").read_text())
        data["stages"][0]["max_new_tokens"] = 32
        path = tmp_path / "gen.yaml"
        path.write_text(yaml.safe_dump(data))
        args += ["--config", str(path)]
    else:
        args += ["--max-new-tokens", "32"]
    assert main(args) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("AR text: ")]
    assert line and th.is_caption(ast.literal_eval(line[0].removeprefix("AR text: "))) and out.exists(), line