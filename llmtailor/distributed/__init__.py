"""How the ranks of a job talk: the commit coordinator (``coordinator.py``) and the progress it
shows for a rank at long work (``progress.py``, which imports nothing: the store's torch-free
paths count on it). A floor below the store (its writer commits through it) that imports
nothing of llmtailor but ``errors``."""
