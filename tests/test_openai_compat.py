"""A drop-in for OpenAI clients and vLLM users, end to end: one real Serve HTTP server (a real local Ray cluster,
the tiny pair in psd mode) whose models are given by Hub id and resolved offline from a Hugging Face cache in the
Hub's own layout, with a chat template override, CORS for one origin and an API key; hit by the official `openai`
client, by vLLM's own `vllm bench serve`, and scraped by a real Prometheus server."""
import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import openai
import pytest
import ray
import requests
from prometheus_client.parser import text_string_to_metric_families

from minedraft_ray.engine.loader import load_tokenizer
from minedraft_ray.serve.detokenize import TokenStrings
from test_serve import free_port, monkeypatch_module  # noqa: F401  (module-scoped monkeypatch)

TARGET_ID, DRAFT_ID = "tiny-org/tiny-llama", "tiny-org/tiny-llama-draft"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
KEY = "sekret-compat"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://ui.example"
TEMPLATE = ("{% if persona is defined %}({{ persona }}) {% endif %}"
            "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
REPO = Path(__file__).resolve().parent.parent


def hub_snapshot(hf_home: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """`folder` as huggingface_hub caches a download: blobs named by hash, snapshot symlinks, refs/main."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if not f.is_file():
            continue
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_llama, tiny_llama_draft):
    home = tmp_path_factory.mktemp("hf_home")
    hub_snapshot(home, TARGET_ID, Path(tiny_llama))
    hub_snapshot(home, DRAFT_ID, Path(tiny_llama_draft))
    return home


@pytest.fixture(scope="module")
def server(ray_cluster, hf_home, monkeypatch_module):  # noqa: F811
    from ray import serve

    from minedraft_ray.serve.app import build_app

    monkeypatch_module.setenv("MINEDRAFT_API_KEY", KEY)
    monkeypatch_module.setenv("HF_HOME", str(hf_home))    # forwarded to the replicas, which resolve the Hub ids
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.delenv("HF_HUB_CACHE", raising=False)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    http = serve.context._get_global_client().http_config
    args = {"target": TARGET_ID, "draft": DRAFT_ID, "mode": "psd", "k": 3, "max_batch": 4, "max_queued": 32,
            "max_len": 256, "chat_template": TEMPLATE, "cors_allow_origins": ORIGIN, "prefix_caching": True}
    serve.run(build_app(args), name="compat", route_prefix="/")
    yield f"http://{http.host}:{http.port}"
    serve.delete("compat")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return load_tokenizer(tiny_llama)


def scrape(server) -> dict:
    """/metrics as {(sample name, sorted labels): value}."""
    r = requests.get(server + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:300]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def sample(values: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and labels.items() <= dict(ls).items())


# ---------------------------------------------------------------- settings (no server)

def test_settings(tmp_path, monkeypatch):
    from minedraft_ray.config import EngineConfig, is_hub_id
    from minedraft_ray.engine.loader import load_chat_template

    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("meta-llama/Llama-3.1-8B-Instruct")
    assert not any(is_hub_id(s) for s in ("/models/x", "Qwen3-8B", "a/b/c", "random:tiny", "../x", str(tmp_path)))
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "local").mkdir()
    monkeypatch.chdir(tmp_path)   # an existing relative folder wins over the Hub id it looks like
    assert not is_hub_id("org/local")
    config = EngineConfig.from_env({"target": "Qwen/Qwen3-8B", "draft": "Qwen/Qwen3-0.6B"},
                                   environ={"MINEDRAFT_CORS_ALLOW_ORIGINS": "https://a.example, https://b.example"})
    assert config.served_model_name == "Qwen/Qwen3-8B"
    assert config.cors_allow_origins == ["https://a.example", "https://b.example"]
    assert EngineConfig().cors_allow_origins == []
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_ignored_field_names_are_bounded(caplog):
    """Field names come from clients: a flood of made-up names gets neither new log lines nor new series."""
    from minedraft_ray.serve.compat import IgnoredFields
    from minedraft_ray.serve.vllm_metrics import APIMetrics

    metrics = APIMetrics("m", num_spec_tokens=2)
    ignored = IgnoredFields(metrics.ignored_fields, max_names=3)
    with caplog.at_level("WARNING", logger="minedraft.serve"):
        for _ in range(2):
            ignored.note("completions", ["store", "a", "b", "c", "d", "bad name!"])
    assert [r.getMessage().split("'")[1] for r in caplog.records] == ["store", "a", "b"]
    text = metrics.render().decode()
    fields = set(re.findall(r'minedraft_api_ignored_fields_total\{endpoint="completions",field="([^"]+)"\}', text))
    assert fields == {"store", "a", "b", "other"}
    assert 'field="other"} 6.0' in text


# ---------------------------------------------------------------- models by Hub id, chat template

def test_hub_ids_are_served_from_the_cache(client, hf_home):
    models = client.models.list().data
    assert [m.id for m in models] == [TARGET_ID]
    snapshot = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert models[0].model_extra["root"] == str(snapshot)


def test_chat_template_override(client, tok):
    messages = [{"role": "user", "content": "What is two plus two?"}]
    out = client.chat.completions.create(model=TARGET_ID, messages=messages, max_tokens=4, temperature=0)
    ours = "[user] What is two plus two?\n[assistant] "
    assert out.usage.prompt_tokens == len(tok.encode(ours, add_special_tokens=False))
    assert out.usage.prompt_tokens != len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                             tokenize=False), add_special_tokens=False))


def test_hub_resolution_offline(hf_home, tiny_llama, tmp_path, monkeypatch):
    from minedraft_ray.engine.hub import ModelNotFoundError
    from minedraft_ray.engine.presets import resolve_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(hf_home))
    snapshot = resolve_model(TARGET_ID)
    assert Path(snapshot) == hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    # a revision by commit, and an explicit download dir (another cache) that has a second commit
    other = tmp_path / "dl"
    hub_snapshot(other, TARGET_ID, Path(tiny_llama), commit="f" * 40)
    assert resolve_model(TARGET_ID, revision="f" * 40, download_dir=other / "hub").endswith("f" * 40)
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE is set"):
        resolve_model("tiny-org/not-cached")
    with pytest.raises(ModelNotFoundError, match="revision v9"):
        resolve_model(TARGET_ID, revision="v9")
    # a partial snapshot: the error names what is missing
    partial = hub_snapshot(tmp_path / "partial", "tiny-org/partial", Path(tiny_llama))
    for f in partial.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelNotFoundError, match=r"lacks \*\.safetensors weights"):
        resolve_model("tiny-org/partial", download_dir=tmp_path / "partial" / "hub")
    # the Hub unreachable (no network here) and nothing cached, without HF_HUB_OFFLINE
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")   # nothing listens there
    with pytest.raises(ModelNotFoundError, match="Hub is unreachable"):
        resolve_model("tiny-org/not-cached")


def test_the_llm_api_loads_the_revision_it_is_given(ray_cluster, tiny_llama, tiny_llama_draft, tmp_path,
                                                    monkeypatch):
    """LLM(revision=, download_dir=): the driver's tokenizer, the manager and the worker actors all resolve the Hub
    id at that revision in that cache (with the driver's HF_HUB_OFFLINE), not main in the default one: the output
    is the pinned commit's model's, not main's."""
    from minedraft_ray import LLM, SamplingParams
    from minedraft_ray.engine.engine import Engine

    cache = tmp_path / "dl"
    pinned = "e" * 40
    hub_snapshot(cache, TARGET_ID, Path(tiny_llama_draft), commit=pinned)   # other weights at another commit
    hub_snapshot(cache, TARGET_ID, Path(tiny_llama))                        # main (written last: refs/main)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompt, params = [5, 9, 13, 17], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = {}
    for name, folder in (("pinned", tiny_llama_draft), ("main", tiny_llama)):
        expected[name] = Engine(str(folder), mode="ar", max_batch=1, device="cpu").generate([prompt], [params])[0]
    assert expected["pinned"].token_ids != expected["main"].token_ids   # the two commits tell apart
    llm = LLM(TARGET_ID, mode="ar", revision=pinned, download_dir=str(cache / "hub"), max_batch=2, torch_threads=1,
              device="cpu")
    try:
        out = llm.generate([prompt], params)[0]
    finally:
        llm.shutdown()
    assert out.token_ids == expected["pinned"].token_ids


# ---------------------------------------------------------------- lenient requests

VLLM_NO_OPS = {"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "skip_special_tokens": True,
               "include_stop_str_in_output": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
HARMLESS = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u-1", "mirostat": 2}


def test_vllm_no_op_and_harmless_fields_are_accepted(server, client):
    before = scrape(server)
    for _ in range(3):
        out = client.completions.create(model=TARGET_ID, prompt="def f(x):", max_tokens=3,
                                        extra_body={**VLLM_NO_OPS, **HARMLESS})
        assert out.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model=TARGET_ID, messages=[{"role": "user", "content": "hi", "name": "ada"}], max_tokens=3,
        parallel_tool_calls=False, store=True, metadata={"k": "v"}, service_tier="auto", user="u-2",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="none",
        extra_body=VLLM_NO_OPS)
    assert chat.usage.completion_tokens == 3
    after = scrape(server)
    ignored = "minedraft_api_ignored_fields_total"
    for field in ("repetition_penalty", "store", "mirostat", "metadata"):
        assert sample(after, ignored, endpoint="completions", field=field) - \
            sample(before, ignored, endpoint="completions", field=field) == 3
    for field in ("messages.name", "parallel_tool_calls", "tools", "tool_choice", "min_p"):
        assert sample(after, ignored, endpoint="chat/completions", field=field) >= 1, field


def test_each_ignored_field_is_logged_once(server, client, ray_cluster):
    for _ in range(2):
        client.completions.create(model=TARGET_ID, prompt="x", max_tokens=1, extra_body={"zz_custom_field": 1})
    logs = Path(ray_cluster._private.worker._global_node.get_logs_dir_path())
    needle = "accepted and ignored the field 'zz_custom_field'"
    deadline = time.monotonic() + 20
    while True:   # Ray writes worker output to files asynchronously
        count = sum(p.read_text(errors="replace").count(needle) for p in logs.rglob("*") if p.is_file())
        if count or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert count == 1


@pytest.mark.parametrize("kind,kw,param", [
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    ("cmpl", {"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ("cmpl", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("cmpl", {"logit_bias": {"5": 3}}, "logit_bias"),
    ("cmpl", {"extra_body": {"min_tokens": 4}}, "min_tokens"),
    ("cmpl", {"extra_body": {"include_stop_str_in_output": True}}, "include_stop_str_in_output"),
    ("cmpl", {"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ("chat", {"extra_body": {"chat_template_kwargs": {"chat_template": "{{ 'owned' }}"}}}, "chat_template_kwargs"),
])
def test_meaning_changing_fields_are_a_clear_400(client, kind, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            client.chat.completions.create(model=TARGET_ID, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, **kw)
        else:
            client.completions.create(model=TARGET_ID, prompt="hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param
    if param != "chat_template_kwargs":
        assert e.value.body["code"] == "unsupported_parameter" and "docs/openai-compat.md" in e.value.body["message"]


def test_chat_template_kwargs_reach_the_template(client, tok):
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=TARGET_ID, messages=messages, max_tokens=1)
    assert plain.usage.prompt_tokens == len(tok.encode("[user] hi\n[assistant] ", add_special_tokens=False))
    out = client.chat.completions.create(model=TARGET_ID, messages=messages, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"persona": "pirate"}})
    assert out.usage.prompt_tokens == len(tok.encode("(pirate) [user] hi\n[assistant] ", add_special_tokens=False))


# ---------------------------------------------------------------- responses

def generated_ids(content, tok) -> list[int]:
    """Token ids of a chat response from its logprobs' bytes (byte-level BPE: each token's bytes are unique)."""
    strings = TokenStrings(tok)
    by_bytes = {bytes(strings.bytes(i)): i for i in range(len(tok)) if i not in strings.special}
    return [by_bytes[bytes(c.bytes)] for c in content]


def test_stop_token_ids_and_stop_reason(client, tok):
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    free = client.chat.completions.create(model=TARGET_ID, messages=messages, max_tokens=16, temperature=0,
                                          logprobs=True)
    ids = generated_ids(free.choices[0].logprobs.content, tok)
    j = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])
    for stream in (False, True):
        out = client.chat.completions.create(model=TARGET_ID, messages=messages, max_tokens=16, temperature=0,
                                             stream=stream, stream_options={"include_usage": True} if stream else None,
                                             extra_body={"stop_token_ids": [ids[j], len(tok) - 1]})
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            last = [c.choices[0] for c in chunks if c.choices][-1]
            used = chunks[-1].usage.completion_tokens
        else:
            last, text, used = out.choices[0], out.choices[0].message.content, out.usage.completion_tokens
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == ids[j]
        # the stop token counts, its text is left out (as vLLM)
        assert used == j + 1 and text == tok.decode(ids[:j])
    plain = client.completions.create(model=TARGET_ID, prompt="hi", max_tokens=3, temperature=0)
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].model_extra["stop_reason"] is None
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model=TARGET_ID, prompt="hi", max_tokens=3, extra_body={"stop_token_ids": [10**6]})


def test_stop_reason_names_the_stop_string(client):
    free = client.completions.create(model=TARGET_ID, prompt="Once upon a time", max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = text[6:9]
    assert stop and text.index(stop) == 6
    out = client.completions.create(model=TARGET_ID, prompt="Once upon a time", max_tokens=24, temperature=0,
                                    stop=["never appears", stop])
    assert out.choices[0].text == text[:6]
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == stop


def test_request_ids(server, client):
    raw = client.completions.with_raw_response.create(model=TARGET_ID, prompt="hi", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "cmpl-trace-42"
    raw = client.chat.completions.with_raw_response.create(model=TARGET_ID, max_tokens=2,
                                                           messages=[{"role": "user", "content": "hi"}])
    generated = raw.headers["x-request-id"]   # Serve's proxy generates one
    assert re.fullmatch(r"[0-9a-f-]{32,36}", generated) and raw.parse().id == f"chatcmpl-{generated}"

    async def same_id_twice():   # a client's id may repeat: the engine still gets distinct requests
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)
        try:
            return await asyncio.gather(*(aclient.completions.create(
                model=TARGET_ID, prompt="abc", max_tokens=6, temperature=0, n=2,
                extra_headers={"X-Request-Id": "dup"}) for _ in range(2)))
        finally:
            await aclient.close()

    outs = asyncio.run(same_id_twice())
    assert [len(o.choices) for o in outs] == [2, 2] and all(c.finish_reason == "length" for o in outs
                                                            for c in o.choices)
    # errors carry it too; an id that is no plain token works (the engine gets a generated one)
    bad = requests.post(server + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30,
                        headers={**AUTH, "X-Request-Id": "trace 43"})
    assert bad.status_code == 404 and bad.headers["x-request-id"] == "trace 43"
    odd = requests.post(server + "/v1/completions", json={"model": TARGET_ID, "prompt": "x", "max_tokens": 2},
                        timeout=30, headers={**AUTH, "X-Request-Id": "trace 44"})
    assert odd.status_code == 200 and odd.json()["id"] == "cmpl-trace 44"


def test_finish_reason_abort(server, client):
    from ray import serve

    raw = client.completions.with_raw_response.create(model=TARGET_ID, prompt="Once", max_tokens=200,
                                                      extra_body={"ignore_eos": True}, stream=True)
    engine_id = f"{raw.headers['x-request-id']}-0"   # a generated request id names the engine request
    chunks = iter(raw.parse())
    first = next(chunks)
    assert first.choices[0].finish_reason is None
    live = scrape(server)   # the engine's state while the request runs
    assert sample(live, "vllm:num_requests_running") >= 1 and sample(live, "vllm:num_requests_waiting") == 0
    assert 0 < sample(live, "vllm:kv_cache_usage_perc") <= 1
    assert serve.get_deployment_handle("MineDraftEngine", app_name="compat").abort.remote(engine_id).result()
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "abort" and last.model_extra["stop_reason"] is None


def test_cors(server):
    url = server + "/v1/completions"
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = requests.options(url, headers=preflight, timeout=30)   # browsers send no credentials here
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = requests.options(url, headers={**preflight, "Origin": "https://evil.example"}, timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = requests.post(url, json={"model": TARGET_ID, "prompt": "hi", "max_tokens": 1}, timeout=30,
                      headers={**AUTH, "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    r = requests.post(url, json={"model": TARGET_ID, "prompt": "hi", "max_tokens": 1}, timeout=30,
                      headers={"Origin": ORIGIN})
    assert r.status_code == 401   # CORS is no way around the API key


# ---------------------------------------------------------------- /metrics

def test_metrics_need_the_key(server):
    assert requests.get(server + "/metrics", timeout=30).status_code == 401
    text = requests.get(server + "/metrics", headers=AUTH, timeout=30).text
    from minedraft_ray.serve.vllm_metrics import VLLM_SERIES
    for name, (kind, _) in VLLM_SERIES.items():
        shown = f"{name}_total" if kind == "counter" else f"{name}_count" if kind == "histogram" else name
        assert re.search(rf'^{re.escape(shown)}{{.*model_name="{re.escape(TARGET_ID)}"', text, re.M), name


def test_prometheus_scrapes_vllm_series(server, client, tmp_path_factory):
    from test_metrics import Prometheus

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is missing: run .ci/install-prometheus.sh (Debian package `prometheus`)")
    before = scrape(server)
    prompts = ["def fibonacci(n):", "The quick brown fox", "import os\n", "class Foo:"]
    lengths = [5, 12, 8, 20]
    outs = [client.completions.create(model=TARGET_ID, prompt=p, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True}) for p, n in zip(prompts, lengths)]
    stats = [o.model_extra["minedraft"] for o in outs]
    host_port = server.removeprefix("http://")
    job = f"    metrics_path: /metrics\n    authorization:\n      type: Bearer\n      credentials: {KEY}\n"
    prom = Prometheus(binary, host_port, tmp_path_factory.mktemp("prom_api"), job=job)
    try:
        sel = f'model_name="{TARGET_ID}",engine="0"'
        base = {name: sample(before, name) for name in (
            "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_count",
            "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total", "vllm:request_num_preemptions_count")}
        base["length"] = sample(before, "vllm:request_success_total", finished_reason="length")
        expected = {
            f"sum(vllm:generation_tokens_total{{{sel}}})": base["vllm:generation_tokens_total"] + sum(lengths),
            f"sum(vllm:prompt_tokens_total{{{sel}}})":
                base["vllm:prompt_tokens_total"] + sum(o.usage.prompt_tokens for o in outs),
            f'sum(vllm:request_success_total{{{sel},finished_reason="length"}})': base["length"] + len(outs),
            f"sum(vllm:time_to_first_token_seconds_count{{{sel}}})":
                base["vllm:time_to_first_token_seconds_count"] + len(outs),
            f"sum(vllm:e2e_request_latency_seconds_count{{{sel}}})":
                base["vllm:e2e_request_latency_seconds_count"] + len(outs),
            f"sum(vllm:spec_decode_num_drafts_total{{{sel}}})":
                base["vllm:spec_decode_num_drafts_total"] + sum(s["verify_steps"] for s in stats),
            f"sum(vllm:spec_decode_num_draft_tokens_total{{{sel}}})":
                base["vllm:spec_decode_num_draft_tokens_total"] + sum(s["drafted"] for s in stats),
            f"sum(vllm:spec_decode_num_accepted_tokens_total{{{sel}}})":
                base["vllm:spec_decode_num_accepted_tokens_total"] + sum(s["accepted"] for s in stats),
            f"sum(vllm:spec_decode_num_accepted_tokens_per_pos_total{{{sel}}})":
                base["vllm:spec_decode_num_accepted_tokens_per_pos_total"] + sum(s["accepted"] for s in stats),
            # prefix caching on: each prompt's tokens looked up once (the pool is far larger than these need)
            f"sum(vllm:prefix_cache_queries_total{{{sel}}})":
                base["vllm:prefix_cache_queries_total"] + sum(o.usage.prompt_tokens for o in outs),
            f"sum(vllm:num_preemptions_total{{{sel}}})": base["vllm:num_preemptions_total"],
            f"sum(vllm:request_num_preemptions_count{{{sel}}})":
                base["vllm:request_num_preemptions_count"] + len(outs),
            f"sum(vllm:num_requests_running{{{sel}}})": 0,
            f"sum(vllm:num_requests_waiting{{{sel}}})": 0,
            f"sum(vllm:kv_cache_usage_perc{{{sel}}})": 0,
        }
        assert sum(s["drafted"] for s in stats) > 0
        deadline = time.monotonic() + 30
        while True:
            seen = {e: prom.scalar(e) for e in expected}
            wrong = {e: (seen[e], v) for e, v in expected.items() if seen[e] is None or abs(seen[e] - v) > 1e-6}
            if not wrong or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not wrong, f"(prometheus, expected): {wrong}"
        itl = prom.scalar(f"sum(vllm:inter_token_latency_seconds_count{{{sel}}})")
        assert base["vllm:inter_token_latency_seconds_count"] < itl <= \
            base["vllm:inter_token_latency_seconds_count"] + sum(n - 1 for n in lengths)
        buckets = {r["metric"]["le"] for r in prom.query(f"vllm:time_to_first_token_seconds_bucket{{{sel}}}")}
        assert len(buckets) == 23 and "0.001" in buckets and "2560.0" in buckets
    finally:
        prom.close()


# ---------------------------------------------------------------- vLLM's own client tooling

def vllm_venv() -> Path | None:
    venv = Path(os.environ.get("MINEDRAFT_VLLM_VENV", REPO / ".venv-vllm"))
    return venv if (venv / "bin" / "vllm").is_file() else None


VLLM_BENCH_BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}

# `vllm bench serve` once per backend, as the `vllm` script runs it (its CLI's main() on that argv), both runs in one
# interpreter: vLLM's import is most of a run's CPU (~10 s here), paid once for both
VLLM_CLI_RUNS = """\
import json, sys
from vllm.entrypoints.cli.main import main
for argv in json.loads(sys.argv[1]):
    sys.argv = ["vllm", *argv]
    main()
"""


@pytest.fixture(scope="module")
def vllm_bench_results(server, hf_home, tmp_path_factory) -> dict[str, dict]:
    """Each backend's saved result of `vllm bench serve` against the server."""
    venv = vllm_venv()
    if venv is None:
        pytest.skip("no vLLM venv (scripts/setup-vllm-venv.sh; or set MINEDRAFT_VLLM_VENV)")
    snapshot = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    results = tmp_path_factory.mktemp("vllm_bench")
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "LD_PRELOAD": str(venv / "lib" / "libiomp5.so")}
    env.pop("PYTHONPATH", None)
    runs = [["bench", "serve", "--backend", backend, "--base-url", server, "--endpoint", endpoint, "--model",
             TARGET_ID, "--tokenizer", str(snapshot), "--dataset-name", "random", "--num-prompts", "24",
             "--random-input-len", "24", "--random-output-len", "12", "--ignore-eos", "--ready-check-timeout-sec", "0",
             "--disable-tqdm", "--save-result", "--result-dir", str(results), "--result-filename", f"{backend}.json"]
            for backend, endpoint in VLLM_BENCH_BACKENDS.items()]
    run = subprocess.run([str(venv / "bin" / "python"), "-c", VLLM_CLI_RUNS, json.dumps(runs)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {backend: {**json.loads((results / f"{backend}.json").read_text()), "stdout": run.stdout}
            for backend in VLLM_BENCH_BACKENDS}


@pytest.mark.parametrize("backend", VLLM_BENCH_BACKENDS)
def test_vllm_bench_serve(vllm_bench_results, backend):
    result = vllm_bench_results[backend]
    assert result["completed"] == 24 and result.get("failed", 0) == 0, result["stdout"][-3000:]
    assert result["total_output_tokens"] == 24 * 12


def test_serving_processes_freeze_their_startup_heap(server):
    """The ingress and the engine replica's manager keep what startup built out of the collector's scans (a full
    collection over it stalls every stream they serve), and say so on Ray's metrics export."""
    node = ray.nodes()[0]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    frozen: dict[str, float] = {}
    deadline = time.monotonic() + 40   # Ray's metrics agent exports every ~10 s
    while time.monotonic() < deadline:
        text = requests.get(url, timeout=10).text
        frozen = {s.labels["process"]: s.value for family in text_string_to_metric_families(text)
                  for s in family.samples
                  if s.name == "ray_minedraft_gc_frozen_objects" and s.labels.get("model") == TARGET_ID}
        if {"ingress", "manager"} <= frozen.keys():
            break
        time.sleep(1)
    assert frozen.get("ingress", 0) > 1000 and frozen.get("manager", 0) > 1000, frozen
