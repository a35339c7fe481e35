from specrec_rpc.server import main

from .service import GatewayService, GatewaySettings

if __name__ == "__main__":
    main(GatewayService, GatewaySettings)
