"""``stoker bench``: stoker against its peers on the same seeded crops, in one process run."""
