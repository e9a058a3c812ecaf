"""Hugging Face formats: ``save_pretrained`` model directories and Trainer ``checkpoint-N/``
(``files``: names; ``weights``: the one reader of a model directory's weights; ``reader``: lazy
sources; ``model``: Trainer's model and optimizer grouping; ``importer``; ``export``: the sinks
that write both), and peft adapter directories (``peft``)."""
