from specrec_rpc.server import main

from .service import VerifierService, VerifierSettings

if __name__ == "__main__":
    main(VerifierService, VerifierSettings)
