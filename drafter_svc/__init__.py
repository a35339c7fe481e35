"""gRPC drafter service: retrieval (UniSRec-style) and self-draft (SpecGR++) modes over faiss."""
