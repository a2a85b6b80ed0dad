"""A request's AR text settings (issue 34 item 2's per-request overrides): `ditkv generate` flags reach
the request, every front end checks them, a stage graph's AR stage draws with them (the stage's and the
checkpoint's defaults otherwise); a single engine runs the text as its AR phase."""

import types

import pytest

from ditkv.engine.processor import Processor
from ditkv.engine.request_check import check_request, request_sampling
from ditkv.engine.types import GenerationRequest
from ditkv.entrypoints import generate
from ditkv.entrypoints.cli import build_parser
from ditkv.errors import ConfigError, LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config
from ditkv.models.hunyuan.tokenizer import ByteTokenizer
from ditkv.stages.graph import load_stage_graph
from ditkv.stages.orchestrator import Orchestrator
from ditkv.models.text_settings import TextSampling
from test_orchestrator import bundle, graph, req  # noqa: F401 - bundle is a fixture

STAGE = TextSampling(temperature=0.6, top_k=1024, top_p=0.95, max_new_tokens=8)


def test_cli_flags_reach_the_request():
    a = build_parser().parse_args(["generate", "--prompt", "p", "--max-new-tokens", "3", "--temperature", "0.7",
                                   "--top-k", "5", "--top-p", "0.9"])
    r = generate._request(a)
    assert (r.max_new_tokens, r.temperature, r.top_k, r.top_p, r.do_sample) == (3, 0.7, 5, 0.9, None)
    r = generate._request(build_parser().parse_args(["generate", "--prompt", "p"]))
    assert (r.max_new_tokens, r.temperature, r.top_k, r.top_p) == (None,) * 4  # not given: the defaults


@pytest.mark.parametrize("field,value", [("top_p", 0.0), ("top_p", 1.5), ("temperature", -1.0), ("top_k", -2),
                                         ("max_new_tokens", -1), ("do_sample", 1)])
def test_every_front_end_refuses_bad_text_settings_by_field(field, value):
    with pytest.raises(LayoutError) as e:
        check_request(GenerationRequest(prompt="p", **{field: value}), 50)
    assert e.value.field == field


def test_request_settings_override_the_defaults_and_the_stage_caps_the_length():
    r = GenerationRequest(prompt="p", seed=9, top_k=-1, temperature=0.0)
    assert request_sampling(r, STAGE, 8) == TextSampling(temperature=0.0, top_k=-1, top_p=0.95, max_new_tokens=8, seed=9)
    assert request_sampling(GenerationRequest(prompt="p", seed=2), STAGE, 8) == TextSampling(
        temperature=0.6, top_k=1024, top_p=0.95, max_new_tokens=8, seed=2)
    with pytest.raises(LayoutError, match="at most 8") as e:
        request_sampling(GenerationRequest(prompt="p", max_new_tokens=9), STAGE, 8)
    assert e.value.field == "max_new_tokens"


def test_the_single_engine_intake_gives_an_ar_phase_only_for_text():
    """bot_task image: max_new_tokens > 0 asks for text (an AR phase with the request's settings);
    a sampling setting without text would be unused, so it is refused by name."""
    proc = Processor(types.SimpleNamespace(max_steps=50, cfg_parallel_size=1, diffusion_kv_mode="paged_scheduler"),
                     HunyuanImage3Config.tiny(), ByteTokenizer())
    plain = proc.process(GenerationRequest(prompt="a red circle", height=32, width=32))
    assert plain.ar is None and plain.text is None
    text = proc.process(GenerationRequest(prompt="a red circle", height=32, width=32, max_new_tokens=4, top_k=3))
    assert text.text.max_new_tokens == 4 and text.text.top_k == 3 and text.ar.head == text.layout.cond_text_ids()
    with pytest.raises(LayoutError, match="writes no AR text") as e:
        proc.process(GenerationRequest(prompt="a red circle", height=32, width=32, top_p=0.5))
    assert e.value.field == "top_p"


def test_the_ar_stage_draws_with_the_request_settings(bundle):  # noqa: F811
    orch = Orchestrator(graph(max_new=4), bundle)
    jobs = []
    submit = orch.ar[0].submit
    orch.ar[0].submit = lambda job: (jobs.append(job.sampling), submit(job))
    try:
        with pytest.raises(LayoutError, match="at most 4"):
            orch.submit(req(1, "ab", max_new_tokens=5))
        sampled = [orch.generate(req(1, "ab", temperature=1.5, top_k=7, max_new_tokens=3)) for _ in range(2)]
        greedy = orch.generate(req(1, "ab"))
    finally:
        orch.shutdown()
    assert all(o.ok for o in (*sampled, greedy))
    assert jobs[0] == TextSampling(temperature=1.5, top_k=7, max_new_tokens=3, seed=1)
    assert jobs[2] == TextSampling(max_new_tokens=4, seed=1)  # the stage's; the tiny model has no generation config
    assert len(jobs) == 3  # the refused request never reached the AR stage
    assert sampled[0].revised_prompt.startswith("ab") and sampled[0].revised_prompt == sampled[1].revised_prompt


@pytest.mark.parametrize("key,value,field,words", [
    ("top_p", 0, "stages[0].top_p", "(0, 1]"), ("top_k", -3, "stages[0].top_k", "0 / -1"),
    ("do_sample", "no", "stages[0].do_sample", "true or false"), ("temperature", -1, "stages[0].temperature", ">= 0"),
])
def test_stage_text_defaults_are_checked_by_field(key, value, field, words):
    g = graph()
    stages = [{"stage_id": 0, "kind": "ar", "max_new_tokens": 4, key: value,
               "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": 64},
               "kv_transfer_config": {"kv_connector": "shm", "engine_id": "ar", "kv_role": "kv_producer"}},
              {"stage_id": 1, "kind": "dit", "inputs": [0], "engine": {"model": "tiny", "device": "cpu",
                                                                        "block_size": 16},
               "kv_transfer_config": {"kv_connector": "shm", "engine_id": "dit", "kv_role": "kv_consumer"}}]
    with pytest.raises(ConfigError) as e:
        load_stage_graph({"stages": stages})
    assert e.value.field == field and words in str(e.value)
    stages[0].pop(key)
    stages[1][key] = value
    with pytest.raises(ConfigError, match="belong to the AR stage") as e:
        load_stage_graph({"stages": stages})
    assert e.value.field == f"stages[1].{key}"
    assert g.ar.top_k is None and g.ar.temperature is None  # not set: the checkpoint's


def test_the_stage_text_defaults_reach_the_ar_jobs(bundle):  # noqa: F811
    g = graph(max_new=4)
    g.ar.temperature, g.ar.top_k, g.ar.do_sample = 0.9, 3, False
    orch = Orchestrator(g, bundle)
    try:
        assert orch._text == TextSampling(temperature=0.9, top_k=3, do_sample=False, max_new_tokens=4)
    finally:
        orch.shutdown()

