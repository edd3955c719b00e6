"""Real frameworks (Lightning, Accelerate, transformers Trainer) under commcheck.patch()."""
