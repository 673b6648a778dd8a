"""What a window becomes for the model: chat and labels, video layout, sample, prompt."""
