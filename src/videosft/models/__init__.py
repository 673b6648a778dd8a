"""What differs between the model families, their checkpoints, and where LoRA goes."""
