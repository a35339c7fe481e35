"""`specrec recommend` shows a gRPC error as `STATUS: message` and exits non-zero, with no traceback; the
answer's ignored history ids are printed. A small Recommender server on loopback stands in for the gateway
(the real gateway's statuses are tested in tests/integration)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

pytest.importorskip("specrec_rpc.v1", reason="generated gRPC code missing (python -m specrec_rpc.codegen)")

from specrec.cli import main  # noqa: E402
from specrec_rpc.v1 import common_pb2, recommender_pb2, recommender_pb2_grpc  # noqa: E402
from specrec_stack.localstack import free_port  # noqa: E402


class FakeGateway(recommender_pb2_grpc.RecommenderServicer):
    def Recommend(self, request, context):
        known = [h for h in request.history if h.isdigit() and int(h) < 100]
        if not known:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"history: none of the {len(request.history)} item ids is in catalogue version 1.3")
        items = [recommender_pb2.RecommendedItem(item_id=h, sid=common_pb2.Sid(codes=[1, 2, 3, 0]), score=-1.5,
                                                 title=f"item {h}", source="beam") for h in known]
        stats = recommender_pb2.RecommendStats(policy="beam", served_by="beam", catalogue_version="1.3",
                                               ignored_history=[h for h in request.history if h not in known])
        return recommender_pb2.RecommendResponse(items=items, stats=stats)


@pytest.fixture(scope="module")
def gateway():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    recommender_pb2_grpc.add_RecommenderServicer_to_server(FakeGateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_grpc_error_is_one_line_and_exit_nonzero(gateway, capsys):
    rc = main(["recommend", "--history", "99999999", "--target", gateway])
    out, err = capsys.readouterr()
    assert rc != 0
    assert err.strip() == "INVALID_ARGUMENT: history: none of the 1 item ids is in catalogue version 1.3"
    assert "Traceback" not in out + err and out == ""


def test_unreachable_gateway_is_unavailable(capsys):
    rc = main(["recommend", "--history", "1", "--target", f"127.0.0.1:{free_port()}", "--timeout", "2"])
    _, err = capsys.readouterr()
    assert rc != 0 and err.startswith(("UNAVAILABLE: ", "DEADLINE_EXCEEDED: ")) and "Traceback" not in err


def test_ignored_history_ids_are_printed(gateway, capsys):
    assert main(["recommend", "--history", "7,abc,8,zzz", "--target", gateway]) == 0
    out = capsys.readouterr().out
    assert "ignored history ids (not in catalogue v1.3): abc, zzz" in out and "item 7" in out
    assert main(["recommend", "--history", "7,abc", "--target", gateway, "--json"]) == 0
    assert '"ignoredHistory": [\n      "abc"\n    ]' in capsys.readouterr().out


def test_cli_exits_nonzero_in_a_real_process(gateway):
    """The console script itself: exit status and stderr as a user sees them."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "specrec.cli", "recommend", "--history", "99999999", "--target", gateway],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("INVALID_ARGUMENT: history:") and "Traceback" not in p.stderr
