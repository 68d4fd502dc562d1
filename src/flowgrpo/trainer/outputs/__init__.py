"""What a run leaves behind: the diffusers LoRA export, the model card, the Hub push, contact sheets and media."""
