"""The tune stage: an Optuna (or grid) search over a kernel's tile configs per shape bucket, every
trial checked for correctness in a worker subprocess before it is timed (`*.tuned.json`)."""
