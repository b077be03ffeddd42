"""Model inputs: the packed-batch contract and the producers that fill it."""
