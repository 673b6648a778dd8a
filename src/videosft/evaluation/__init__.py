"""Answers and their scores: greedy generation, metrics, cut lists; and the checks of a saved adapter."""
