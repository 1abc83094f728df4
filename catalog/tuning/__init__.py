"""`embedcar model tune`: fine-tune a prepared model on a catalog (and query logs), gate it on held-out data,
publish it."""
