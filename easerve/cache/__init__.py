"""The encoder-output cache: its pure bookkeeping (policy), the encode side (embeddings), the gateway side (gateway) and media content hashing."""
