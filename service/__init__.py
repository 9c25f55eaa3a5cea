"""dgserve's gRPC application (not an installed package): run it as ``python -m service``."""
