"""``splitspec bench``: how fast each part and the whole split system run (see ``main``)."""
