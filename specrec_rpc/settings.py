"""Settings every service shares; each service subclasses with its own
``env_prefix`` (``SPECREC_<SERVICE>_``) and fields. Values come from the
environment, then from command-line flags (``--port 50053``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", cli_parse_args=False)

    host: str = Field("0.0.0.0", description="address the gRPC server binds")
    port: int = Field(50050, description="gRPC port")
    metrics_port: int = Field(9100, description="Prometheus /metrics HTTP port (0 = off)")
    max_message_mb: int = Field(16, description="largest gRPC message accepted or sent, MiB")
    keepalive_s: int = Field(30, description="HTTP/2 keepalive ping interval, seconds")
    grace_s: float = Field(10.0, description="on SIGTERM, seconds to let in-flight requests finish")
    max_concurrency: int = Field(256, description="concurrent RPCs before new ones are shed (RESOURCE_EXHAUSTED)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_json: bool = Field(True, description="structured JSON logs (false: human-readable)")

    @classmethod
    def from_args(cls, argv: list[str] | None = None):
        """Environment first, then ``--field value`` flags (dashes or underscores)."""
        if argv is None:
            return cls()
        return cls(_cli_settings_source=CliSettingsSource(cls, cli_parse_args=argv, cli_kebab_case=True))
