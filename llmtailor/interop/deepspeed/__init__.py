"""DeepSpeed checkpoints: recognised (``files``), imported with DeepSpeed's own converter
(``importer``), written as universal checkpoints (``export``)."""
