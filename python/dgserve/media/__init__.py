"""Media inputs (images): decoding, limits and preprocessing (docs/images.md)."""
