"""Network modules (LoRA) for --network_module."""
