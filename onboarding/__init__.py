"""onboard: adapt a new open-weight model — operator graph, kernels, alignment, training."""

__version__ = "0.1.0"
__all__ = ["__version__"]
