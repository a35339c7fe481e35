"""Settings every service shares; each service subclasses with its own
``env_prefix`` (``SPECREC_<SERVICE>_``) and fields. Values come from the
environment, then from command-line flags (``--port 50053``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", cli_parse_args=False)

    host: str = Field("0.0.0.0", description="address the gRPC server binds")
    port: int = Field(50050, ge=0, le=65535, description="gRPC port")
    metrics_port: int = Field(9100, ge=0, le=65535, description="Prometheus /metrics HTTP port (0 = off)")
    max_message_mb: int = Field(16, ge=1, le=1024, description="largest gRPC message a caller may send, MiB")
    keepalive_s: int = Field(
        30, ge=1, le=3600, description="HTTP/2 keepalive ping interval, seconds (clients send, servers accept)"
    )
    max_connection_age_s: float = Field(300.0, gt=0, le=86_400, description="a server closes connections older than "
                                        "this (gracefully), so clients re-resolve and spread over new replicas")
    max_connection_age_grace_s: float = Field(10.0, ge=0, le=3600, description="time in-flight calls get when a "
                                              "connection is aged out")
    grace_s: float = Field(10.0, ge=0, le=3600, description="on SIGTERM, seconds to let in-flight requests finish")
    max_concurrent_rpcs: int = Field(0, ge=0, le=1_000_000, description="calls in flight gRPC itself admits "
                                     "(the aio server's maximum_concurrent_rpcs): past it, it answers "
                                     "RESOURCE_EXHAUSTED before any of the service's Python runs, health checks "
                                     "included; 0: no bound at the door (max_concurrency still sheds)")
    health_port: int | None = Field(None, ge=0, le=65535, description="a second port serving the health service "
                                    "alone, outside max_concurrent_rpcs' bound, so that probes answer while the door "
                                    "sheds (0: a free port); None: the health service on the main port only")
    max_concurrency: int = Field(256, ge=1, le=1_000_000, description="concurrent RPCs (a batch counts each item) "
                                 "before new ones are shed (RESOURCE_EXHAUSTED)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    tls_cert_file: Path | None = Field(None, description="PEM certificate: serve TLS (and, with tls_ca_file and "
                                       "require_client_auth on the other side, the client certificate for mTLS)")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file")
    tls_ca_file: Path | None = Field(None, description="PEM CA bundle: clients verify servers with it (TLS to the "
                                     "other services), servers verify client certificates with it (mTLS)")
    tls_require_client_auth: bool = Field(False, description="mTLS: a client without a certificate signed by "
                                          "tls_ca_file is refused")
    tls_server_name: str = Field("", description="name checked in the servers' certificates (clients dial pod IPs; "
                                 "e.g. the chart's service name); empty: the address dialled")
    reflection: bool = Field(True, description="gRPC server reflection (the chart turns it off)")
    catalogue_min_reload_s: float = Field(
        0.0, ge=0.0, le=3600.0, description="a new catalogue version is installed at most this often; versions "
        "written faster are coalesced (0: every version a poll sees; installs come as deltas, and a service that "
        "skips a version fetches it on the path of the first request pinned to it)")
    otlp_endpoint: str = Field(
        "",
        description="OpenTelemetry: export traces (a span per RPC, context carried to the "
        "other services) to this OTLP/gRPC endpoint, e.g. http://otel-collector:4317; empty: off",
    )
    log_json: bool = Field(True, description="structured JSON logs (false: human-readable)")

    @classmethod
    def from_args(cls, argv: list[str] | None = None):
        """Environment first, then ``--field value`` flags (dashes or underscores)."""
        if argv is None:
            return cls()
        return cls(_cli_settings_source=CliSettingsSource(cls, cli_parse_args=argv, cli_kebab_case=True))
