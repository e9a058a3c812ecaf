"""The checkpoint formats users bring and take away: Hugging Face Trainer and model
directories (``hf_import``, ``hf_export``), DeepSpeed (``deepspeed_import``,
``deepspeed_export``), and recognising their directories (``checkpoint_dirs``, which imports
neither torch nor DeepSpeed). Import the module you need."""
