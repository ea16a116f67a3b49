"""One module per paper table, each defining ``STUDY``. They live in the package (not at the repository top) so that
``python -m hfpfl.experiments run <name>`` finds them from any directory and an installed hfpfl carries them."""
