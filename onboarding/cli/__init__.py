"""The `onboard` command line: `main` in `main.py`, one module per command beside it."""
