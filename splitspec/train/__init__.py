"""Training: the built-in target's corpus, tokenizer and weights, and DFlash drafts for a target."""
