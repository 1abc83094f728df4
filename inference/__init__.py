"""Model-facing ground floor: manifest, export, tokenizer, buckets, pooling, backends, Triton."""
