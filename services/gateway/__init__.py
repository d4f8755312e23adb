"""Gateway: public API, tokenization, tree building and the speculation loop."""
