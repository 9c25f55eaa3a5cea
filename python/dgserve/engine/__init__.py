"""The engine layer: requests in, committed blocks out."""
