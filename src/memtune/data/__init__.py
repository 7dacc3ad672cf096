"""Training data: readers, templates, encoding, the tokenized cache, batching."""
