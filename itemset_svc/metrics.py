"""The item set's Prometheus metrics (one place: reads, writes and the service share them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from specrec_rpc.server import LATENCY_BUCKETS

REDIS_SECONDS = Histogram("specrec_itemset_redis_seconds", "Redis round trips of the item set, by operation",
                          ["op"], buckets=LATENCY_BUCKETS)
WRITES = Counter("specrec_itemset_writes", "catalogue writes by operation and outcome", ["op", "outcome"])
ITEMS_WRITTEN = Counter("specrec_itemset_items_written", "items added, replaced or removed by writes", ["op"])
COLLISIONS = Counter("specrec_itemset_collisions", "upserted items whose computed RQ codes were already used")
CATALOGUE_ITEMS = Gauge("specrec_itemset_catalogue_items", "items in the version published last", ["namespace"])
RESTORES = Counter("specrec_itemset_restores", "catalogues restored from the item set's own copy after Redis lost "
                   "or rolled back its data", ["namespace"])
MIRROR_READS = Counter("specrec_itemset_mirror_reads", "reads answered from the item set's own copy because Redis "
                       "could not answer (a failover or a restart)", ["method"])
WRITE_RETRIES = Counter("specrec_itemset_write_retries", "write attempts repeated because Redis was unreachable, "
                        "read-only or short of replicas (a failover)", ["op"])
DELTAS = Counter("specrec_itemset_snapshot_deltas", "snapshots answered with only the changes since the version "
                 "the follower holds (not every item)")
