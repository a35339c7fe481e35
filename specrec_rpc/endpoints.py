"""Replica discovery from the Kubernetes API: the ready endpoints of a Service.

:class:`EndpointSliceWatcher` lists the ``discovery.k8s.io/v1`` EndpointSlices
labelled ``kubernetes.io/service-name=<service>`` in a namespace, then
watches them, and calls ``on_change(addresses)`` with every ready endpoint's
``ip:port`` whenever the set changes. A pod that is not ready (readiness
probe failing, terminating) drops out before it stops answering, which DNS
does not tell a client. This is what the design card's ``kubernetes``
package is for. In a pod it uses the in-cluster service account (the chart
grants ``list``/``watch`` on endpointslices when discovery is ``k8s``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from kubernetes import watch


def ready_addresses(slices: dict[str, dict], port: int | str) -> list[str]:
    """Every ready endpoint of the slices as ``ip:port`` (``port``: a number, or a port name)."""
    out: list[str] = []
    for sl in slices.values():
        p = None
        for sp in sl.get("ports") or []:
            if str(sp.get("port")) == str(port) or sp.get("name") == str(port):
                p = sp.get("port")
        if p is None:
            p = port if str(port).isdigit() else None
        if p is None:
            continue
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            for addr in ep.get("addresses") or []:
                a = f"[{addr}]:{p}" if ":" in addr else f"{addr}:{p}"
                if a not in out:
                    out.append(a)
    return sorted(out)


class EndpointSliceWatcher:
    def __init__(self, api_client, namespace: str, service: str, port: int | str,
                 on_change: Callable[[list[str]], None], retry_s: float = 1.0):
        self.api_client, self.namespace, self.service, self.port = api_client, namespace, service, port
        self.on_change, self.retry_s = on_change, retry_s
        self.slices: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: watch.Watch | None = None
        self.log = structlog.get_logger("endpoints").bind(namespace=namespace, service=service)

    @classmethod
    def from_target(cls, rest: str, on_change: Callable[[list[str]], None]) -> EndpointSliceWatcher:
        """``namespace/service:port`` with in-cluster credentials."""
        from kubernetes import client, config

        ns_svc, _, port = rest.rpartition(":")
        namespace, _, service = ns_svc.partition("/")
        if not service:
            raise ValueError(f"k8s target must be 'k8s:namespace/service:port', got {rest!r}")
        config.load_incluster_config()
        return cls(client.ApiClient(), namespace, service, port, on_change)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"endpointslices {self.service}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _publish(self) -> None:
        self.on_change(ready_addresses(self.slices, self.port))

    def _run(self) -> None:
        from kubernetes import client, watch

        api = client.DiscoveryV1Api(self.api_client)
        selector = f"kubernetes.io/service-name={self.service}"
        delay = self.retry_s
        while not self._stop.is_set():
            try:
                lst = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                         _preload_content=False)
                body = _json(lst)
                self.slices = {it["metadata"]["name"]: it for it in body.get("items", [])}
                self._publish()
                delay = self.retry_s  # the API answered: the next failure starts the backoff afresh
                self._watch = w = watch.Watch()
                version = body.get("metadata", {}).get("resourceVersion")
                for ev in w.stream(api.list_namespaced_endpoint_slice, self.namespace,
                                             label_selector=selector, resource_version=version, timeout_seconds=300):
                    if self._stop.is_set():
                        return
                    obj = ev.get("raw_object") or {}
                    name = (obj.get("metadata") or {}).get("name")
                    if not name:
                        continue
                    if ev.get("type") == "DELETED":
                        self.slices.pop(name, None)
                    else:
                        self.slices[name] = obj
                    self._publish()
            except Exception as e:  # noqa: BLE001 - the API went away: keep the last known endpoints, retry
                if self._stop.is_set():
                    return
                self.log.warning("endpointslice watch failed; retrying", error=str(e), retry_s=delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)  # an API server that is down is not hammered


def _json(resp) -> dict:
    import json

    data = resp.data if hasattr(resp, "data") else resp.read()
    return json.loads(data)
