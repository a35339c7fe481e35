"""The item-set service: valid SIDs, SID <-> item mapping, prefix masks and
versioned catalogue writes, kept in Redis and served over gRPC
(``specrec.v1.ItemSet``).

- :mod:`itemset_svc.store`   the Redis layout and every read/write on it;
- :mod:`itemset_svc.tokenizer` text -> SID for new items (bundle codebooks + MiniLM);
- :mod:`itemset_svc.load`    bulk load of a bundle's catalogue (``python -m itemset_svc.load``);
- :mod:`itemset_svc.service` the servicer and :class:`ItemSetService` (``python -m itemset_svc``).
"""
