"""The generate stage: render a family's template into a self-contained kernel module, write and
import it by path, check each candidate against its reference, and compile it ahead of time for
sm_90 (`candidates.json`, the rendered modules)."""
