"""Settings of the item-set service (env ``SPECREC_ITEMSET_*``, or ``--flags``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from specrec_rpc.settings import ServiceSettings


def check_namespace(ns: str) -> str:
    if not ns or len(ns) > 64 or any(c in ns for c in "{}") or not ns.isprintable() or any(c.isspace() for c in ns):
        raise ValueError(f"namespace {ns!r}: 1-64 printable characters, no spaces or braces")
    return ns


class ItemSetSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPECREC_ITEMSET_", extra="ignore")

    port: int = Field(50051, description="gRPC port")
    metrics_port: int = Field(9101, description="Prometheus /metrics HTTP port (0 = off)")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL: redis://, rediss://, unix:// (a standalone server unless "
        "redis_cluster), or redis+sentinel://[:password@]host:26379[,host:26379...]/<master>[/db] "
        "(rediss+sentinel:// for TLS): the primary is asked of the sentinels, again after a failover",
    )
    redis_password: SecretStr = Field(SecretStr(""), description="Redis password (AUTH) when redis_url carries none "
                                      "(e.g. from a Secret); the URL's wins")
    redis_sentinel_password: SecretStr = Field(SecretStr(""), description="the sentinels' own password, when they "
                                               "require one (redis+sentinel:// only)")
    write_replicas: int = Field(-1, ge=-1, description="replicas that must hold a write (Redis WAIT) before it is "
                                "acknowledged; fewer within write_wait_s: UNAVAILABLE (retrying is safe). -1 = auto: "
                                "1 for a replicated Redis (a Sentinel URL, or a primary once seen with a replica: "
                                "after a failover that left no replica, writes are refused until one connects), "
                                "else 0 (a lone Redis); 0 = primary-only acknowledgements")
    write_wait_s: float = Field(1.0, gt=0, description="how long a write waits for write_replicas replicas "
                                "(WAIT timeout; kept below redis_timeout_s)")
    write_retry_s: float = Field(10.0, ge=0, description="how long a write retries while Redis is unreachable, "
                                 "read-only or short of replicas (a failover), within the caller's gRPC deadline; "
                                 "then UNAVAILABLE")
    redis_cluster: bool = Field(False, description="treat redis_url as a Redis Cluster entry node (every key of a "
                                "namespace shares one hash slot, so transactions and scripts work there)")
    namespace: str = Field("specrec", description="key namespace; every key is prefixed with the hash tag {namespace}")
    write_token: SecretStr = Field(
        SecretStr(""),
        description="bearer token that Upsert/Delete/Rollback need in "
        "metadata 'authorization: Bearer <token>'; empty = writes refused (PERMISSION_DENIED)",
    )
    bundle: Path | None = Field(None, description="bundle directory: SID tokenizer for new items (RQ codebooks, level "
                                "sizes, collision size) and the catalogue bulk-loaded into an empty namespace")
    load_if_empty: bool = Field(
        True, description="at start, bulk-load the bundle's catalogue when the namespace has no version"
    )
    keep_versions: int = Field(3, ge=1, description="catalogue versions kept in Redis (older ones are deleted); "
                               "Rollback can return to any of them")
    redis_timeout_s: float = Field(2.0, gt=0, description="Redis connect and per-command timeout, seconds; "
                                   "a slower or absent Redis makes the RPC fail with UNAVAILABLE")
    startup_wait_s: float = Field(30.0, ge=0, description="at start, how long to wait for Redis; after that the "
                                  "service starts anyway (RPCs answer UNAVAILABLE until Redis is back)")
    watch_s: float = Field(0.5, ge=0, le=3600, description="how often the catalogue in Redis is checked against the "
                           "item set's own copy (restored when Redis lost or rolled back its data); 0 = never")
    warm_up: bool = Field(True, description="load and run the text embedder once at start, in the background (the "
                          "first Upsert waits for it, and is then fast)")

    @field_validator("namespace")
    @classmethod
    def _ns(cls, v: str) -> str:
        return check_namespace(v)
