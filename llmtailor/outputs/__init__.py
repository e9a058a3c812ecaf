"""Outputs: where a merge, an import or an export writes, as sinks that take one unit at a time.

- ``directory``: the one way an output directory is opened (a temporary directory beside it,
  published atomically, removed on failure, never over an existing output) and a scratch
  directory made beside one;
- ``sink``: the ``Sink`` contract and the ``OutputUnit`` it takes, shard sizes (``parse_size``);
- ``run``: a run of one committed snapshot (``RunSink``; imports, ``merge --format tailor``);
- ``shards``: tensors as safetensors shards of at most ``max_shard_size`` bytes, with an index.

The sinks of other formats live with their format: a ``save_pretrained`` model directory and a
Trainer ``checkpoint-N/`` in ``interop/hf/export.py``, a peft adapter directory in
``interop/hf/peft.py``. Imports nothing of llmtailor above the store; import the module you need.
"""
