"""LoRA adapters over the base model: PEFT files in (peft.py), per-layer stacked slots and the
per-step rows of each adapter (layers.py), and the worker's manager of slots (manager.py)."""
