"""Names that `vulture` (.ci/run, configured in pyproject [tool.vulture]) cannot see used, because something
outside our code reaches them by name. Each entry says who does. Not listed here, because [tool.vulture]
``ignore_decorators`` covers them as a class: gRPC handlers (``@handle_errors``, ``@unary``, ``@stream``: the
generated servicer registration calls them by name), policies (``@register``: looked up by name) and pydantic
validators (``@field_validator``).

An entry is a name, not a place: keep the list short, and never add a name to hide code that is really unused.
"""


class _Whitelist:
    def __getattr__(self, _name):
        return None


_ = _Whitelist()

# torch calls nn.Module.forward through Module.__call__
_.forward
# pydantic reads a model's configuration from this class attribute
_.model_config
# grpc.aio.ServerInterceptor's hook, called by the server for every call
_.intercept_service
# http.server's request handler hooks (the metrics port of a group of processes, specrec_rpc/processes.py)
_.do_GET
_.log_message
# tqdm's hooks, overridden by specrec.terminal.LineProgress: tqdm calls moveto(n) and clear(nolock=...) by name
_.moveto
_.nolock
# PEP 562: Python calls a module's __getattr__ for a name it lacks (specrec/__init__.py's lazy exports)
_.__getattr__
# the public Python API docs/api.md documents (``rec.recommend_batch``); tests call it, nothing inside does
_.recommend_batch
# SidReport's fields: read through as_dict() (its __dict__) into the bundle's metadata and the training log
_.unique_prefixes
_.items_with_collision
_.max_collision_digit
# options that ONNX Runtime (SessionOptions), faiss (HNSW) and torch (torch.backends.*) read when they build or run
_.graph_optimization_level
_.intra_op_num_threads
_.inter_op_num_threads
_.log_severity_level
_.optimized_model_filepath
_.enable_profiling
_.profile_file_prefix
_.efConstruction
_.allow_tf32

