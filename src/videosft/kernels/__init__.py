"""Kernel selection and the kernels themselves, each checked against transformers' own forward before it is bound."""
