"""The item-set service: valid SIDs, SID <-> item mapping, prefix masks and
versioned catalogue writes, kept in Redis and served over gRPC
(``specrec.v1.ItemSet``).

- :mod:`itemset_svc.store`     the catalogue in Redis, joining :mod:`~itemset_svc.keys` (the layout),
  :mod:`~itemset_svc.reads`, :mod:`~itemset_svc.writes` (upsert, delete, rollback),
  :mod:`~itemset_svc.publish` (staging and publishing a version, replica WAIT) and
  :mod:`~itemset_svc.bulk` (bulk load);
- :mod:`itemset_svc.tokenizer` text -> SID for new items (bundle codebooks + MiniLM);
- :mod:`itemset_svc.load`      bulk load of a bundle's catalogue (``python -m itemset_svc.load``);
- :mod:`itemset_svc.service`   :class:`ItemSetService`, its lifecycle (``python -m itemset_svc``);
- :mod:`itemset_svc.servicer`  the gRPC RPCs, with :mod:`~itemset_svc.validation` for their requests;
- :mod:`itemset_svc.integrity` the mirror of the catalogue (:mod:`~itemset_svc.mirror`), the watch loop, restores.
"""
