"""The embedded default's data, made here: synthetic videos with known answers, a locally trained
tokenizer, and a tiny Qwen3.5 checkpoint, optionally pretrained to see the ball."""
