"""A tiny fake Kubernetes API server, enough for ``helm template --dry-run=server``.

Helm's ``lookup`` only returns something when Helm talks to a cluster. This
server answers the discovery requests Helm makes (``/version``, ``/api``,
``/apis`` and the resource lists of the group-versions the chart uses), serves
the objects it is given by path (e.g. the chart's Secret left by an earlier
install), and answers 404 to everything else, which Helm's install dry run
reads as "does not exist yet". Nothing is ever created: it is a dry run.

    with FakeApiServer({"/api/v1/namespaces/ns/secrets/rel-specrec": secret}) as url:
        helm template ... --dry-run=server --disable-openapi-validation --kube-apiserver url
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: group-version -> (plural, kind) of every resource the chart renders
RESOURCES = {
    "v1": [("secrets", "Secret"), ("services", "Service"), ("serviceaccounts", "ServiceAccount"), ("pods", "Pod")],
    "apps/v1": [("deployments", "Deployment"), ("statefulsets", "StatefulSet")],
    "batch/v1": [("jobs", "Job")],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy")],
    "autoscaling/v2": [("horizontalpodautoscalers", "HorizontalPodAutoscaler")],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor")],
}

_NOT_FOUND = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}


def _resource_list(gv: str) -> dict:
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": [
        {"name": plural, "singularName": kind.lower(), "namespaced": True, "kind": kind,
         "verbs": ["get", "list", "create", "update", "patch", "delete"]} for plural, kind in RESOURCES[gv]]}


def _group_list() -> dict:
    groups = []
    for gv in RESOURCES:
        if "/" in gv:
            group, version = gv.split("/")
            ref = {"groupVersion": gv, "version": version}
            groups.append({"name": group, "versions": [ref], "preferredVersion": ref})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


class FakeApiServer:
    """Serves ``objects`` ({URL path: object}) and discovery on 127.0.0.1; a context manager
    whose value is the server's URL. ``requests`` lists the paths asked for."""

    def __init__(self, objects: dict[str, dict] | None = None):
        self.objects = dict(objects or {})
        self.requests: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                path = self.path.split("?", 1)[0]
                fake.requests.append(path)
                if path == "/version":
                    return self._send(200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0",
                                            "platform": "linux/amd64"})
                if path == "/api":
                    return self._send(200, {"kind": "APIVersions", "versions": ["v1"],
                                            "serverAddressByClientCIDRs": []})
                if path == "/apis":
                    return self._send(200, _group_list())
                if path == "/api/v1":
                    return self._send(200, _resource_list("v1"))
                if path.startswith("/apis/") and path[len("/apis/"):] in RESOURCES:
                    return self._send(200, _resource_list(path[len("/apis/"):]))
                if path in fake.objects:
                    return self._send(200, fake.objects[path])
                if path.endswith("/secrets"):  # Helm's release storage: no releases
                    return self._send(200, {"kind": "SecretList", "apiVersion": "v1", "metadata": {}, "items": []})
                return self._send(404, _NOT_FOUND)

            def do_POST(self):  # noqa: N802  (never expected in a dry run)
                fake.requests.append("POST " + self.path)
                return self._send(404, _NOT_FOUND)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
