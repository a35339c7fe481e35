from specrec_rpc.server import main

from .service import DrafterService, DrafterSettings

if __name__ == "__main__":
    main(DrafterService, DrafterSettings)
