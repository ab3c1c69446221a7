"""graphrt.spec: device-neutral speculative decoding (frozen-KV MTP drafting, verify trees, lossless acceptance)."""
