"""The trainer feed on top of the façades: the replay sampler and the PyTorch dataset."""
