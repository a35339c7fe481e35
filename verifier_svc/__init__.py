"""gRPC verifier service: the GR model (torch or ONNX Runtime), encoder sessions, dynamic batching."""
