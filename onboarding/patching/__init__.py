"""Patching a model's blocks with kernels: the core calls each family's binding hook and keeps a
binding only once its output reproduces the block's own (first-call calibration); the shared
machinery several families' bindings use lives here, naming no family."""
