"""Hugging Face formats: ``save_pretrained`` model directories and Trainer ``checkpoint-N/``
(``files``: names; ``reader``: lazy sources; ``model``: Trainer's model and optimizer grouping;
``importer``; ``export``), and peft adapter directories (``peft``)."""
