"""The align stage: the patched proxy against the eager reference, block by block, forward and
backward, with bounds from the unpatched model's own noise floor in 16-bit (`alignment.json`)."""
