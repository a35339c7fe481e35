"""Which keys of ``bench/results/summary.json`` no step of ``bench/rerun.sh`` writes.

:data:`WRITERS` says, per step of ``rerun.sh``, the keys its commands write (as patterns). A key that matches
none is left over from a command that no longer runs, or was renamed; it is reported, and the count is written
as ``bench.keys_without_writer`` (``tests/unit/test_summary_keys.py`` holds it at 0 for the committed file).

    python -m bench.summary_keys            # list them, write the count
    python -m bench.summary_keys --retire   # also delete them from summary.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from specrec.eval.results import update_summary

SUMMARY = Path(__file__).resolve().parent / "results" / "summary.json"

_P = r"(strict|nezha|specgr|fused|drafter)"  # beam is the reference: no ratio to itself
#: step of bench/rerun.sh -> the keys its commands write
WRITERS: dict[str, list[str]] = {
    "quality": [r"beauty\.loo\.(beam|sasrec)(\.excl)?\.((recall|ndcg)@\d+|users)", r"beauty\.(train|build)\.minutes",
                r"beauty\.model\.params",
                # every policy on all test users, history excluded (specgr ranking by both models against SASRec)
                rf"beauty\.loo\.{_P}\.excl\.((recall|ndcg)@\d+|speedup_vs_beam|recall_ratio_vs_beam|item_acceptance"
                r"|equal_to_beam|no_fallback_share|drafted_level_coverage|whole_frontier_share)",
                r"beauty\.loo\.policies\.excl\.users",
                # bench.fusion_curve: the GR alone ranking SASRec's candidates, the mix's best test ratio at any weight
                r"beauty\.loo\.gr_reranked\.excl\.(recall@10|recall_ratio_vs_sasrec)",
                r"beauty\.loo\.fused\.excl\.best_recall_ratio_any_weight",
                # bench.generalisation: the step from validation to test, and where the GR's ranking loses
                r"beauty\.loo\.(gr|sasrec)\.nll_step_valid_to_test",
                r"beauty\.loo\.gr_reranked\.top10_share_ratio_vs_sasrec\.(valid|test|test_without_last_item)",
                # specrec eval --policies beam,fused,drafter --exclude-history: against the drafter's own list
                r"beauty\.loo\.(fused|served)\.excl\.(recall|ndcg)_ratio_vs_sasrec",
                r"beauty\.loo\.(fused|drafter)\.excl\.valid\.(recall|ndcg)@10",
                r"beauty\.loo\.fused\.excl\.valid_test_gap"],
    "policies": [rf"beauty\.loo\.{_P}(\.k50)?\.(recall|ndcg)@\d+",  # beam's: the quality step's (all users)
                 rf"beauty\.loo\.{_P}(\.k50)?\.(speedup_vs_beam|recall_ratio_vs_beam|recall@10_ratio_vs_beam"
                 r"|equal_to_beam|no_fallback_share|drafted_level_coverage|whole_frontier_share|item_acceptance"
                 r"|token_acceptance)",
                 r"beauty\.loo\.(beam|strict|nezha|specgr|fused|drafter)(\.k50)?\.speedup_vs_eager",
                 r"beauty\.loo\.(beam|strict|nezha|specgr|fused|drafter)(\.k50)?(\.excl)?\.p99_ms",
                 r"beauty\.loo\.beam(\.k50)?\.equal_to_eager", r"beauty\.loo\.policies(\.k50)?\.users",
                 r"beauty\.loo\.(fused|served)(\.k50)?\.(recall|ndcg)_ratio_vs_sasrec"],
    "temporal": [r"beauty\.temporal\.(beam|fused|drafter)(\.unseen0)?\.(in_sample_|unseen_)?(recall|ndcg)@50",
                 r"beauty\.temporal\.policies(\.unseen0)?\.users",
                 r"gateway\.temporal\.(budget_ms|users)",
                 r"gateway\.temporal\.(auto|beam|fused|drafter)\.(gr_ranked_share_at_\d+ms|server_p99_ms"
                 r"|(unseen_)?recall@50)",
                 r"gateway\.temporal\.fused\.fused_share_at_\d+ms"],
    "backends": [r"backends\.(eager|onnx)\.[a-z0-9_+]+\.(p50_ms|speedup_vs_eager)",
                 r"backends\.onnx\.max_abs_diff_vs_eager"],
    "profile": [r"hotpath\.pass\.(fixed_ms|node_us)", r"hotpath\.floor_(ms|ratio)\.beam_w\d+"],
    "startup": [r"verifier\.cold_start_s", r"stack\.(warm_start_s|cold_start_one_by_one_s)",
                r"onnx\.(build_s|graphs_mb)", r"stack\.warm_start\.\w+_s"],
    "index": [r"drafter\.hnsw\.(recall@50|speedup)"],
    "path": [r"(gateway|drafter|verifier)\.fused\.cpu_ms_per_request",
             r"gateway\.bare_front\.(cpu_ms_per_request|over_inprocess_p(50|99))",
             r"verifier\.fused\.inprocess_cpu_ms_per_request", r"gateway\.(fused|beam)\.stack_over_inprocess_p(50|99)",
             r"gateway\.(fused|beam)\.lists_equal_inprocess", r"gateway\.bare_round_trip_p50_ms",
             r"gateway\.fused\.hop_ms_p50\.(client_gateway|gateway_drafter|gateway_verifier)"],
    "serving": [r"gateway\.(auto|beam|strict|nezha|specgr|fused|drafter)\.(overhead_p50_ms|p50_ms|p99_ms_at_\d+ms"
                r"|server_p99_ms_at_\d+ms|budget_exit_share_at_\d+ms|gr_ranked_share_at_\d+ms)",
                r"gateway\.fused\.fused_share_at_\d+ms",
                r"gateway\.auto\.(max_rps_p99_\d+ms|recall_ratio_at_\d+ms|all_fill_share_at_\d+ms"
                r"|recall_ratio_vs_fused_at_\d+ms|gr_ranked_share_open_\d+rps|client_p99_ms_open_\d+rps)"],
    "overload": [r"serving\.capacity_rps", r"serving\.overload_[\d.]+x\.(achieved_rps|client_p99_ms|error_share"
                 r"|generator_lag_p99_ms|model_answer_share|offered_rps|server_p99_ms|shed_share|void|goodput_rps"
                 r"|goodput_ratio)"],
    "soak": [r"soak\.(errors|minutes|p99_drift_ms|rate_rps|rss_growth_max|shed|upsert_errors|upserts_acked)"],
    "chaos": [r"chaos\.(catalogue_items_lost|internal_errors|model_answer_share_during_faults"
              r"|overload_p99_over_budget_ms|recovery_s_max|redis_failover_acked_writes_lost"
              r"|redis_failover_internal_errors|redis_failover_recovery_s|redis_failover\.acked_without_replica)",
              r"chaos\.(cpu_hog|one_core)\.(server_p99_ms|client_p99_ms|undegraded_share|recall_ratio_vs_no_fault"
              r"|gr_ranked_share|fill_share|shed_share)"],
    "scaleout": [r"scaleout\.(errors_on_replica_kill|max_rps_p99_one_replica|max_rps_p99_two_replicas"
                 r"|replica_share_min|(fill_share|server_p99_ms|gr_ranked_share)_on_replica_kill)"],
    "quick": [r"\w+\.quick\.build(\.\w+)?\.minutes",
              r"\w+\.quick\.loo\.(fused|sasrec|beam|served)\.excl\.((recall|ndcg)@10|(recall|ndcg)_ratio_vs_sasrec)",
              r"\w+\.quick\.loo\.(fused|sasrec)\.excl\.valid\.(recall|ndcg)@10",
              r"\w+\.quick\.loo\.fused\.excl\.(valid_recall_ratio_vs_sasrec|valid_test_gap)",
              r"\w+\.quick\.loo\.default_is_fused",
              r"\w+\.quick\.sids_from_interactions",
              # bench.valid_test: each candidate of issue 66 (the protocol, the refit) on validation and test users
              r"\w+\.(quick|served)\.\w+\.loo\.(fused|sasrec|gr_reranked|beam)\.excl"
              r"\.(valid|test|test_chosen|test_without_last)\.(recall|ndcg)@10",
              r"\w+\.(quick|served)\.\w+\.loo\.fused\.excl\.(valid|test|test_chosen|test_without_last)"
              r"\.recall_ratio_vs_sasrec",
              r"\w+\.(quick|served)\.\w+\.loo\.fused\.excl\.valid_test_gap"],
    "catalogue": [r"catalogue\.\w+\.(tables_mb|trie_mb|build_s)", r"catalogue\.\w+\.(beam|nezha|fused)\.(p50|p99)_ms",
                  r"catalogue\.\w+\.itemset\.(load_s|redis_mb|bytes_per_item|upsert_p50_ms|upsert_p99_ms|mirror_load_s"
                  r"|mirror_mb|pack_s|follower_load_s|follower_mb|delta_apply_ms)",
                  r"catalogue\.\w+\.start_s\.(itemset|verifier|drafter|gateway)",
                  r"catalogue\.\w+\.gateway\.auto\.gr_ranked_share_at_30ms",
                  r"catalogue\.\w+\.gateway\.\w+\.p50_ms_at_1s"],
    "keys": [r"bench\.keys_without_writer"],
}
_ALL = re.compile("|".join(f"(?:{p})" for ps in WRITERS.values() for p in ps))


def keys_without_writer(summary: dict) -> list[str]:
    return sorted(k for k in summary if not _ALL.fullmatch(k))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", default=str(SUMMARY))
    ap.add_argument("--retire", action="store_true", help="delete the keys without a writer")
    a = ap.parse_args(argv)
    path = Path(a.summary)
    orphans = keys_without_writer(json.loads(path.read_text()))
    for k in orphans:
        print(f"no writer: {k}")
    update_summary({"bench.keys_without_writer": 0 if a.retire else len(orphans)}, path,
                   retire=tuple(orphans) if a.retire else ())
    print(f"bench.keys_without_writer = {0 if a.retire else len(orphans)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
