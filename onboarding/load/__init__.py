"""The load stage: resolve MODEL (an HF directory, hf:<type>, file.py:Name, module:Name or a
built-in example), apply overrides, build the full-size model on `meta` for exact accounting and a
proxy for real execution (`model.json`)."""
