"""The checkpoints users bring and take away, read and written beside our own format:

- ``source``: the lazy ``Source`` contract (a unit's tensors, their bytes, the training state);
  ``sources.open_source`` tells which kind a path is and opens it; ``tailored``: a run read as
  a source;
- ``hf``: Hugging Face ``save_pretrained`` model directories, Trainer ``checkpoint-N/`` and
  peft adapter directories (import, read lazily, written through their sinks: ``outputs/``);
- ``deepspeed``: DeepSpeed checkpoints (import with DeepSpeed's converter, read as a merge
  source, export universal).

Each format's ``files`` module knows its names only and imports neither torch nor DeepSpeed;
nothing here imports ``merge`` or ``cli``. Import the module you need."""
