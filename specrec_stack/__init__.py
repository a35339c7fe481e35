"""The local stack: tooling that runs SpecRec's services on one machine, for a developer, the tests and the
benchmarks (not imported by any service).

- :mod:`.localstack`: Redis (found or started) and the four services as processes (:class:`~.localstack.ServiceProcs`),
  health waits, namespaces;
- :mod:`.localsentinel`: a local Redis primary, replicas and Sentinels (the failover tests and drills);
- :mod:`.cli`: the ``specrec stack up|down`` and ``specrec recommend`` subcommands (added to the ``specrec`` tool
  through the ``specrec.commands`` entry point).
"""
