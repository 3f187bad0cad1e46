"""/metrics serves vLLM's series under vLLM's own names, help texts, labels and buckets: checked here against the
vLLM package installed in .venv-vllm (its sources, read with `ast`, and its bucket constants), so a vLLM upgrade
that renames or re-buckets a series fails this test instead of silently breaking dashboards."""
import ast
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from minedraft_ray.serve import vllm_metrics as ours  # noqa: E402


def vllm_source(module: str) -> ast.Module:
    return ast.parse(Path(importlib.util.find_spec(module).origin).read_text())


def declared_series() -> dict[str, str]:
    """vLLM's metric name -> help text, from name=/documentation= keywords and ("vllm:...", "help") pairs."""
    series = {}
    for module in ("vllm.v1.metrics.loggers", "vllm.v1.spec_decode.metrics"):
        for node in ast.walk(vllm_source(module)):
            if isinstance(node, ast.Call):
                kw = {k.arg: k.value for k in node.keywords}
                if "name" in kw and "documentation" in kw and isinstance(kw["name"], ast.Constant):
                    try:
                        series[kw["name"].value] = ast.literal_eval(kw["documentation"])
                    except ValueError:   # a computed help text
                        series[kw["name"].value] = None
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                name, doc = (e.value for e in node.elts)
                if name.startswith("vllm:"):
                    series[name] = doc
    return series


def test_names_and_help_texts_are_vllms():
    theirs = declared_series()
    assert len(theirs) > 20   # the parse found vLLM's declarations
    for name, (_, doc) in ours.VLLM_SERIES.items():
        assert name in theirs, f"{name} is no series of the installed vLLM"
        assert theirs[name] == doc, name


def test_labels_and_finish_reasons_are_vllms():
    source = Path(importlib.util.find_spec("vllm.v1.metrics.loggers").origin).read_text()
    assert 'labelnames = ["model_name", "engine"]' in source and ours.LABELS == ("model_name", "engine")
    assert 'labelnames + ["finished_reason"]' in source
    assert 'labelnames + ["position"]' in Path(importlib.util.find_spec("vllm.v1.spec_decode.metrics").origin).read_text()
    from vllm.v1.engine import FinishReason
    assert tuple(str(r) for r in FinishReason) == ours.FINISH_REASONS


def test_buckets_are_vllms():
    from vllm.v1.metrics import buckets

    assert ours.TIME_TO_FIRST_TOKEN_BUCKETS == buckets.TIME_TO_FIRST_TOKEN_BUCKETS
    assert ours.INTER_TOKEN_LATENCY_BUCKETS == buckets.INTER_TOKEN_LATENCY_BUCKETS
    assert ours.REQUEST_LATENCY_BUCKETS == buckets.REQUEST_LATENCY_BUCKETS
    assert ours.REQUEST_NUM_PREEMPTIONS_BUCKETS == buckets.REQUEST_NUM_PREEMPTIONS_BUCKETS
