"""Answers and their scores: greedy generation, metrics, cut lists."""
