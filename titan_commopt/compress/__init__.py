"""Compression building blocks: DCT chunking, top-k, replicators, wire packing."""
