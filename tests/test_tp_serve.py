"""Serve at tensor-parallel size 2, end to end: the HTTP app (a real local Ray cluster, a Serve server on 127.0.0.1)
whose engine's target is two rank actors on two (fake) GPUs, in psd with its drafter on a third, hit by the
official `openai` client."""
import openai
import pytest
import requests

from runtime_common import PROMPTS
from test_serve import free_port, monkeypatch_module  # noqa: F401  (module-scoped monkeypatch)

KEY = "sekret-tp"


@pytest.fixture(scope="module")
def tp_server(ray_cluster, tiny_llama, tiny_llama_draft, monkeypatch_module):  # noqa: F811
    from ray import serve

    from minedraft_ray.serve.app import build_app

    monkeypatch_module.setenv("MINEDRAFT_API_KEY", KEY)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    http = serve.context._get_global_client().http_config   # whoever started Serve first chose the port
    # the split forced at every load: greedy output goes through psd's own schedule
    args = {"target": str(tiny_llama), "draft": str(tiny_llama_draft), "model_name": "tiny-tp", "mode": "psd",
            "tp": 2, "k": 2, "max_batch": 4, "max_queued": 32, "max_len": 256, "psd_low_load": "psd",
            "psd_high_load": "psd"}
    serve.run(build_app(args), name="minedraft-tp", route_prefix="/")
    yield f"http://{http.host}:{http.port}"
    serve.delete("minedraft-tp")


def test_serve_at_tp2_answers_the_openai_client_as_the_offline_engine(tp_server, reference_10):
    """Eight prompts in one request (the most it may hold: psd's two batches of 4): each completion's text is the
    in-process engine's greedy text at tp 1, token for token."""
    client = openai.OpenAI(base_url=tp_server + "/v1", api_key=KEY, timeout=120, max_retries=0)
    prompts = PROMPTS[:8]
    out = client.completions.create(model="tiny-tp", prompt=prompts, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [r.text for r in reference_10[:8]] and all(c.text for c in choices)
    assert out.usage.completion_tokens == 10 * len(prompts)
    assert all(c.finish_reason == "length" for c in choices)
    stats = out.model_extra["minedraft"]
    assert stats["mode"] == "psd" and stats["drafted"] > 0
    workers = requests.get(tp_server + "/v1/minedraft/info", headers={"Authorization": f"Bearer {KEY}"},
                           timeout=30).json()["workers"]
    gpus = {w["gpu_ids"][0] for w in (workers["verifier"], *workers["ranks"], workers["drafter"])}
    assert len(workers["ranks"]) == 1 and len(gpus) == 3, workers   # rank 0, rank 1 and the drafter, a GPU each
