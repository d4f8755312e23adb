"""Training: ``data`` reads and packs text, ``draft`` trains a DFlash drafter for a frozen target,
``main`` is the ``splitspec train-draft`` command."""
