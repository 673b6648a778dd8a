"""Training's parts: batches, the data order, the memory plan."""
