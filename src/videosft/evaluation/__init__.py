"""Answers and their scores: the model loaded for inference, greedy generation, metrics, cut lists;
and the checks of a saved adapter."""
