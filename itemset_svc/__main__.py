"""``python -m itemset_svc [--port 50051 --redis-url ... --bundle DIR ...]`` (env: SPECREC_ITEMSET_*)."""

from specrec_rpc.server import main

from .service import ItemSetService
from .settings import ItemSetSettings

if __name__ == "__main__":
    main(ItemSetService, ItemSetSettings)
