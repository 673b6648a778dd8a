"""What a window becomes for the model: token budget, chat, video layout, sample."""
