"""Item drafters: what proposes candidate items to the verifier (see :mod:`.base`): SASRec's own best items
(:mod:`.sasrec`), the retrieval drafter (:mod:`.retrieval`), the self-draft head (:mod:`.self_draft`) and a
vector index over item embeddings (:mod:`.vector`)."""
