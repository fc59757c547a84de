"""Planning a batch: pure functions from samples and array metadata to flat tables."""
