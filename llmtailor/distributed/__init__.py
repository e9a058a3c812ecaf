"""How the ranks of a job talk: the commit coordinator (``coordinator.py``). A floor below the
store (its writer commits through it) that imports nothing of llmtailor but ``errors``."""
