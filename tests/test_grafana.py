"""The Grafana dashboard: the checked-in JSON is what the code builds and parses into the SDK's typed model;
`minedraft grafana push` speaks Grafana's documented HTTP API.

No Grafana server installs here (neither Debian nor PyPI ships one), so the push goes to a local HTTP
server that answers like Grafana and records every call; the test checks paths, methods, auth headers and
payload shapes against Grafana's API reference (api/folder, api/dashboard):
  GET  /api/folders                 -> [{"id", "uid", "title"}]
  POST /api/folders                 {"title", "uid"?} -> {"id", "uid", "title", ...}
  POST /api/dashboards/db           {"dashboard": {... "id": null, "uid"}, "folderUid"?, "overwrite", "message"}
                                    -> {"id", "uid", "url", "status": "success", "version", "slug"}
"""
import argparse
import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from minedraft_ray.observability import SERIES
from minedraft_ray.observability import grafana


class FakeGrafana(ThreadingHTTPServer):
    """Answers the folder and dashboard endpoints like Grafana 11; 404 for anything else."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.calls = []       # (method, path, headers, json body or None)
        self.folders = [{"id": 1, "uid": "existing-uid", "title": "Existing"}]
        self.dashboards = {}  # uid -> (dashboard, folderUid, version)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.server.calls.append((self.command, self.path, dict(self.headers), body))
        return body

    def do_GET(self):
        self._record()
        if self.path.split("?")[0] == "/api/folders":
            return self._reply(200, self.server.folders)
        self._reply(404, {"message": "Not found"})

    def do_POST(self):
        body = self._record()
        srv = self.server
        if self.path == "/api/folders":
            folder = {"id": len(srv.folders) + 1, "uid": body.get("uid") or f"f{len(srv.folders) + 1}",
                      "title": body["title"], "url": "/dashboards/f/x", "version": 1}
            srv.folders.append(folder)
            return self._reply(200, folder)
        if self.path == "/api/dashboards/db":
            dash = body["dashboard"]
            uid = dash["uid"]
            if uid in srv.dashboards and not body.get("overwrite"):
                return self._reply(412, {"message": "The dashboard has been changed by someone else",
                                         "status": "version-mismatch"})
            version = srv.dashboards[uid][2] + 1 if uid in srv.dashboards else 1
            srv.dashboards[uid] = (dash, body.get("folderUid"), version)
            return self._reply(200, {"id": 7, "uid": uid, "url": f"/d/{uid}/minedraft-engine", "status": "success",
                                     "version": version, "slug": "minedraft-engine"})
        self._reply(404, {"message": "Not found"})


@pytest.fixture
def fake_grafana():
    srv = FakeGrafana()
    srv.thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="minedraft")
    grafana.add_grafana_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_checked_in_dashboard_is_generated_and_typed():
    on_disk = json.loads(grafana.DASHBOARD_JSON.read_text())
    assert on_disk == grafana.dashboard_json(), \
        "deployments/grafana/minedraft-dashboard.json is stale: python -m minedraft_ray.observability.grafana > it"
    # the SDK's typed model parses it and writes the same JSON back: no key outside Grafana's schema
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    typed = grafana.load_checked()
    assert json.loads(JSONEncoder(sort_keys=True).encode(typed)) == on_disk
    assert typed.uid == grafana.DASHBOARD_UID
    panels = [p for p in typed.panels if getattr(p, "type_val", None) in ("timeseries", "stat")]
    assert len(panels) >= 20
    assert [p.id_val for p in typed.panels] == list(range(1, len(typed.panels) + 1))
    for p in panels:
        assert p.targets, p.title
        assert p.grid_pos.x + p.grid_pos.w <= 24


def test_every_query_reads_known_series_with_the_label_filter():
    dash = grafana.dashboard_json()
    exprs = grafana.dashboard_queries(dash)
    used = set()
    for expr in exprs:
        names = re.findall(r"\bray_minedraft_\w+", expr)
        assert names, expr
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in SERIES or (base in SERIES and SERIES[base][0] == "histogram"), name
            used.add(base if base in SERIES else name)
        if not expr.startswith("label_values"):
            # every selector filters on the three dashboard variables
            assert expr.count("ray_minedraft_") == expr.count(grafana.SEL), expr
    assert used == set(SERIES), f"series without a panel: {set(SERIES) - used}"
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "model", "mode", "replica"]


def test_docs_list_every_series():
    docs = (grafana.DASHBOARD_JSON.parents[2] / "docs" / "observability.md").read_text()
    missing = [name for name in SERIES if f"`{name}`" not in docs]
    assert not missing, f"docs/observability.md does not list {missing}"


def test_push_with_token_creates_the_folder(fake_grafana, capsys):
    push = ["grafana", "push", "--url", fake_grafana.url, "--token", "glsa_secret", "--folder", "MineDraft"]
    assert run_cli(push) == 0
    calls = fake_grafana.calls
    assert [(m, p.split("?")[0]) for m, p, _, _ in calls] == [
        ("GET", "/api/folders"), ("POST", "/api/folders"), ("POST", "/api/dashboards/db")]
    for _, _, headers, _ in calls:
        assert headers["Authorization"] == "Bearer glsa_secret"
    assert calls[1][3] == {"title": "MineDraft"}
    assert calls[2][2]["Content-Type"].startswith("application/json")
    body = calls[2][3]
    new_uid = fake_grafana.folders[-1]["uid"]
    assert set(body) == {"dashboard", "folderUid", "overwrite", "message"}
    assert body["folderUid"] == new_uid and body["overwrite"] is True
    assert body["dashboard"]["id"] is None      # Grafana: id null creates, uid identifies
    assert body["dashboard"] == {**grafana.dashboard_json(), "id": None}
    assert f"/d/{grafana.DASHBOARD_UID}/" in capsys.readouterr().out

    # a second push finds the folder by title and overwrites (version 2), no second folder
    fake_grafana.calls.clear()
    assert run_cli(push) == 0
    assert [(m, p.split("?")[0]) for m, p, _, _ in fake_grafana.calls] == [
        ("GET", "/api/folders"), ("POST", "/api/dashboards/db")]
    assert fake_grafana.dashboards[grafana.DASHBOARD_UID][2] == 2
    assert sum(f["title"] == "MineDraft" for f in fake_grafana.folders) == 1


def test_push_basic_auth_from_env_into_existing_folder_by_uid(fake_grafana, monkeypatch):
    monkeypatch.setenv("GRAFANA_URL", fake_grafana.url)
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert run_cli(["grafana", "push", "--user", "admin", "--password", "pw", "--folder", "existing-uid"]) == 0
    assert [(m, p.split("?")[0]) for m, p, _, _ in fake_grafana.calls] == [
        ("GET", "/api/folders"), ("POST", "/api/dashboards/db")]
    expected = "Basic " + base64.b64encode(b"admin:pw").decode()
    assert all(h["Authorization"] == expected for _, _, h, _ in fake_grafana.calls)
    assert fake_grafana.calls[-1][3]["folderUid"] == "existing-uid"


def test_push_without_folder_goes_to_general_and_errors_surface(fake_grafana, monkeypatch):
    monkeypatch.setenv("GRAFANA_TOKEN", "t0k")
    assert run_cli(["grafana", "push", "--url", fake_grafana.url]) == 0
    ((method, path, headers, body),) = fake_grafana.calls
    assert (method, path) == ("POST", "/api/dashboards/db") and "folderUid" not in body
    assert headers["Authorization"] == "Bearer t0k"
    # a Grafana error (404 here: wrong path prefix) is raised, not swallowed
    from grafana_client.client import GrafanaClientError
    with pytest.raises(GrafanaClientError):
        run_cli(["grafana", "push", "--url", fake_grafana.url + "/nothing-here"])
    with pytest.raises(SystemExit, match="GRAFANA_URL"):
        monkeypatch.delenv("GRAFANA_URL", raising=False)
        run_cli(["grafana", "push"])


def test_export_writes_the_dashboard(tmp_path):
    out = tmp_path / "d.json"
    assert run_cli(["grafana", "export", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == grafana.dashboard_json()
