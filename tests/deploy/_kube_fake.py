"""A Kubernetes API server just large enough for `helm install` and `helm upgrade`.

`helm template` and `--dry-run` never reach a cluster, so the chart's
`lookup` (which keeps generated secrets across upgrades) only runs in a real
install. This server keeps objects in memory and answers discovery, GET
(objects, and lists filtered by label), POST, PUT, PATCH (acknowledged, not
applied: helm's three-way patches are recorded in ``requests``) and DELETE,
for the kinds the chart renders by default. It listens on loopback only and
serves one test.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# path -> (groupVersion, [(resource, kind)])
RESOURCES = {
    "/api/v1": ("v1", [("secrets", "Secret"), ("services", "Service"), ("configmaps", "ConfigMap")]),
    "/apis/apps/v1": ("apps/v1", [("deployments", "Deployment"), ("statefulsets", "StatefulSet")]),
    "/apis/policy/v1": ("policy/v1", [("poddisruptionbudgets", "PodDisruptionBudget")]),
    "/apis/networking.k8s.io/v1": ("networking.k8s.io/v1", [("networkpolicies", "NetworkPolicy")]),
}
MAX_BODY_BYTES = 16 << 20
MAX_REQUESTS = 10_000


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

            def do_PUT(self) -> None:
                fake._handle(self, "PUT")

            def do_PATCH(self) -> None:
                fake._handle(self, "PATCH")

            def do_DELETE(self) -> None:
                fake._handle(self, "DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeKube:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def kubeconfig(self, namespace: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "fake", "user": {"token": "fake"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
                ],
                "current-context": "fake",
            }
        )

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urllib.parse.urlparse(h.path)
        path = url.path.rstrip("/")
        length = int(h.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            return _send(h, 413, _status(413, "TooLarge", "body too large"))
        body = json.loads(h.rfile.read(length) or b"{}") if length else None
        with self._lock:
            if len(self.requests) >= MAX_REQUESTS:
                return _send(h, 429, _status(429, "TooManyRequests", "the fake serves one test"))
            self.requests.append((method, h.path, body))
            code, answer = self._answer(method, path, urllib.parse.parse_qs(url.query), body)
        _send(h, code, answer)

    def _answer(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        if method == "GET":
            return self._get(path, query)
        if method == "POST":
            name = body["metadata"]["name"]
            key = f"{path}/{name}"
            if key in self.objects:
                return 409, _status(409, "AlreadyExists", f"{key} exists")
            body["metadata"]["resourceVersion"] = "1"
            self.objects[key] = body
            return 201, body
        if method == "PUT":
            self.objects[path] = body
            return 200, body
        if path not in self.objects:
            return 404, _status(404, "NotFound", f"{path} not found")
        if method == "PATCH":
            return 200, self.objects[path]
        return 200, {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Success",
            "object": self.objects.pop(path),
        }

    def _get(self, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        if path == "/version":
            return 200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0", "platform": "linux/amd64"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups = []
            for group_version, _ in RESOURCES.values():
                if "/" in group_version:
                    group, version = group_version.split("/")
                    gv = {"groupVersion": group_version, "version": version}
                    groups.append({"name": group, "versions": [gv], "preferredVersion": gv})
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        if path in RESOURCES:
            group_version, resources = RESOURCES[path]
            listed = [
                {"name": name, "singularName": kind.lower(), "namespaced": True, "kind": kind,
                 "verbs": ["create", "delete", "get", "list", "patch", "update"]}
                for name, kind in resources
            ]  # fmt: skip
            return 200, {"kind": "APIResourceList", "groupVersion": group_version, "resources": listed}
        if path in self.objects:
            return 200, self.objects[path]
        for group_version, resources in RESOURCES.values():
            for name, kind in resources:
                if path.endswith(f"/{name}"):
                    items = [o for k, o in self.objects.items() if k.rsplit("/", 1)[0] == path]
                    for selector in query.get("labelSelector", []):
                        for term in selector.split(","):
                            key, _, value = term.partition("=")
                            items = [o for o in items if o["metadata"].get("labels", {}).get(key) == value]
                    return 200, {
                        "kind": f"{kind}List",
                        "apiVersion": group_version,
                        "metadata": {},
                        "items": items,
                    }
        return 404, _status(404, "NotFound", f"{path} not found")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": reason,
        "code": code,
        "message": message,
    }


def _send(h: BaseHTTPRequestHandler, code: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)
