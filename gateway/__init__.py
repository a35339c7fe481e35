"""gRPC gateway: Recommend, budgets, the policy loop over remote components, degradation."""
