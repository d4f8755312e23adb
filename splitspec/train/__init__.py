"""Training: the built-in target's corpus (``corpus``), tokenizer (``bpe``) and weights (``target``),
and DFlash drafts for a frozen target (``data`` reads and packs text, ``draft`` trains, ``main``
is the ``splitspec train-draft`` command)."""
