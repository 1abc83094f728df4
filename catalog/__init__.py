"""Product catalog: sources, the batch embedding job and the FAISS product index."""
