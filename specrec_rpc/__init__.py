"""What the SpecRec services share: generated gRPC code (``specrec_rpc.v1``,
made by :mod:`specrec_rpc.codegen`), tensor messages, settings, the server
bootstrap (health, reflection, metrics, logging, graceful shutdown), errors,
client channels and the catalogue watcher."""
